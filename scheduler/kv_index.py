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

Ingest (:meth:`KVIndex.apply_batch`, the subscriber's path; ``bench/kv_ingest.py`` times it with
the decode): events apply in order; a run of consecutive unattributed GPU removals, vLLM's one
hash per evicted block, is one removal of all its hashes (the same state, without the per-event
dispatch), and a store's token ids are only counted (a decoded :class:`BlockStoredRaw` leaves
them unparsed). Blocks are untracked structs; a block's sessions are a tuple its store's blocks
share until more than :data:`TUPLE_SESSIONS` hold it. The per-block work is plain bytecode, the
fewest attribute stores (unspecialised on msgspec structs, the dearest step) and dict operations:
a session's tokens with a count of its empty blocks rather than a dict of its blocks, a new
block made counting its successor, a removal's run of one store's blocks settled once
(scheduler/kv_removal.py). Measured, C-level helpers (map, groupby, attrgetter, setattr) cost
more than the bytecode they replace here, for runs this short.

Media. vLLM publishes its host tier's events (CPU offloading, ``medium="CPU"``) on the same
stream as the GPU pool's (``"GPU"``, or no medium from engines that predate media). The two are
kept apart: :class:`WorkerKV` is the GPU alone (every query above, and so ``U``, counts GPU KV
only), and :class:`~scheduler.kv_host.HostKV` (scheduler/kv_host.py) holds what the worker's
host tier holds, per session. A hash can be in both; a CPU removal never touches the GPU side
and a GPU removal never the CPU side.
``AllBlocksCleared`` clears the GPU pool (vLLM's ``reset_prefix_cache``); the host tier's
holdings go only with its own removals or :meth:`KVIndex.reset_worker`.

Eviction accounting per worker: ``evicted_tokens`` sums the tokens of removed blocks the index
knew; a removed unknown hash adds none (it covered at most a block, but how much is unknown;
``num_tokens`` is its end position, not its size) and counts in ``unknown_removals``;
``attributed_removals`` counts removed hashes that carried a continuation. Clears and resets
are not evictions and count nothing. These counters survive clears and resets.

Bound. An engine never holds more blocks than its pool, but its event stream cannot prove
that it is the engine's: forged or broken input could grow a worker's index without end. Once
its capacity is known (:meth:`KVIndex.set_capacity`), each side of a worker's index holds at
most a multiple of the blocks that capacity makes (:data:`GPU_BOUND_FACTOR`,
:data:`HOST_BOUND_FACTOR`), in the engine's block size when the caller knows it, else in
:data:`BOUND_BLOCK_TOKENS`-token blocks; never in the sizes the events claim, which could
stretch it. Past it, the oldest stored blocks are dropped as a removal would drop them (holes
and all), counted in ``overflow_dropped``, not as evictions: the index then under-reports,
never over. A store of more blocks than an eighth of the bound is applied in parts, shedding
between them, so that no single event overshoots. The checks are two length comparisons per
store, so a well-behaved stream, which stays far below the bound, pays nothing else.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping

import msgspec

from scheduler.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    BlockStoredRaw,
    raw_array_len,
    token_counts,
)
from scheduler.kv_host import SHED_FRACTION, HostKV, oldest_over_bound
from scheduler.kv_queries import KVQueries
from scheduler.kv_removal import KVRemoval

# The bound ("Bound" above) in blocks of this many tokens unless the engine's block size is
# given: vLLM's default block size, and the smallest its GPU attention backends commonly run.
BOUND_BLOCK_TOKENS = 16
# The GPU side holds at most this many times the blocks of its capacity. A well-behaved stream
# stays at or under 1 times; the margin is for a capacity configured below the real pool,
# blocks whose removal was lost until the next reset, and smaller blocks (a pool of 8-token
# blocks fills half of it).
GPU_BOUND_FACTOR = 4
# The host tier's own size is not known here (vLLM sizes its CPU offloading in host memory,
# apart from the GPU pool): bounded as if it were up to four times the GPU pool, with the
# same margin. A bigger tier is under-reported (its oldest blocks dropped), never over.
HOST_BOUND_FACTOR = 4 * GPU_BOUND_FACTOR
# A block's sessions are a tuple up to this many (most blocks have one, shared by the blocks
# of its store: no dict per block), a dict past it (membership in O(1) for a widely shared
# prefix).
TUPLE_SESSIONS = 8


