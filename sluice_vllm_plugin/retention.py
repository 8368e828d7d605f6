"""Retention bias on vLLM's ``BlockPool`` (the semantics of ``sim/block_pool.py``).

A free block sits in the queue of its *eviction class*; allocation takes from the lowest class
first, LRU inside a class:

* free blocks without a hash (class -1) always go first, in vLLM's order (prepended, LIFO);
* class 0: demoted sessions' blocks and retained ones whose TTL ran out;
* class 50: normal cached blocks (with no directives every cached block is here and the pool
  behaves exactly as vLLM's own free queue);
* class ``clamp(priority, 1, 100)``: blocks of a retained session until its TTL.

A bias, never a pin: retained blocks are still free and are evicted when nothing lower is left.

A cached block belongs to the session whose request last freed it (down to ref count 0); its
class is that session's class at the time, and directives re-class the session's free blocks,
keeping their relative LRU order. The session of a free comes from ``KVCacheManager.free``
(wrapped to record ``request.session_id`` on the pool while it runs), or from
:func:`freeing` for callers that drive a ``BlockPool`` directly.

Directives (``retain``/``demote``/``release``) arrive on any thread through a thread-safe inbox
(:meth:`Retention.post`, or :func:`post` for every pool in the process); they are applied on the
scheduler's thread when the pool next allocates (``get_new_blocks``, in the free queue's
``popleft_n``) or when :meth:`Retention.drain` is called between steps, never concurrently with an
allocation. TTLs use ``Retention.clock``
(``time.monotonic`` by default) from when the directive was posted. The ZMQ directive socket
that posts here lives in :mod:`sluice_vllm_plugin.directives`.

The class rules are written twice on purpose, here and in ``sim/block_pool.py``: this module runs
inside vLLM's environment, where ``sim/`` (and its dependencies) cannot be imported.
``tests/fidelity/test_vllm_plugin.py`` drives both through the same operations and directives
and asserts the same evictions, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

import functools
import heapq
import logging
import queue
import time
import weakref
from collections import deque
from itertools import repeat
from typing import Any, Callable

from vllm.v1.core import block_pool as _bp
from vllm.v1.core import kv_cache_manager as _kcm
from vllm.v1.core import kv_cache_utils as _kcu

from .patching import MethodPatches, then

logger = logging.getLogger("sluice.vllm_plugin.retention")

BlockPool = _bp.BlockPool
UNHASHED_CLASS = -1
LOW_CLASS = 0
NORMAL_CLASS = 50
# The pool's Retention, as a plain attribute: never through ``pool.__dict__``, which makes CPython
# drop its fast attribute access on that object and slowed every BlockPool method by ~6%.
_ATTR = "_sluice_retention"
# A hashed class's queue is compacted once its stale entries exceed its live ones by this many;
# ownership logs are swept once they hold this many records (and twice what the last sweep kept).
COMPACT_SLACK = 64
SWEEP_MIN = 1024
_pools: "weakref.WeakSet[Any]" = weakref.WeakSet()


class _Freed:
    """One free under a session: its blocks, of which those whose owner entry is this record
    became the session's own in it (the others it already owned, or lost since)."""

    __slots__ = ("session", "blocks")

    def __init__(self, session: str, blocks: list) -> None:
        self.session = session
        self.blocks = blocks


class _Class:
    """The free blocks of one hashed eviction class, LRU first. ``q`` may hold stale entries
    (see :class:`ClassedFreeQueue`); ``t`` holds each entry's join ticket; ``live`` counts the
    entries that are not stale."""

    __slots__ = ("cls", "q", "t", "live")

    def __init__(self, cls: int) -> None:
        self.cls = cls
        self.q: deque = deque()
        self.t: deque = deque()
        self.live = 0

    def join(self, blocks: list, where: list, tickets: list, ticket: int) -> None:
        """The blocks join the class's tail together, under one ticket."""
        for block in blocks:
            block_id = block.block_id
            where[block_id] = self
            tickets[block_id] = ticket
        self.q.extend(blocks)
        self.t.extend(repeat(ticket, len(blocks)))
        self.live += len(blocks)

    def compact_if_stale(self, where: list, tickets: list) -> None:
        """Drop the stale entries once they outnumber the live ones (by COMPACT_SLACK)."""
        if len(self.q) > 2 * self.live + COMPACT_SLACK:
            live = self.entries(where, tickets)
            self.q = deque(block for block, _ in live)
            self.t = deque(ticket for _, ticket in live)

    def entries(self, where: list, tickets: list) -> list:
        """The live entries, LRU first: an entry is live while its block's latest join is it."""
        return [(block, ticket) for block, ticket in zip(self.q, self.t)
                if where[block.block_id] is self and tickets[block.block_id] == ticket]

    def blocks(self, where: list, tickets: list) -> list:
        return [block for block, _ in self.entries(where, tickets)]


