"""The KV index: which blocks each worker holds, and whose they are (architecture.md §2).

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
  events may predate the subscription, a batch may have been lost, or (the duplicate case
  above) the index dropped the hash at the first of two removals.
- ``AllBlocksCleared`` and :meth:`KVIndex.reset_worker` empty a worker.

Resident prefixes (:meth:`WorkerKV.continuation_tokens`) are contiguous from block 0. A block's
position is its ``prefix_tokens``, counted from the first ancestor the index knows, so a chain
whose start predates the subscription is measured short. Two rules keep the answer from
running past evicted tokens:
- *Holes.* A hash removed (known or not) while resident blocks name it as their parent is a
  hole; a block whose chain of resident parents reaches a hole is in no resident prefix. The
  hole lasts until that hash is stored again or its last child goes (a store under it joins
  it). Any other parent the index does not hold starts a chain, like a root: it cannot be told
  from one stored before the subscription.
- *Caps.* The engine plugin attributes a removal to the continuation C that first admitted
  the hash and the prefix length N the hash covers. For a hash the index does not know, that
  is all it learns: C's resident prefix now ends before N, so no block labelled C ending at N
  or beyond counts for C (its other blocks still do). A store labelled C whose blocks reach
  position p re-admitted everything up to p (an engine stores a block only while all its
  ancestors are resident), so it lifts C's caps at or below p and keeps the deeper ones; a
  store under another label lifts nothing. Caps go with C's last labelled block, and none is
  set for a C with no labelled block: a later store of C then ends below N or lifts it anyway.
  Positions of a chain measured short are compared as they are: the answer for C stays below
  N, a cap is lifted late, never early. Attribution is read from single-hash removals (the
  plugin sends no other kind); a known removal needs no cap, the block and holes cover it.
Cost: with no hole, a query reads each block of its continuations once, as before; with
holes, each chain is walked once between changes to them (cached per block).

Media. vLLM publishes its host tier's events (CPU offloading, ``medium="CPU"``) on the same
stream as the GPU pool's (``"GPU"``, or no medium from engines that predate media). The two are
kept apart: :class:`WorkerKV` is the GPU alone (every query above, and so ``U``, counts GPU KV
only), and :class:`HostKV` holds what the worker's host tier holds, per session. A hash can be
in both; a CPU removal never touches the GPU side and a GPU removal never the CPU side.
``AllBlocksCleared`` clears the GPU pool (vLLM's ``reset_prefix_cache``); the host tier's
holdings go only with its own removals or :meth:`KVIndex.reset_worker`.

Eviction accounting per worker: ``evicted_tokens`` sums the tokens of removed blocks the index
knew; a removed unknown hash adds none (it covered at most a block, but how much is unknown;
``num_tokens`` is its end position, not its size) and counts in ``unknown_removals``;
``attributed_removals`` counts removed hashes that carried a continuation. Clears and resets
are not evictions and count nothing. These counters survive clears and resets.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence

from scheduler.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    block_token_counts,
)


class _Block:
    __slots__ = ("parent", "up", "tokens", "prefix_tokens", "admitter", "continuation",
                 "sessions", "counted", "children", "checked", "rooted")

    def __init__(self, parent: BlockHash | None, up: _Block | None, tokens: int,
                 prefix_tokens: int, admitter: str | None, continuation: str | None) -> None:
        self.parent = parent
        # the parent's block when it was resident at admission: unlinking through it spares
        # a lookup in ``blocks`` on every eviction
        self.up = up
        self.tokens = tokens
        self.prefix_tokens = prefix_tokens
        self.admitter = admitter
        self.continuation = continuation
        # sessions that stored or touched this block, in first-touch order
        self.sessions: dict[str, None] = {}
        # how many of ``sessions`` are currently counted on the worker; kept only once a
        # second session holds the block (a block of one session shares nothing, so
        # counting it or not changes no total: pausing a program then costs its shared
        # blocks, not all of them)
        self.counted = 0
        # resident blocks whose parent is this hash; -1 once removed
        self.children = 0
        # ``rooted`` (no hole above this block) is valid while ``checked`` is the worker's epoch
        self.checked = -1
        self.rooted = True


class WorkerKV:
    """One worker's resident blocks and the per-session views derived from them.

    **Invariants** (cited where kept):

    1. ``session_tokens[s] == sum(b.tokens for b in blocks if s in b.sessions)``.
    2. ``shared_tokens == sum(b.tokens * max(0, b.counted - 1) for b in blocks if len(b.sessions) > 1)``,
       where ``b.counted`` is the number of counted sessions of ``b`` (kept for those blocks only).
    3. ``shared_blocks[s]`` holds exactly the blocks of ``s`` that another session holds too.
    4. ``children(h) == sum(1 for b in blocks if b.parent == h)``, kept in ``blocks[h].children``
       for a resident ``h``, else in ``holes[h]`` or ``_orphans[h]`` (disjoint; zero counts absent).
    """

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, _Block] = {}
        self.session_tokens: dict[str, int] = {}
        self.session_blocks: dict[str, dict[BlockHash, None]] = {}
        self.shared_blocks: dict[str, dict[BlockHash, None]] = {}
        self.continuation_blocks: dict[str, dict[BlockHash, None]] = {}
        self.counted: dict[str, None] = {}
        self.shared_tokens = 0
        self.events_seen = 0
        self.unknown_removals = 0
        self.attributed_removals = 0
        self.evicted_tokens = 0
        # removed hash -> how many resident blocks still name it as their parent
        self.holes: dict[BlockHash, int] = {}
        # the same for hashes never seen removed (their chains start below them)
        self._orphans: dict[BlockHash, int] = {}
        # continuation -> ascending end positions its resident prefix no longer reaches
        self.caps: dict[str, list[int]] = {}
        # Bumped whenever a hash with resident children comes, or goes while not cut off
        # already: only then can a block's ``rooted`` change, so cached values stay good.
        self._epoch = 0

    # -- events ----------------------------------------------------------------------------

    def store(self, event: BlockStored) -> None:
        session = event.session_id
        continuation = event.continuation_id
        parent = event.parent_block_hash
        parent_block = self.blocks.get(parent) if parent is not None else None
        prefix = parent_block.prefix_tokens if parent_block is not None else 0
        blocks = self.blocks
        holes, orphans = self.holes, self._orphans
        above = parent_block
        for block_hash, tokens in zip(event.block_hashes, block_token_counts(event)):
            prefix += tokens
            block = blocks.get(block_hash)
            if block is None:
                block = _Block(parent, above, tokens, prefix, session, continuation)
                blocks[block_hash] = block
                if above is not None:
                    above.children += 1  # keeps invariant 4
                elif parent is not None:
                    if parent in holes:
                        holes[parent] += 1
                    else:
                        orphans[parent] = orphans.get(parent, 0) + 1
                # filling a hole, or linking chains that started at this hash, may change
                # which blocks are rooted
                if holes and block_hash in holes:
                    block.children = holes.pop(block_hash)
                    self._epoch += 1
                elif orphans and block_hash in orphans:
                    block.children = orphans.pop(block_hash)
                    self._epoch += 1
                if continuation is not None:
                    self.continuation_blocks.setdefault(continuation, {})[block_hash] = None
            if session is not None:
                self._touch(block_hash, block, session)
            parent = block_hash
            above = block
        if continuation is not None and self.caps and event.block_hashes:
            self._lift_caps(continuation, prefix)

    def _lift_caps(self, continuation: str, reached: int) -> None:
        caps = self.caps.get(continuation)
        if caps is None or caps[0] > reached:
            return
        del caps[:bisect_right(caps, reached)]
        if not caps:
            del self.caps[continuation]

    def _touch(self, block_hash: BlockHash, block: _Block, session: str) -> None:
        if session in block.sessions:
            return
        sessions = block.sessions
        sessions[session] = None
        self.session_tokens[session] = self.session_tokens.get(session, 0) + block.tokens  # invariant 1
        self.session_blocks.setdefault(session, {})[block_hash] = None
        if len(sessions) == 1:
            return
        counted = self.counted
        shared = self.shared_blocks
        if len(sessions) == 2:
            # Shared from now on: count it, and list it under its first session too (invariant 3).
            (first,) = (s for s in sessions if s != session)
            shared.setdefault(first, {})[block_hash] = None
            block.counted = 1 if first in counted else 0
        shared.setdefault(session, {})[block_hash] = None
        if session in counted:
            block.counted += 1
            if block.counted >= 2:
                self.shared_tokens += block.tokens  # keeps invariant 2

    def remove(self, event: BlockRemoved) -> None:
        hashes = event.block_hashes
        attributed = event.continuation_id
        if attributed is not None:
            self.attributed_removals += len(hashes)
        blocks = self.blocks
        holes, orphans = self.holes, self._orphans
        for block_hash in hashes:
            block = blocks.get(block_hash)
            if block is None:
                self.unknown_removals += 1
                if orphans and block_hash in orphans:
                    holes[block_hash] = orphans.pop(block_hash)
                    self._epoch += 1
                if attributed is not None and event.num_tokens is not None and len(hashes) == 1:
                    self._cap(attributed, event.num_tokens)
                continue
            del blocks[block_hash]
            self.evicted_tokens += block.tokens
            parent = block.parent
            children = block.children
            block.children = -1
            up = block.up
            block.up = None
            cut = False
            if up is not None and up.children > 0:
                up.children -= 1
            elif parent is not None:
                hole = holes.get(parent)
                if hole is not None:
                    # inlined: a chain evicted from its head comes here on every removal
                    cut = True
                    if hole > 1:
                        holes[parent] = hole - 1
                    else:
                        del holes[parent]  # a hole nobody hangs from is forgotten
                elif parent == block_hash:
                    children -= 1  # it counted itself
                else:
                    self._unlink(parent)
            if children:
                # Its descendants lose their prefix, unless a hole above had cut them off
                # already (the common case when eviction runs from a chain's head).
                if not (cut or (block.checked == self._epoch and not block.rooted)):
                    self._epoch += 1
                holes[block_hash] = children
            multi = len(block.sessions) > 1
            if multi and block.counted >= 2:
                self.shared_tokens -= block.tokens * (block.counted - 1)  # keeps invariant 2
            for session in block.sessions:
                if multi:
                    shared = self.shared_blocks[session]
                    del shared[block_hash]
                    if not shared:
                        del self.shared_blocks[session]
                left = self.session_tokens[session] - block.tokens  # keeps invariants 1 and 3
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
                    if self.caps:
                        self.caps.pop(block.continuation, None)

    def _unlink(self, parent: BlockHash) -> None:
        """A child of ``parent`` (not a hole) left; its ``up`` was not ``parent``'s block."""
        above = self.blocks.get(parent)
        if above is not None:
            above.children -= 1
            return
        left = self._orphans[parent] - 1
        if left:
            self._orphans[parent] = left
        else:
            del self._orphans[parent]

    def _cap(self, continuation: str, end: int) -> None:
        if continuation not in self.continuation_blocks:
            return  # nothing of it to hide; a later store of it ends below ``end`` or lifts it
        caps = self.caps.setdefault(continuation, [])
        i = bisect_left(caps, end)
        if i == len(caps) or caps[i] != end:
            caps.insert(i, end)

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
        self.shared_blocks = {}
        self.continuation_blocks = {}
        self.shared_tokens = 0
        self.holes = {}
        self._orphans = {}
        self.caps = {}
        self._epoch += 1

    # -- counting ----------------------------------------------------------------------

    def set_counted(self, session: str, counted: bool) -> None:
        """Include or exclude ``session`` from the shared-token count."""
        if counted == (session in self.counted):
            return
        blocks = self.blocks
        change = 0
        # A block's share max(0, counted - 1) moves by one exactly when it is (or becomes)
        # held by two or more counted sessions.
        if counted:
            self.counted[session] = None
            for block_hash in self.shared_blocks.get(session, ()):
                block = blocks[block_hash]
                block.counted += 1
                if block.counted >= 2:
                    change += block.tokens
        else:
            del self.counted[session]
            for block_hash in self.shared_blocks.get(session, ()):
                block = blocks[block_hash]
                if block.counted >= 2:
                    change -= block.tokens
                block.counted -= 1
        self.shared_tokens += change  # keeps invariant 2

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
        """The longest resident prefix admitted under any of these continuation ids: the
        deepest block labelled with one of them that no hole cuts off and no cap of its
        continuation excludes (see the module docstring)."""
        best = 0
        blocks = self.blocks
        check = bool(self.holes)
        epoch = self._epoch
        for cid in continuation_ids:
            labelled = self.continuation_blocks.get(cid)
            if not labelled:
                continue
            caps = self.caps.get(cid)
            below = caps[0] if caps else None
            for block_hash in labelled:
                block = blocks[block_hash]
                end = block.prefix_tokens
                if end <= best or (below is not None and end >= below):
                    continue
                if check and not (block.rooted if block.checked == epoch else self._rooted(block)):
                    continue
                best = end
        return best

    def _rooted(self, block: _Block) -> bool:
        """Whether no hole lies above ``block``; walks each chain once per epoch."""
        epoch = self._epoch
        if block.checked == epoch:
            return block.rooted
        blocks, holes = self.blocks, self.holes
        path = []
        while True:
            if block.checked == epoch:
                # known, or on this walk already: a loop of resident blocks has no hole
                rooted = block.rooted
                break
            block.checked, block.rooted = epoch, True
            path.append(block)
            parent = block.parent
            if parent is None:
                rooted = True
                break
            above = blocks.get(parent)
            if above is None:
                rooted = parent not in holes
                break
            block = above
        for walked in path:
            walked.rooted = rooted
        return rooted

    @property
    def resident_tokens(self) -> int:
        return sum(block.tokens for block in self.blocks.values())