class _Block(msgspec.Struct, gc=False, eq=False):
    """One resident block. A struct for its constructor's speed (one per stored block);
    untracked by the cycle collector: a block points only at strings and tuples or dicts of
    them, so it is in no cycle, and a full index is not walked by every collection. No block
    points at another (its parent is found by hash): msgspec structs take no specialised
    attribute store, so keeping such a link, and clearing it on removal, costs more than the
    lookup it spares."""

    parent: BlockHash | None
    tokens: int
    prefix_tokens: int
    admitter: str | None
    continuation: str | None
    # sessions that stored or touched this block, in first-touch order: a tuple (one store's
    # blocks share theirs), a dict once more than :data:`TUPLE_SESSIONS` hold the block
    sessions: tuple[str, ...] | dict[str, None]
    # how many of ``sessions`` are currently counted on the worker; kept only once a
    # second session holds the block (a block of one session shares nothing, so
    # counting it or not changes no total: pausing a program then costs its shared
    # blocks, not all of them)
    counted: int = 0
    # resident blocks whose parent is this hash; a block is made counting one in advance
    # (``WorkerKV._store``: the next block of its store, as a rule)
    children: int = 1
    # ``rooted`` (no hole above this block) is valid while ``checked`` is the worker's epoch
    checked: int = -1
    rooted: bool = True