# vLLM's own free queue methods, called on a ClassedFreeQueue (a subclass) for the blocks that
# live in its linked list; bound here once so the hot paths skip a super() lookup.
_FreeQueue = _kcu.FreeKVCacheBlockQueue
_vllm_popleft_n = _FreeQueue.popleft_n
_vllm_remove = _FreeQueue.remove
_vllm_append_n = _FreeQueue.append_n
_vllm_prepend_n = _FreeQueue.prepend_n
_vllm_all_free = _FreeQueue.get_all_free_blocks


class ClassedFreeQueue(_FreeQueue):
    """Drop-in for vLLM's ``FreeKVCacheBlockQueue`` with eviction classes.

    Every allocation and free of the engine goes through here, so the common case must cost
    close to nothing over vLLM's own queue. It *is* vLLM's queue (a subclass): vLLM's linked list
    holds the free blocks without a hash (at its head, as vLLM prepends them) and class 50
    (normal, the rest of the list, LRU), which with no directives is every free block; vLLM's
    methods run on it unchanged. Only the other classes live on the side:

    * A side class is a :class:`_Class` around a ``deque`` whose entries may be *stale*: a block
      taken out of the middle (a prefix hit's ``touch``, a directive's re-class) stays in place
      and is skipped when it reaches the head. Blocks join a side class under a *ticket* (one
      per join, increasing); ``_where[block_id]`` / ``_tickets[block_id]`` are the side class
      and ticket of a block's live entry, and ``_where`` is cleared when the block leaves it, so
      an entry is live exactly when both match. Taking a block out is one store, with no
      per-block count of stale copies. A class is compacted when its stale entries outnumber
      the live ones.
    * A free block is in the linked list exactly when its ``prev_free_block`` is set (vLLM clears
      it on every block it unlinks; side blocks never get one).
    * ``_front`` holds the ids of the list's class -1 blocks: the pool's initial free blocks and
      those vLLM frees without a hash (``prepend_n``). Blocks join the list only at its head
      (``prepend_n``) or its tail (``append_n``), so these are always its first ``len(_front)``
      blocks. Hand-out order is: those, side classes below 50, the rest of the list, side
      classes above 50.
    * Ownership (architecture.md §5.4, ``sim/block_pool.py``): a cached block belongs to the session
      whose free last brought it to ref count 0, is forgotten when the block is handed out
      again, and a directive re-classes a session's free blocks in the order they became its
      own. Rather than a per-session index updated per block, each free under a session appends
      one :class:`_Freed` record to that session's log, and ``_owner[block_id]`` points at the
      record the block became the session's own in; a log entry whose owner entry points
      elsewhere is dead. Only directives read the logs (and prune them); the logs are swept of
      dead records as they grow.

    ``num_free_blocks`` counts every free block; vLLM's methods keep it for the list's share and
    the side classes for theirs (``_side_live``).
    """

    def __init__(self, retention: "Retention", blocks: list, num_blocks: int) -> None:
        # vLLM's list of the pool's free blocks, all treated as unhashed: first out, in order
        super().__init__(blocks)
        self._r = retention
        self._inbox_empty = retention.inbox.empty
        self._expiries = retention._expiries          # the same list, only ever mutated
        self._session_class = retention._session_class  # the same dict, only ever mutated
        self._front: set[int] = {b.block_id for b in blocks}
        self._classes: dict[int, _Class] = {}
        self._normal = _Class(NORMAL_CLASS)           # stands for the list in ``_order``
        self._order: list[_Class] = [self._normal]    # evicted-first first
        self._side_live = 0                           # free blocks in side classes
        self._where: list[_Class | None] = [None] * num_blocks
        self._tickets: list[int] = [0] * num_blocks
        self._next_ticket = 1
        self._owner: list[_Freed | None] = [None] * num_blocks
        self._logs: dict[str, list[_Freed]] = {}
        self._records = 0              # records in all logs
        self._sweep_at = SWEEP_MIN     # sweep the logs when they hold this many

    def _class(self, cls: int) -> _Class:
        """The side class ``cls`` (not NORMAL_CLASS, which is the list)."""
        c = self._classes.get(cls)
        if c is None:
            c = self._classes[cls] = _Class(cls)
            self._order.append(c)
            self._order.sort(key=lambda k: k.cls)
        return c

    # -- FreeKVCacheBlockQueue interface --

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list:
        # directives apply here, on the scheduler's thread, as the pool allocates
        if not self._inbox_empty():
            self._r.drain()
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, {self.num_free_blocks} free")
        if n <= 0:
            return []
        if self._side_live or self._expiries:
            return self._popleft_classed(n)
        # no side class in play: vLLM's own order
        taken = _vllm_popleft_n(self, n)
        front = self._front
        if front:
            for block in taken[:len(front)]:
                front.discard(block.block_id)
        if self._logs:
            owner = self._owner
            for block in taken:
                owner[block.block_id] = None
        return taken

    def _popleft_classed(self, n: int) -> list:
        # expiry is lazy, as in sim/block_pool.py: only when blocks are really handed out
        if self._expiries:
            self._r.expire(self._r.clock())
        front = self._front
        taken: list = []
        if front:
            k = min(n, len(front))
            for block in _vllm_popleft_n(self, k):
                front.discard(block.block_id)
                taken.append(block)
            n -= k
        for c in self._order:
            if not n:
                break
            if c is self._normal:
                k = min(n, self.num_free_blocks - self._side_live)
                if k:
                    taken += _vllm_popleft_n(self, k)
                    n -= k
                continue
            k = c.live
            if not k:
                continue
            if k > n:
                k = n
            c.live -= k
            self._side_live -= k
            self.num_free_blocks -= k
            n -= k
            popleft = c.q.popleft
            popticket = c.t.popleft
            where = self._where
            tickets = self._tickets
            while k:
                block = popleft()
                ticket = popticket()
                block_id = block.block_id
                if where[block_id] is not c or tickets[block_id] != ticket:
                    continue        # a stale entry
                where[block_id] = None
                taken.append(block)
                k -= 1
        owner = self._owner
        for block in taken:
            owner[block.block_id] = None
        return taken

    def remove(self, block: Any) -> None:
        if block.prev_free_block is not None:       # in vLLM's list
            if self._front:
                self._front.discard(block.block_id)
            _vllm_remove(self, block)
            return
        if block.ref_cnt != 0:
            raise RuntimeError(f"remove() called on a block that is not free: {block.block_id}")
        self._take_out(block.block_id)

    def _take_out(self, block_id: int) -> None:
        """The block leaves its side class: its entry stays there, stale."""
        c = self._where[block_id]
        self._where[block_id] = None
        c.live -= 1
        self._side_live -= 1
        self.num_free_blocks -= 1
        c.compact_if_stale(self._where, self._tickets)

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: list) -> None:
        if not blocks:
            return
        session = self._r.free_session
        if session is None:
            _vllm_append_n(self, blocks)
            return
        entry = self._session_class.get(session) if self._session_class else None
        if entry is None or entry[0] == NORMAL_CLASS:
            _vllm_append_n(self, blocks)
        else:
            self._class(entry[0]).join(blocks, self._where, self._tickets, self._next_ticket)
            self._next_ticket += 1
            self._side_live += len(blocks)
            self.num_free_blocks += len(blocks)
        owner = self._owner
        # logged even if it ends up owning nothing (a sweep drops it): cheaper than checking
        record = _Freed(session, list(blocks))
        for block in blocks:
            block_id = block.block_id
            previous = owner[block_id]
            if previous is None or previous.session != session:
                owner[block_id] = record
        log = self._logs.get(session)
        if log is None:
            self._logs[session] = [record]
        else:
            log.append(record)
        self._records += 1
        if self._records >= self._sweep_at:
            self._sweep()

    def prepend_n(self, blocks: list) -> None:
        if not blocks:
            return
        front = self._front
        for block in blocks:
            front.add(block.block_id)
        _vllm_prepend_n(self, blocks)

    def get_all_free_blocks(self) -> list:
        listed = _vllm_all_free(self)
        out = listed[:len(self._front)]
        for c in self._order:
            out.extend(listed[len(self._front):] if c is self._normal
                       else c.blocks(self._where, self._tickets))
        return out

    def iter_blocks_after(self, block: Any | None):
        """Free blocks in hand-out order after ``block`` (from the head when None or when
        ``block`` is no longer free), as vLLM's queue offers to the simple KV offloader."""
        blocks = self.get_all_free_blocks()
        start = 0
        if block is not None and block.ref_cnt == 0:
            for i, b in enumerate(blocks):
                if b.block_id == block.block_id:
                    start = i + 1
                    break
        return iter(blocks[start:])

    # -- ownership and re-classing --

    def _prune(self, log: list[_Freed]) -> list[_Freed]:
        """The log's records that still own a block, each cut down to the blocks it owns."""
        owner = self._owner
        kept = []
        for record in log:
            mine = [b for b in record.blocks if owner[b.block_id] is record]
            if mine:
                record.blocks = mine
                kept.append(record)
        return kept

    def _sweep(self) -> None:
        records = 0
        for session in list(self._logs):
            kept = self._prune(self._logs[session])
            if kept:
                self._logs[session] = kept
                records += len(kept)
            else:
                del self._logs[session]
        self._records = records
        self._sweep_at = max(SWEEP_MIN, 2 * records)

    def owned(self, session: str) -> list:
        """The session's blocks, in the order they became its own."""
        log = self._logs.get(session)
        if not log:
            return []
        kept = self._prune(log)
        self._records -= len(log) - len(kept)
        if kept:
            self._logs[session] = kept
        else:
            del self._logs[session]
        return [b for record in kept for b in record.blocks]

    def reclass_session(self, session: str, cls: int) -> None:
        """Move the session's free cached blocks to ``cls``, in the order they became its own.

        Runs twice per retained request (the retain, then its expiry) over every block the
        session owns, so the per-block steps of ``_take_out`` / ``_Class.take_out`` are inlined
        here and the counters and compaction settled once per class at the end."""
        where = self._where
        front = self._front
        target = None if cls == NORMAL_CLASS else self._class(cls)
        moved = []              # in ownership order, to the target's tail together
        left: set = set()       # side classes blocks were taken out of
        for block in self.owned(session):
            if block.ref_cnt != 0 or block._block_hash is None:
                continue
            block_id = block.block_id
            if block.prev_free_block is not None:     # in the list: unhashed or normal
                if target is None and block_id not in front:
                    continue
                front.discard(block_id)
                _vllm_remove(self, block)
            else:
                source = where[block_id]
                if source is target:
                    continue
                # leaves its side class; the entry stays there, stale
                where[block_id] = None
                source.live -= 1
                self._side_live -= 1
                self.num_free_blocks -= 1
                left.add(source)
            moved.append(block)
        for source in left:
            source.compact_if_stale(where, self._tickets)
        if not moved:
            return
        if target is None:
            _vllm_append_n(self, moved)
            return
        target.join(moved, where, self._tickets, self._next_ticket)
        self._next_ticket += 1
        self._side_live += len(moved)
        self.num_free_blocks += len(moved)