class HostKV:
    """One worker's host-tier (CPU) blocks and whose they are.

    The tier's own events name no session (vLLM's offloading events carry the block keys; the
    simulator's the same), so a stored block belongs to the sessions the event names, else to
    the sessions holding that hash on the worker's GPU when the store lands (the tier stores
    write-through from running requests, so the GPU copy is there then). A block whose GPU
    copy is already gone counts for nobody: it is under-reported, never over.

    Invariant 5: ``session_tokens[s] == sum(tokens of b for b in blocks if s in sessions of b)``
    and ``session_blocks[s]`` lists exactly those blocks (numbered after :class:`WorkerKV`'s).
    Bounded by the tier's capacity, as the GPU side is by the pool's.
    """

    def __init__(self) -> None:
        # hash -> (tokens, sessions)
        self.blocks: dict[BlockHash, tuple[int, tuple[str, ...]]] = {}
        self.session_tokens: dict[str, int] = {}
        self.session_blocks: dict[str, dict[BlockHash, None]] = {}
        self.events_seen = 0
        self.unknown_removals = 0

    def store(self, event: BlockStored, gpu: WorkerKV) -> None:
        named = (event.session_id,) if event.session_id is not None else None
        for block_hash, tokens in zip(event.block_hashes, block_token_counts(event)):
            if block_hash in self.blocks:
                continue  # a re-store of a held chunk changes nothing (the manager's reuse)
            if named is not None:
                sessions = named
            else:
                on_gpu = gpu.blocks.get(block_hash)
                sessions = tuple(on_gpu.sessions) if on_gpu is not None else ()
            self.blocks[block_hash] = (tokens, sessions)
            for session in sessions:  # keeps invariant 5
                self.session_tokens[session] = self.session_tokens.get(session, 0) + tokens
                self.session_blocks.setdefault(session, {})[block_hash] = None

    def remove(self, event: BlockRemoved) -> None:
        for block_hash in event.block_hashes:
            held = self.blocks.pop(block_hash, None)
            if held is None:
                self.unknown_removals += 1
                continue
            tokens, sessions = held
            for session in sessions:  # keeps invariant 5
                owned = self.session_blocks[session]
                del owned[block_hash]
                if owned:
                    self.session_tokens[session] -= tokens
                else:
                    del self.session_blocks[session]
                    del self.session_tokens[session]

    def clear(self) -> None:
        self.blocks = {}
        self.session_tokens = {}
        self.session_blocks = {}

    @property
    def resident_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.blocks.values())