class WorkerKV(KVQueries, KVRemoval):
    """One worker's resident blocks and the per-session views derived from them.

    **Invariants** (cited where kept):

    1. ``session_tokens[s] == sum(b.tokens for b in blocks if s in b.sessions)``, an entry for
       exactly the sessions that hold a block; ``_zero_blocks[s]`` counts those of no tokens.
    2. ``shared_tokens == sum(b.tokens * max(0, b.counted - 1) for b in blocks if len(b.sessions) > 1)``,
       where ``b.counted`` is the number of counted sessions of ``b`` (kept for those blocks only).
    3. ``shared_blocks[s]`` holds exactly the blocks of ``s`` that another session holds too.
    4. ``children(h) == sum(1 for b in blocks if b.parent == h)``, kept in ``blocks[h].children``
       for a resident ``h``, else in ``holes[h]`` or ``_orphans[h]`` (disjoint; zero counts absent).
    """

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, _Block] = {}
        self.session_tokens: dict[str, int] = {}
        # session -> how many of its blocks cover no tokens (absent when none): with
        # ``session_tokens`` this tells when a session's last block goes, without a dict of
        # its blocks to keep on every store and removal (invariant 1)
        self._zero_blocks: dict[str, int] = {}
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
        self.max_blocks: int | None = None  # None: unbounded (see "Bound"; :meth:`set_bound`)
        self._part_blocks = 0  # a store of more blocks is applied in parts of this many
        # blocks dropped because the index held more than ``max_blocks`` (survives resets)
        self.overflow_dropped = 0

    # -- events ----------------------------------------------------------------------------

    def set_bound(self, max_blocks: int | None) -> None:
        """Hold at most ``max_blocks`` blocks from now on (None: unbounded); blocks over it
        are dropped at once."""
        self.max_blocks = max_blocks
        self._part_blocks = 0 if max_blocks is None else max(max_blocks // SHED_FRACTION, 1)
        self.shed()

    def store(self, event: BlockStored) -> None:
        hashes = event.block_hashes
        n, size, ids = len(hashes), event.block_size, event.token_ids
        n_tokens = raw_array_len(ids) if ids.__class__ is msgspec.Raw else len(ids)
        # inlined: full blocks are the rule (:func:`token_counts`)
        counts = [size] * n if 0 < n * size <= n_tokens else token_counts(n, size, n_tokens)
        self._store(hashes, counts, event.parent_block_hash, event.session_id, event.continuation_id)

    def _store(self, hashes: list[BlockHash], counts: list[int], parent: BlockHash | None,
               session: str | None, continuation: str | None) -> None:
        bound = self.max_blocks
        if bound is not None and len(hashes) > self._part_blocks:
            # in parts of at most ``_part_blocks``, each under the last block of the one before
            # (the chain's positions run on), shedding after each: one event cannot overshoot
            # the bound by more than a part
            part = self._part_blocks
            for start in range(0, len(hashes), part):
                chunk = hashes[start:start + part]
                self._store(chunk, counts[start:start + part], parent, session, continuation)
                parent = chunk[-1]
            return
        blocks = self.blocks
        add = blocks.setdefault
        above = blocks.get(parent) if parent is not None else None
        prefix = above.prefix_tokens if above is not None else 0
        holes, orphans = self.holes, self._orphans
        # the continuation's new blocks (entered at the end: none, no entry)
        labelled: dict[BlockHash, None] = {}
        start, kept, zeros = prefix, 0, 0  # tokens before, in resident blocks; empty blocks
        solo = () if session is None else (session,)
        # A new block is made counting one child (invariant 4): the next block, new too as a
        # rule; ``ahead`` says the last block was so made, and is set right when the rule
        # fails. (Attribute stores are the slow ones on these structs.)
        ahead = False
        for block_hash, tokens in zip(hashes, counts):
            prefix += tokens
            made = _Block(parent, tokens, prefix, session, continuation, solo)
            block = add(block_hash, made)
            if block is made:
                if not tokens:
                    zeros += 1
                    if session is not None:
                        # its own tuple: :meth:`_remove` sums a tuple's blocks' tokens by run,
                        # and an empty block is counted apart (``_zero_blocks``)
                        block.sessions = (session,)
                if not ahead:  # the first new block, or the first after a resident one
                    if above is not None:
                        above.children += 1
                    elif parent is not None:
                        if parent in holes:
                            holes[parent] += 1
                        else:
                            orphans[parent] = orphans.get(parent, 0) + 1
                    ahead = True
                # filling a hole, or linking chains that started at this hash, may change
                # which blocks are rooted
                if holes and block_hash in holes:
                    block.children = holes.pop(block_hash) + 1
                    self._epoch += 1
                elif orphans and block_hash in orphans:
                    block.children = orphans.pop(block_hash) + 1
                    self._epoch += 1
                labelled[block_hash] = None
            else:
                kept += tokens
                if ahead:
                    blocks[parent].children -= 1  # type: ignore[index]
                    ahead = False
                above = block
                if session is not None and session not in block.sessions:
                    self._touch(block_hash, block, session)
            parent = block_hash
        if ahead:
            blocks[parent].children -= 1  # type: ignore[index]
        if continuation is not None and labelled:
            known = self.continuation_blocks.get(continuation)
            if known is None:
                self.continuation_blocks[continuation] = labelled
            else:
                known.update(labelled)
        gained = prefix - start - kept  # the new blocks' tokens
        if session is not None and (gained or zeros):
            self.session_tokens[session] = self.session_tokens.get(session, 0) + gained
            if zeros:
                self._zero_blocks[session] = self._zero_blocks.get(session, 0) + zeros
        if continuation is not None and self.caps and hashes:
            self._lift_caps(continuation, prefix)
        if bound is not None and len(blocks) > bound:
            self.shed()

    def shed(self) -> None:
        """Drop the oldest stored blocks while the index is over ``max_blocks`` (see "Bound")."""
        if self.max_blocks is None or len(self.blocks) <= self.max_blocks:
            return
        victims = oldest_over_bound(self.blocks, self.max_blocks)
        evicted = self.evicted_tokens
        self.remove(BlockRemoved(block_hashes=victims, medium=None))
        self.evicted_tokens = evicted  # dropped by the bound, not evicted by the engine
        self.overflow_dropped += len(victims)

    def _lift_caps(self, continuation: str, reached: int) -> None:
        caps = self.caps.get(continuation)
        if caps is None or caps[0] > reached:
            return
        del caps[:bisect_right(caps, reached)]
        if not caps:
            del self.caps[continuation]

    def _touch(self, block_hash: BlockHash, block: _Block, session: str) -> None:
        sessions = block.sessions
        if session in sessions:
            return
        if sessions.__class__ is not tuple:
            sessions[session] = None  # type: ignore[index]
        elif len(sessions) < TUPLE_SESSIONS:
            sessions = block.sessions = sessions + (session,)
        else:
            sessions = block.sessions = dict.fromkeys(sessions + (session,))
        tokens = block.tokens
        self.session_tokens[session] = self.session_tokens.get(session, 0) + tokens  # invariant 1
        if not tokens:
            self._zero_blocks[session] = self._zero_blocks.get(session, 0) + 1
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
        self._remove(event.block_hashes, event.continuation_id, event.num_tokens)

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
        self._zero_blocks = {}
        self.shared_blocks = {}
        self.continuation_blocks = {}
        self.shared_tokens = 0
        self.holes = {}
        self._orphans = {}
        self.caps = {}
        self._epoch += 1


def _on_host(event: KVEvent) -> bool:
    return getattr(event, "medium", None) == MEDIUM_CPU


class KVIndex:
    """Every worker's :class:`WorkerKV` (GPU) and :class:`HostKV` (host tier), fed by event
    batches whose events say their medium."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerKV] = {}
        self._hosts: dict[str, HostKV] = {}
        self._capacity_blocks: dict[str, int] = {}  # what each bound derives from

    def worker(self, name: str) -> WorkerKV:
        kv = self._workers.get(name)
        if kv is None:
            kv = self._workers[name] = WorkerKV()
            kv.set_bound(self._bound(name, GPU_BOUND_FACTOR))
        return kv

    def host(self, name: str) -> HostKV:
        host = self._hosts.get(name)
        if host is None:
            host = self._hosts[name] = HostKV()
            host.set_bound(self._bound(name, HOST_BOUND_FACTOR))
        return host

    def set_capacity(self, worker: str, capacity_tokens: int,
                     block_size: int | None = None) -> None:
        """Bound ``worker``'s index by its engine's KV capacity, in blocks of its
        ``block_size`` when known (see "Bound"); blocks over a lowered bound are dropped at
        once. The bound survives resets, until :meth:`drop_worker`."""
        unit = BOUND_BLOCK_TOKENS if block_size is None else block_size
        if capacity_tokens <= 0 or unit <= 0:
            raise ValueError(f"worker {worker!r}: capacity and block size must be > 0, got "
                             f"{capacity_tokens} tokens in blocks of {unit}")
        self._capacity_blocks[worker] = -(-capacity_tokens // unit)  # whole blocks, rounded up
        self.worker(worker).set_bound(self._bound(worker, GPU_BOUND_FACTOR))
        host = self._hosts.get(worker)
        if host is not None:
            host.set_bound(self._bound(worker, HOST_BOUND_FACTOR))

    def _bound(self, worker: str, factor: int) -> int | None:
        blocks = self._capacity_blocks.get(worker)
        return None if blocks is None else factor * blocks

    def workers(self) -> list[str]:
        return list(self._workers)

    @property
    def gpu_workers(self) -> Mapping[str, WorkerKV]:
        """Worker -> its GPU index: a live, read-only view (the ledger's hot reads)."""
        return self._workers

    def apply_batch(self, worker: str, batch: EventBatch) -> int:
        """Apply one batch; returns how many block hashes it carried."""
        return self.apply_events(worker, batch.events)

    def apply_events(self, worker: str, events: Iterable[KVEvent]) -> int:
        """Apply events in order; returns how many block hashes they carried. Consecutive
        GPU removals without attribution (vLLM's one-hash ``BlockRemoved`` per evicted block)
        are applied as one removal of all their hashes, which ends in the same state."""
        kv = self._workers.get(worker) or self.worker(worker)
        if events.__class__ is not list:
            events = list(events)
        hashes = 0
        others = 0  # events not counted as plain GPU stores and removals (host, clears, ...)
        run: list[BlockHash] = []
        for event in events:
            kind = type(event)
            if kind is BlockRemoved and event.continuation_id is None and event.medium != MEDIUM_CPU:
                run += event.block_hashes
                continue
            if run:
                hashes += len(run)
                kv._remove(run)
                run = []
            if (kind is BlockStoredRaw or kind is BlockStored) and event.medium != MEDIUM_CPU:
                hashes += len(event.block_hashes)  # type: ignore[attr-defined]
                kv.store(event)  # type: ignore[arg-type]
                continue
            others += 1
            if kind is not AllBlocksCleared:
                hashes += len(event.block_hashes)  # type: ignore[attr-defined]
            if _on_host(event):
                self._apply_host(worker, kv, event)
            else:
                kv.apply(event)  # counts itself
        if run:
            hashes += len(run)
            kv._remove(run)
        kv.events_seen += len(events) - others  # type: ignore[arg-type]
        return hashes

    def _apply_host(self, worker: str, kv: WorkerKV, event: KVEvent) -> None:
        host = self.host(worker)
        host.events_seen += 1
        if isinstance(event, BlockStored):
            host.store(event, kv.blocks)
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
        """Forget ``worker`` altogether (it left the fleet), its bound with it."""
        self._workers.pop(worker, None)
        self._hosts.pop(worker, None)
        self._capacity_blocks.pop(worker, None)

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