class Retention:
    """Per-pool retention state and directive inbox."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.inbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.free_session: str | None = None
        self.queue: ClassedFreeQueue | None = None
        self.dropped = 0
        self._session_class: dict[str, tuple[int, float]] = {}
        self._expiries: list[tuple[float, str]] = []

    # any thread
    def post(self, action: str, session_id: str, priority: int = NORMAL_CLASS,
             ttl_s: float = 0.0, at: float | None = None) -> None:
        """Queue a directive; a retain's TTL runs from ``at`` (default: now, on ``clock``)."""
        self.inbox.put((action, session_id, priority, ttl_s, self.clock() if at is None else at))

    # scheduler thread
    def drain(self) -> int:
        n = 0
        while True:
            try:
                action, session_id, priority, ttl_s, at = self.inbox.get_nowait()
            except queue.Empty:
                break
            try:
                if not isinstance(session_id, str) or not session_id:
                    raise ValueError("session_id must be a non-empty string")
                if action == "retain":
                    self.retain(session_id, int(priority), float(ttl_s), at)
                elif action == "demote":
                    self.demote(session_id)
                elif action == "release":
                    self.release(session_id)
                elif action == "offload":
                    self.offload(session_id)
                elif action == "prefetch":
                    self.prefetch(session_id, int(priority), float(ttl_s), at)
                else:
                    raise ValueError(f"unknown action {action!r}")
                n += 1
            except Exception as exc:  # never crash the engine on directive input
                self.dropped += 1
                logger.warning("sluice retention: dropped directive %r: %s", action, exc)
        return n

    def class_of(self, session_id: str) -> int:
        entry = self._session_class.get(session_id)
        return NORMAL_CLASS if entry is None else entry[0]

    def retain(self, session_id: str, priority: int, ttl_s: float, now: float) -> None:
        cls = max(LOW_CLASS + 1, min(100, int(priority)))
        expires = now + ttl_s
        self._session_class[session_id] = (cls, expires)
        heapq.heappush(self._expiries, (expires, session_id))
        self._reclass(session_id, cls)

    def demote(self, session_id: str) -> None:
        self._session_class[session_id] = (LOW_CLASS, float("inf"))
        self._reclass(session_id, LOW_CLASS)

    def release(self, session_id: str) -> None:
        self._session_class.pop(session_id, None)
        self._reclass(session_id, NORMAL_CLASS)
        for host in _host_tiers():
            host.release(session_id)

    def _session_offload_keys(self, session_id: str) -> list:
        from .host_tier import offload_keys
        return offload_keys(self.queue.owned(session_id)) if self.queue is not None else []

    def offload(self, session_id: str) -> None:
        """``kv.offload`` (:mod:`sluice_vllm_plugin.host_tier`): park in the host tier, then
        demote on the GPU."""
        hosts = _host_tiers()
        if hosts:
            keys = self._session_offload_keys(session_id)
            for host in hosts:
                host.offload(session_id, keys)
        self.demote(session_id)

    def prefetch(self, session_id: str, priority: int, deadline_s: float, now: float) -> None:
        """``kv.prefetch``: favour the session in the host tier; undo a demotion on the GPU."""
        hosts = _host_tiers()
        if hosts:
            keys = self._session_offload_keys(session_id)
            for host in hosts:
                host.prefetch(session_id, priority, deadline_s, now, keys)
        if self.class_of(session_id) == LOW_CLASS:
            self._session_class.pop(session_id, None)
            self._reclass(session_id, NORMAL_CLASS)

    def expire(self, now: float) -> None:
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expires, session_id = heapq.heappop(heap)
            entry = self._session_class.get(session_id)
            if entry is not None and entry[1] == expires:
                self._session_class[session_id] = (LOW_CLASS, float("inf"))
                self._reclass(session_id, LOW_CLASS)

    def _reclass(self, session_id: str, cls: int) -> None:
        if self.queue is not None:
            self.queue.reclass_session(session_id, cls)


