"""The KV index: which blocks each worker holds, and whose they are (DESIGN.md §2).

Fed by decoded KV events, per worker. It answers the ledger's and the routers' questions:
how many tokens of a session are resident on a worker (a block counts once per session,
however often it was touched), how long a request's resident prefix is, and how many
tokens the sessions counted on a worker share (so shared prefixes are not counted twice).

Semantics, chosen to match vLLM's block pool:
- ``BlockStored`` of a hash not yet resident admits it; the request's ``session_id`` (and
  our ``continuation_id``) become its admitter. Storing a hash that is already resident
  records the session as a toucher and changes nothing else. With
  ``kv_cache_report_mode: "full"`` vLLM reports every prefix-cache hit as a ``BlockStored``
  from block 0 that is indistinguishable from a fresh store, so a re-store cannot be
  counted as a second copy. The price: when vLLM really holds two copies under one hash
  (two requests computed the same block at once) and evicts one, the index drops the hash
  although a copy stays; it under-reports residency until the next store, never over.
- ``BlockRemoved`` removes the block. Removing an unknown hash is counted, not fatal:
  events may predate the subscription.
- ``AllBlocksCleared`` and :meth:`KVIndex.reset_worker` empty a worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from scheduler.kv_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    block_token_counts,
)


class _Block:
    __slots__ = ("parent", "tokens", "prefix_tokens", "admitter", "continuation", "sessions",
                 "counted")

    def __init__(self, parent: BlockHash | None, tokens: int, prefix_tokens: int,
                 admitter: str | None, continuation: str | None) -> None:
        self.parent = parent
        self.tokens = tokens
        self.prefix_tokens = prefix_tokens
        self.admitter = admitter
        self.continuation = continuation
        # sessions that stored or touched this block, in first-touch order
        self.sessions: dict[str, None] = {}
        # how many of ``sessions`` are currently counted on the worker
        self.counted = 0


class WorkerKV:
    """One worker's resident blocks and the per-session views derived from them.

    Invariants: ``session_tokens[s] == sum(b.tokens for b in blocks if s in b.sessions)``;
    ``shared_tokens == sum(b.tokens * max(0, b.counted - 1) for b in blocks)``.
    """

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, _Block] = {}
        self.session_tokens: dict[str, int] = {}
        self.session_blocks: dict[str, dict[BlockHash, None]] = {}
        self.continuation_blocks: dict[str, dict[BlockHash, None]] = {}
        self.counted: dict[str, None] = {}
        self.shared_tokens = 0
        self.events_seen = 0
        self.unknown_removals = 0

    # -- events ----------------------------------------------------------------------------

    def store(self, event: BlockStored) -> None:
        session = event.session_id
        parent = event.parent_block_hash
        parent_block = self.blocks.get(parent) if parent is not None else None
        prefix = parent_block.prefix_tokens if parent_block is not None else 0
        for block_hash, tokens in zip(event.block_hashes, block_token_counts(event)):
            prefix += tokens
            block = self.blocks.get(block_hash)
            if block is None:
                block = _Block(parent, tokens, prefix, session, event.continuation_id)
                self.blocks[block_hash] = block
                if event.continuation_id is not None:
                    self.continuation_blocks.setdefault(event.continuation_id, {})[block_hash] = None
            if session is not None:
                self._touch(block_hash, block, session)
            parent = block_hash

    def _touch(self, block_hash: BlockHash, block: _Block, session: str) -> None:
        if session in block.sessions:
            return
        block.sessions[session] = None
        self.session_tokens[session] = self.session_tokens.get(session, 0) + block.tokens
        self.session_blocks.setdefault(session, {})[block_hash] = None
        if session in self.counted:
            block.counted += 1
            if block.counted >= 2:
                self.shared_tokens += block.tokens

    def remove(self, event: BlockRemoved) -> None:
        for block_hash in event.block_hashes:
            block = self.blocks.get(block_hash)
            if block is None:
                self.unknown_removals += 1
                continue
            del self.blocks[block_hash]
            if block.counted >= 2:
                self.shared_tokens -= block.tokens * (block.counted - 1)
            for session in block.sessions:
                left = self.session_tokens[session] - block.tokens
                owned = self.session_blocks[session]
                del owned[block_hash]
                if owned:
                    self.session_tokens[session] = left
                else:
                    del self.session_tokens[session]
                    del self.session_blocks[session]
            if block.continuation is not None:
                labelled = self.continuation_blocks[block.continuation]
                del labelled[block_hash]
                if not labelled:
                    del self.continuation_blocks[block.continuation]

    def apply(self, event: KVEvent) -> None:
        self.events_seen += 1
        if isinstance(event, BlockStored):
            self.store(event)
        elif isinstance(event, BlockRemoved):
            self.remove(event)
        elif isinstance(event, AllBlocksCleared):
            self.clear()
        else:  # pragma: no cover - the decoder only yields the three kinds
            raise TypeError(f"unknown KV event {type(event).__name__}")

    def clear(self) -> None:
        """Drop every block; which sessions are counted is the ledger's and survives."""
        self.blocks = {}
        self.session_tokens = {}
        self.session_blocks = {}
        self.continuation_blocks = {}
        self.shared_tokens = 0

    # -- counting ----------------------------------------------------------------------

    def set_counted(self, session: str, counted: bool) -> None:
        """Include or exclude ``session`` from the shared-token count."""
        if counted == (session in self.counted):
            return
        delta = 1 if counted else -1
        if counted:
            self.counted[session] = None
        else:
            del self.counted[session]
        for block_hash in self.session_blocks.get(session, ()):
            block = self.blocks[block_hash]
            before = max(0, block.counted - 1)
            block.counted += delta
            self.shared_tokens += block.tokens * (max(0, block.counted - 1) - before)

    # -- queries -------------------------------------------------------------------------

    def prefix_tokens(self, hashes: Sequence[BlockHash]) -> int:
        """Tokens of the longest resident prefix of ``hashes``."""
        total = 0
        for block_hash in hashes:
            block = self.blocks.get(block_hash)
            if block is None:
                break
            total += block.tokens
        return total

    def continuation_tokens(self, continuation_ids: Iterable[str]) -> int:
        """The longest resident prefix admitted under any of these continuation ids."""
        best = 0
        for cid in continuation_ids:
            for block_hash in self.continuation_blocks.get(cid, ()):
                best = max(best, self.blocks[block_hash].prefix_tokens)
        return best

    @property
    def resident_tokens(self) -> int:
        return sum(block.tokens for block in self.blocks.values())