def _on_host(event: KVEvent) -> bool:
    return getattr(event, "medium", None) == MEDIUM_CPU


class KVIndex:
    """Every worker's :class:`WorkerKV` (GPU) and :class:`HostKV` (host tier), fed by event
    batches whose events say their medium."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerKV] = {}
        self._hosts: dict[str, HostKV] = {}

    def worker(self, name: str) -> WorkerKV:
        kv = self._workers.get(name)
        if kv is None:
            kv = self._workers[name] = WorkerKV()
        return kv

    def host(self, name: str) -> HostKV:
        host = self._hosts.get(name)
        if host is None:
            host = self._hosts[name] = HostKV()
        return host

    def workers(self) -> list[str]:
        return list(self._workers)

    def apply_batch(self, worker: str, batch: EventBatch) -> int:
        """Apply one batch; returns how many block hashes it carried."""
        hashes = 0
        self.apply_events(worker, batch.events)
        for event in batch.events:
            if not isinstance(event, AllBlocksCleared):
                hashes += len(event.block_hashes)
        return hashes

    def apply_events(self, worker: str, events: Iterable[KVEvent]) -> None:
        kv = self.worker(worker)
        for event in events:
            if _on_host(event):
                self._apply_host(worker, kv, event)
            else:
                kv.apply(event)

    def _apply_host(self, worker: str, kv: WorkerKV, event: KVEvent) -> None:
        host = self.host(worker)
        host.events_seen += 1
        if isinstance(event, BlockStored):
            host.store(event, kv)
        elif isinstance(event, BlockRemoved):
            host.remove(event)
        else:  # pragma: no cover - only stores and removals carry a medium
            raise TypeError(f"unexpected host-tier event {type(event).__name__}")

    def reset_worker(self, worker: str) -> None:
        """Forget everything about ``worker`` (its engine restarted, the host tier with it);
        counting is kept."""
        kv = self.worker(worker)
        kv.clear()
        kv.events_seen = 0
        host = self._hosts.get(worker)
        if host is not None:
            host.clear()
            host.events_seen = 0

    def drop_worker(self, worker: str) -> None:
        """Forget ``worker`` altogether (it left the fleet)."""
        self._workers.pop(worker, None)
        self._hosts.pop(worker, None)

    def host_tokens(self, worker: str, session: str) -> int:
        """Tokens of ``session`` the host tier of ``worker`` holds (what a resume there can
        load instead of recomputing, as far as the GPU does not hold them already)."""
        host = self._hosts.get(worker)
        return 0 if host is None else host.session_tokens.get(session, 0)

    def has_events(self, worker: str) -> bool:
        kv = self._workers.get(worker)
        return kv is not None and kv.events_seen > 0

    def session_tokens(self, worker: str, session: str) -> int:
        kv = self._workers.get(worker)
        return 0 if kv is None else kv.session_tokens.get(session, 0)

    def sessions_on(self, worker: str) -> list[str]:
        kv = self._workers.get(worker)
        return [] if kv is None else list(kv.session_tokens)