def _host_tiers() -> list:
    """The host tiers in this process (none unless vLLM's offloading connector is on)."""
    from . import host_tier
    return host_tier.tiers()


def drain_all() -> None:
    """Apply every pool's pending directives (scheduler thread)."""
    for pool in list(_pools):
        r = state(pool)
        if not r.inbox.empty():
            r.drain()


def state(pool: Any) -> Retention:
    """The pool's retention state (installed by the patched ``BlockPool.__init__``)."""
    return getattr(pool, _ATTR)


def install(pool: Any) -> Retention:
    """Give an existing pool a classed free queue (keeps its current free order)."""
    existing = getattr(pool, _ATTR, None)
    if existing is not None:
        return existing
    r = Retention()
    q = ClassedFreeQueue(r, pool.free_block_queue.get_all_free_blocks(), len(pool.blocks))
    r.queue = q
    pool.free_block_queue = q
    setattr(pool, _ATTR, r)
    _pools.add(pool)
    return r


def post(action: str, session_id: str, priority: int = NORMAL_CLASS, ttl_s: float = 0.0) -> None:
    """Post a directive to every patched pool in this process (thread-safe)."""
    for pool in list(_pools):
        state(pool).post(action, session_id, priority, ttl_s)
    if not _pools:
        logger.debug("sluice retention: no block pool yet; directive %s for %s ignored",
                     action, session_id)


class freeing:
    """Context: blocks freed inside it belong to ``session_id`` (nothing happens on a pool
    without the plugin). A class rather than ``contextlib.contextmanager``: it runs once per
    freed request, and a generator-based context costs several times more."""

    __slots__ = ("_r", "_session", "_previous")

    def __init__(self, pool: Any, session_id: str | None) -> None:
        self._r = getattr(pool, _ATTR, None)
        self._session = session_id

    def __enter__(self) -> None:
        r = self._r
        if r is not None:
            self._previous, r.free_session = r.free_session, self._session

    def __exit__(self, *exc: Any) -> None:
        r = self._r
        if r is not None:
            r.free_session = self._previous


# -- patches -------------------------------------------------------------------------------------

def _wrap_manager_free(orig):
    @functools.wraps(orig)
    def free(self, request):
        with freeing(self.block_pool, getattr(request, "session_id", None)):
            return orig(self, request)
    return free


_PATCHES = MethodPatches([
    (BlockPool, "__init__", then(install)),
    (_kcm.KVCacheManager, "free", _wrap_manager_free),
])

apply = _PATCHES.apply
remove = _PATCHES.remove