class KVIndex:
    """Every worker's :class:`WorkerKV`, fed by event batches."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerKV] = {}

    def worker(self, name: str) -> WorkerKV:
        kv = self._workers.get(name)
        if kv is None:
            kv = self._workers[name] = WorkerKV()
        return kv

    def workers(self) -> list[str]:
        return list(self._workers)

    def apply_batch(self, worker: str, batch: EventBatch) -> int:
        """Apply one batch; returns how many block hashes it carried."""
        kv = self.worker(worker)
        hashes = 0
        for event in batch.events:
            kv.apply(event)
            if not isinstance(event, AllBlocksCleared):
                hashes += len(event.block_hashes)
        return hashes

    def apply_events(self, worker: str, events: Iterable[KVEvent]) -> None:
        kv = self.worker(worker)
        for event in events:
            kv.apply(event)

    def reset_worker(self, worker: str) -> None:
        """Forget everything about ``worker`` (its engine restarted); counting is kept."""
        kv = self.worker(worker)
        kv.clear()
        kv.events_seen = 0

    def has_events(self, worker: str) -> bool:
        kv = self._workers.get(worker)
        return kv is not None and kv.events_seen > 0

    def session_tokens(self, worker: str, session: str) -> int:
        kv = self._workers.get(worker)
        return 0 if kv is None else kv.session_tokens.get(session, 0)

    def sessions_on(self, worker: str) -> list[str]:
        kv = self._workers.get(worker)
        return [] if kv is None else list(kv.session_tokens)
