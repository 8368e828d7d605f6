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
keeping their relative LRU order (lazily, in O(1) for blocks already off the normal class: see
:class:`ClassedFreeQueue`). The session of a free comes from ``KVCacheManager.free``
(wrapped to record ``request.session_id`` on the pool while it runs), or from
:func:`freeing` for callers that drive a ``BlockPool`` directly.

Directives (the envelope's actions, as decoded: :mod:`sluice_vllm_plugin.directive_envelope`)
arrive on any thread through a thread-safe inbox (:meth:`Retention.post`, or :func:`post` for
every pool in the process); they are applied on the scheduler's thread when the pool next
allocates (``get_new_blocks``, in the free queue's ``popleft_n``) or when
:meth:`Retention.drain` is called between steps, never concurrently with an allocation, each by
the method named after its verb (``retain``, ``demote``, ``release``, ``offload``,
``prefetch``). TTLs and prefetch deadlines use ``Retention.clock`` (``time.monotonic`` by
default) from when the directive was posted. What a directive may do is bounded as it is
applied (:mod:`sluice_vllm_plugin.directive_limits`: TTLs and priorities clamped, session and
retained-block budgets, state forgotten when a drain finds it lapsed, the inbox's length).
The ZMQ directive socket that posts here lives in :mod:`sluice_vllm_plugin.directives`;
``offload`` and ``prefetch`` reach the host tiers that :mod:`sluice_vllm_plugin.host_tier`
attaches (:func:`attach_host_tier`).

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
from typing import Any, Callable

from vllm.v1.core import block_pool as _bp
from vllm.v1.core import kv_cache_manager as _kcm
from vllm.v1.core import kv_cache_utils as _kcu

from .directive_envelope import (KvAction, OffloadPayload, PrefetchPayload, RetainPayload,
                                 SessionPayload, verb_of)
from .directive_limits import (HEAP_SLACK, REFUSED_QUEUED, DirectiveGovernor, DirectiveLimits,
                               ThrottledLog, environment_limits)
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


class _Session:
    """A session as the free queue sees it: the class its free blocks are filed in (``cls``,
    NORMAL_CLASS being vLLM's list) and its ownership log.

    ``latest`` is its latest move between classes (a :class:`_Unit`): every side unit of the
    session older than it was moved with it, so those units are dead and their blocks live on in
    ``latest``. ``units`` are its side units since then (the move first), in the order they
    joined; their blocks are its free blocks in side classes (all in ``cls``). ``stray`` is
    set when a free without a session put one of its blocks in vLLM's list while its class is
    another (the next directive for the session moves such blocks)."""

    __slots__ = ("name", "cls", "latest", "units", "log", "stray")

    def __init__(self, name: str) -> None:
        self.name = name
        self.cls = NORMAL_CLASS
        self.latest: _Unit | None = None
        self.units: list[_Unit] = []
        self.log: list[_Freed] = []
        self.stray = False


class _Freed:
    """One free under a session: its blocks, of which those whose owner entry is this record
    became the session's own in it (the others it already owned, or lost since)."""

    __slots__ = ("session", "blocks")

    def __init__(self, session: _Session, blocks: list) -> None:
        self.session = session
        self.blocks = blocks


class _Unit:
    """Blocks of one session that joined a side class's tail together, under one ticket.

    Either the blocks one free filed there (or a directive moved there from vLLM's list), or a
    directive's move of the session's blocks from another side class, resolved lazily: a move's
    ``blocks`` are None until needed, and are then the blocks of its ``sources`` (the session's
    units it superseded, in the order they joined) that are in it, which is the order they
    became the session's own unless a source is ``mixed`` (it holds blocks the session owned
    before it, re-freed): then the move is resolved from the session's ownership log (the
    move is ``mixed`` until then). A block's unit is ``_pos[block_id]``, the unit it last
    joined (None when it is not free in a side class); it is *in* that unit until a move of its
    session supersedes the unit, and from then in the move. ``live`` counts the blocks in the
    unit; ``index`` is how far pops have consumed ``blocks``."""

    __slots__ = ("session", "side", "ticket", "blocks", "live", "index", "bound", "sources",
                 "mixed")

    def __init__(self, session: _Session, side: "_Class | None", ticket: int,
                 blocks: list | None, live: int, mixed: bool = False) -> None:
        self.session = session
        self.side = side
        self.ticket = ticket
        self.blocks = blocks
        self.live = live
        self.index = 0
        # an entry of ``blocks`` is valid while its block's latest join has a ticket no later
        # than this: the block joined no unit since the entry was made
        self.bound = ticket
        self.sources: list[_Unit] = []
        self.mixed = mixed

    def dead(self) -> bool:
        latest = self.session.latest
        return not self.live or (latest is not None and latest.ticket > self.ticket)


class _Class:
    """The free blocks of one hashed eviction class: its units, LRU first. ``q`` may hold dead
    units (emptied, or superseded by a move), skipped at the head and dropped by compaction;
    ``live`` counts the free blocks in the class."""

    __slots__ = ("cls", "q", "live")

    def __init__(self, cls: int) -> None:
        self.cls = cls
        self.q: deque = deque()
        self.live = 0

    def compact_if_stale(self) -> None:
        """Drop the dead units once they outnumber the live blocks (by COMPACT_SLACK)."""
        if len(self.q) > 2 * self.live + COMPACT_SLACK:
            self.q = deque(unit for unit in self.q if not unit.dead())


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

    * A side class is a :class:`_Class`, a queue of :class:`_Unit`: the blocks one free filed
      there, or one directive's move of a session's blocks there. A directive costs O(1) for the
      blocks already in side classes: it appends one move unit and supersedes the session's
      older units; which blocks the move holds, in which order, is worked out when it reaches
      the head of its class (``_expand``). Only blocks in vLLM's list are moved block by block
      (they must leave the list): a session's first move off the normal class, a move back to
      it, and blocks a free without a session put there.
    * A free block is in the linked list exactly when its ``prev_free_block`` is set (vLLM clears
      it on every block it unlinks; side blocks never get one).
    * ``_front`` counts the list's class -1 blocks: the pool's initial free blocks and those vLLM
      frees without a hash (``prepend_n``). Blocks join the list only at its head (``prepend_n``)
      or its tail (``append_n``), so these are always its first ``_front`` blocks. Hand-out
      order is: those, side classes below 50, the rest of the list, side classes above 50.
    * Ownership (architecture.md §5.4, ``sim/block_pool.py``): a cached block belongs to the session
      whose free last brought it to ref count 0, is forgotten when the block is handed out
      again, and a directive re-classes a session's free blocks in the order they became its
      own. Rather than a per-session index updated per block, each free under a session appends
      one :class:`_Freed` record to that session's log, and ``_owner[block_id]`` points at the
      record the block became the session's own in; a log entry whose owner entry points
      elsewhere is dead. Only directives and moves read the logs (and prune them); the logs are
      swept of dead records as they grow.

    ``num_free_blocks`` counts every free block; vLLM's methods keep it for the list's share and
    the side classes for theirs (``_side_live``).
    """

    def __init__(self, retention: "Retention", blocks: list, num_blocks: int) -> None:
        # vLLM's list of the pool's free blocks, all treated as unhashed: first out, in order
        super().__init__(blocks)
        self._r = retention
        self._inbox_empty = retention.inbox.empty
        self._expiries = retention._expiries          # the same list, only ever mutated
        self._front = len(blocks)
        self._classes: dict[int, _Class] = {}
        self._normal = _Class(NORMAL_CLASS)           # stands for the list in ``_order``
        self._order: list[_Class] = [self._normal]    # evicted-first first
        self._side_live = 0                           # free blocks in side classes
        self._pos: list[_Unit | None] = [None] * num_blocks
        self._next_ticket = 1
        self._owner: list[_Freed | None] = [None] * num_blocks
        self._sessions: dict[str, _Session] = {}
        self._off_normal = 0           # sessions whose class is not the normal one
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

    def _session(self, name: str) -> _Session:
        s = self._sessions.get(name)
        if s is None:
            s = self._sessions[name] = _Session(name)
        return s

    def _ticket(self) -> int:
        ticket = self._next_ticket
        self._next_ticket = ticket + 1
        return ticket

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
        owner = self._owner
        expiries = self._expiries
        if not self._side_live and not expiries:
            # no side class in play: vLLM's own order
            front = self._front
            if front:
                self._front = front - n if front > n else 0
            # vLLM's popleft_n (kv_cache_utils.FreeKVCacheBlockQueue), inline and with each
            # block's owner forgotten in the same loop: every allocation's path
            self.num_free_blocks -= n
            head = self.fake_free_list_head
            block = head.next_free_block
            if n == 1:
                following = block.next_free_block
                block.prev_free_block = None
                block.next_free_block = None
                if following is not None:
                    head.next_free_block = following
                    following.prev_free_block = head
                owner[block.block_id] = None
                return [block]
            taken = []
            for _ in range(n):
                taken.append(block)
                popped = block
                block = block.next_free_block
                popped.prev_free_block = None
                popped.next_free_block = None
                owner[popped.block_id] = None
            if block is not None:
                head.next_free_block = block
                block.prev_free_block = head
            return taken
        # Classed: the front, side classes below normal, the rest of the list, side classes
        # above. Inline (no helper frames): while a class below normal holds blocks, this is
        # every allocation's path.
        if expiries:
            # expiry is lazy, as in sim/block_pool.py: only when blocks are really handed out
            r = self._r
            now = r.clock()
            if expiries[0][0] <= now:
                r.expire(now)
        if n == 1 and not self._front:
            # one block from vLLM's list (every decode step allocates one) when no side class
            # comes before it; a side class first: the general loop below
            for c in self._order:
                if c is self._normal:
                    if self.num_free_blocks > self._side_live:
                        # vLLM's popleft, inline, the owner forgotten
                        head = self.fake_free_list_head
                        block = head.next_free_block
                        following = block.next_free_block
                        block.prev_free_block = None
                        block.next_free_block = None
                        head.next_free_block = following
                        following.prev_free_block = head
                        owner[block.block_id] = None
                        self.num_free_blocks -= 1
                        return [block]
                    continue
                if c.live:
                    break
        taken = []
        front = self._front
        if front:
            k = min(n, front)
            taken += self._popleft_listed(k)
            self._front = front - k
            n -= k
        for c in self._order:
            if not n:
                break
            if c is self._normal:
                k = min(n, self.num_free_blocks - self._side_live)
                if k:
                    taken += self._popleft_listed(k)
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
            # k blocks from the head of side class c (it holds at least that many)
            q = c.q
            pos = self._pos
            while k:
                unit = q[0]
                latest = unit.session.latest
                if not unit.live or (latest is not None and latest.ticket > unit.ticket):
                    q.popleft()         # dead: emptied, or superseded by a move
                    continue
                blocks = unit.blocks
                if blocks is None:
                    blocks = self._expand(unit)
                bound = unit.bound
                i = unit.index
                end = len(blocks)
                got = 0
                while got < k and i < end:
                    block = blocks[i]
                    i += 1
                    block_id = block.block_id
                    joined = pos[block_id]
                    if joined is not None and joined.ticket <= bound:
                        pos[block_id] = None
                        owner[block_id] = None          # handed out: forgotten
                        taken.append(block)
                        got += 1
                unit.index = i
                unit.live -= got
                k -= got
                if not unit.live or i == end:
                    q.popleft()
        return taken

    def _popleft_listed(self, k: int) -> list:
        """``k`` blocks from the head of vLLM's list, their owners forgotten."""
        taken = _vllm_popleft_n(self, k)
        owner = self._owner
        for block in taken:
            owner[block.block_id] = None
        return taken

    def _expand(self, move: _Unit) -> list:
        """A move's blocks, worked out once (when it reaches the head of its class, or is
        listed). Entries of blocks that left it stay, and are skipped."""
        sources = move.sources
        if move.mixed:
            # ownership order is not join order: from the session's log
            blocks = self._by_log(move.session, move.ticket)
        elif len(sources) == 1:
            # one source (the usual case): its entries as they are, valid as they were there
            blocks = sources[0].blocks
            move.index = sources[0].index
            move.bound = sources[0].bound
        else:
            pos = self._pos
            blocks = []
            for unit in sources:
                bound = unit.bound
                blocks += [block for block in unit.blocks[unit.index:]
                           if (joined := pos[block.block_id]) is not None
                           and joined.ticket <= bound]
        move.blocks = blocks
        move.sources = []
        move.mixed = False
        return blocks

    def _by_log(self, s: _Session, ticket: int) -> list:
        """The session's free blocks in side classes whose latest join is no later than
        ``ticket``, in the order they became its own; prunes its log on the way."""
        pos = self._pos
        owner = self._owner
        kept = []
        blocks = []
        for record in s.log:
            mine = [block for block in record.blocks if owner[block.block_id] is record]
            if mine:
                record.blocks = mine
                kept.append(record)
                blocks += [block for block in mine
                           if (joined := pos[block.block_id]) is not None
                           and joined.ticket <= ticket and block._block_hash is not None]
        self._records -= len(s.log) - len(kept)
        s.log = kept
        return blocks

    def remove(self, block: Any) -> None:
        # every prefix hit on a free block comes here: vLLM's unlink, _unit_of and the
        # compaction check are inline
        previous = block.prev_free_block
        if previous is not None:       # in vLLM's list
            if self._front and block._block_hash is None:
                self._leave_front(block)
            following = block.next_free_block
            if following is None:
                _vllm_remove(self, block)          # vLLM's error for a broken link
                return
            # vLLM's remove (kv_cache_utils.FreeKVCacheBlockQueue)
            previous.next_free_block = following
            following.prev_free_block = previous
            block.prev_free_block = block.next_free_block = None
            self.num_free_blocks -= 1
            return
        if block.ref_cnt != 0:
            raise RuntimeError(f"remove() called on a block that is not free: {block.block_id}")
        pos = self._pos
        block_id = block.block_id
        unit = pos[block_id]
        latest = unit.session.latest
        if latest is not None and latest.ticket > unit.ticket:
            unit = latest                          # superseded by a move: the block is in it
        pos[block_id] = None
        unit.live -= 1
        c = unit.side
        c.live -= 1
        self._side_live -= 1
        self.num_free_blocks -= 1
        if len(c.q) > 2 * c.live + COMPACT_SLACK:
            c.compact_if_stale()

    def _leave_front(self, block: Any) -> None:
        """``block`` (without a hash, in the list) leaves it: if it is one of the front blocks,
        the front has one fewer. Blocks leave from the middle only on a prefix hit, which needs
        a hash, so this walk does not happen in practice."""
        walk = self.fake_free_list_head.next_free_block
        for _ in range(self._front):
            if walk is block:
                self._front -= 1
                return
            walk = walk.next_free_block

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: list) -> None:
        if not blocks:
            return
        name = self._r.free_session
        owner = self._owner
        if name is None:
            if self._off_normal:
                # a session's block lands in the list while its class is another one: the
                # session's next directive moves it
                for block in blocks:
                    record = owner[block.block_id]
                    if record is not None and record.session.cls != NORMAL_CLASS:
                        record.session.stray = True
            _vllm_append_n(self, blocks)
            return
        s = self._sessions.get(name)
        if s is None:
            s = self._sessions[name] = _Session(name)
        # kept, not copied: vLLM's callers (free_blocks, unpin_blocks) pass a list of their own
        # that they drop afterwards
        # logged even if it ends up owning nothing (a sweep drops it): cheaper than checking
        record = _Freed(s, blocks)
        s.log.append(record)
        if s.cls == NORMAL_CLASS:
            # vLLM's append_n (kv_cache_utils.FreeKVCacheBlockQueue) and the ownership in one
            # loop: this is every request's free
            tail = self.fake_free_list_tail
            last = tail.prev_free_block
            for block in blocks:
                block_id = block.block_id
                previous = owner[block_id]
                if previous is None or previous.session is not s:
                    owner[block_id] = record
                block.prev_free_block = last
                last.next_free_block = block
                last = block
            last.next_free_block = tail
            tail.prev_free_block = last
            self.num_free_blocks += len(blocks)
        else:
            mixed = False
            for block in blocks:
                block_id = block.block_id
                previous = owner[block_id]
                if previous is None or previous.session is not s:
                    owner[block_id] = record
                else:
                    mixed = True    # the session's already: its place in ownership order stays
            self._file(s, blocks, mixed)
        self._records += 1
        if self._records >= self._sweep_at:
            self._sweep()

    def _file(self, s: _Session, blocks: list, mixed: bool) -> None:
        """The blocks (free, not in the list) join the tail of the session's side class
        together, as one unit; ``mixed``: not in the order they became the session's own,
        relative to its other units."""
        c = self._class(s.cls)
        unit = _Unit(s, c, self._ticket(), blocks, len(blocks), mixed)
        pos = self._pos
        for block in blocks:
            pos[block.block_id] = unit
        c.q.append(unit)
        s.units.append(unit)
        c.live += len(blocks)
        self._side_live += len(blocks)
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list) -> None:
        if not blocks:
            return
        self._front += len(blocks)
        _vllm_prepend_n(self, blocks)

    def get_all_free_blocks(self) -> list:
        listed = _vllm_all_free(self)
        out = listed[:self._front]
        for c in self._order:
            if c is self._normal:
                out.extend(listed[self._front:])
                continue
            out.extend(self._members(c))
        return out

    def _members(self, c: _Class) -> list:
        """The free blocks of side class ``c``, in hand-out order."""
        pos = self._pos
        out = []
        for unit in c.q:
            if unit.dead():
                continue
            blocks = unit.blocks if unit.blocks is not None else self._expand(unit)
            bound = unit.bound
            for block in blocks[unit.index:]:
                joined = pos[block.block_id]
                if joined is not None and joined.ticket <= bound:
                    out.append(block)
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
        for name, s in list(self._sessions.items()):
            s.log = self._prune(s.log)
            records += len(s.log)
            if not s.log and s.cls == NORMAL_CLASS:
                del self._sessions[name]
        self._records = records
        self._sweep_at = max(SWEEP_MIN, 2 * records)

    def _owned(self, s: _Session) -> list:
        """The session's blocks, in the order they became its own (prunes its log)."""
        if not s.log:
            return []
        kept = self._prune(s.log)
        self._records -= len(s.log) - len(kept)
        s.log = kept
        return [b for record in kept for b in record.blocks]

    def owned(self, session: str) -> list:
        """The session's blocks, in the order they became its own."""
        s = self._sessions.get(session)
        return [] if s is None else self._owned(s)

    def reclass_session(self, session: str, cls: int) -> None:
        """Move the session's free cached blocks to ``cls`` (to its tail, in the order they
        became the session's own; blocks already in ``cls`` stay where they are).

        Blocks in side classes move lazily: one move unit, resolved when it reaches the head of
        its class. Blocks in vLLM's list (the session's, when it leaves the normal class, or
        strays) are unlinked here, and a move back to the normal class appends the session's
        blocks to the list here: the list's order is vLLM's, with no units."""
        s = self._session(session)
        old = s.cls
        s.cls = cls
        if (old == NORMAL_CLASS) != (cls == NORMAL_CLASS):
            self._off_normal += 1 if old == NORMAL_CLASS else -1
        if cls == NORMAL_CLASS:
            s.stray = False
            if old != NORMAL_CLASS:
                self._back_to_list(s, self._classes[old])
            return
        listed = []
        if old == NORMAL_CLASS or s.stray:
            s.stray = False
            for block in self._owned(s):
                if (block.prev_free_block is not None and block.ref_cnt == 0
                        and block._block_hash is not None):
                    _vllm_remove(self, block)
                    listed.append(block)
        target = self._class(cls)
        if cls == old:
            if listed:
                # only the strays move; they go behind the session's other blocks in the class,
                # whatever their place in ownership order
                self._file(s, listed, mixed=True)
            return
        # The session's blocks in side classes are those of its units since its latest move;
        # the move takes them from the units that hold any, a move not worked out yet standing
        # for its own sources (a chain of moves is resolved once, from where blocks joined).
        side_free = 0
        sources: list = []
        mixed = False
        for unit in s.units:
            if not unit.live:
                continue
            side_free += unit.live
            if unit.blocks is None and not unit.mixed:
                sources += unit.sources
            else:
                sources.append(unit)
                mixed = mixed or unit.mixed
        if old != NORMAL_CLASS:
            source = self._classes[old]
            source.live -= side_free
            target.live += side_free
        if listed:
            # the blocks taken from the list, as one unit of the move's sources
            taken = _Unit(s, target, self._ticket(), listed, len(listed))
            pos = self._pos
            for block in listed:
                pos[block.block_id] = taken
            sources.append(taken)
        move = _Unit(s, target, self._ticket(), None, 0)
        move.sources = sources
        # blocks from the list interleave with the others in ownership order: by the log
        move.mixed = mixed or bool(listed and side_free)
        move.live = side_free + len(listed)
        if listed:
            target.live += len(listed)
            self._side_live += len(listed)
            self.num_free_blocks += len(listed)
        s.latest = move
        s.units = [move]
        if move.live:
            target.q.append(move)
        if old != NORMAL_CLASS:
            source.compact_if_stale()

    def forget_session(self, session: str) -> None:
        """Drop a session that owns no block and is back in the normal class, as a sweep would
        (sweeps follow frees, so without this an idle engine would keep every released one)."""
        s = self._sessions.get(session)
        if s is not None and s.cls == NORMAL_CLASS and not self._owned(s):
            del self._sessions[session]

    def prefix_cache_reset(self) -> None:
        """vLLM's ``reset_prefix_cache`` took every free block's hash. Directives move cached
        blocks only, so the blocks in side classes stay where they are from now on: each class's
        blocks become one unit that follows no session."""
        nobody = _Session("")
        pos = self._pos
        for c in self._classes.values():
            blocks = self._members(c)
            c.q = deque()
            if blocks:
                unit = _Unit(nobody, c, self._ticket(), blocks, len(blocks))
                for block in blocks:
                    pos[block.block_id] = unit
                c.q.append(unit)
        for s in self._sessions.values():
            s.units = []

    def _back_to_list(self, s: _Session, source: _Class) -> None:
        """The session's blocks in side classes (all in ``source``) go to the list's tail."""
        pos = self._pos
        # cached blocks only, as every move: after a prefix-cache reset its blocks stay put
        moved = [block for block in self._owned(s)
                 if pos[block.block_id] is not None and block._block_hash is not None]
        for block in moved:
            pos[block.block_id] = None
        # supersedes every unit of the session: they are all empty now
        s.latest = _Unit(s, None, self._ticket(), None, 0)
        s.units = []
        source.live -= len(moved)
        self._side_live -= len(moved)
        self.num_free_blocks -= len(moved)
        _vllm_append_n(self, moved)
        source.compact_if_stale()


class Retention:
    """Per-pool retention state and directive inbox."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 limits: DirectiveLimits | None = None) -> None:
        self.clock = clock
        self.inbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.free_session: str | None = None
        self.queue: ClassedFreeQueue | None = None
        self.dropped = 0
        self._session_class: dict[str, tuple[int, float]] = {}
        self._expiries: list[tuple[float, str]] = []
        # what a directive may do here (sluice_vllm_plugin.directive_limits), applied as each
        # is drained; ``governor.refused`` counts the refusals by reason
        self.governor = DirectiveGovernor(limits if limits is not None else environment_limits(),
                                          blocks_of=lambda session: len(self._blocks_of(session)))
        self._log_due = ThrottledLog().due

    # any thread
    def post(self, action: KvAction, at: float | None = None) -> bool:
        """Queue a directive; its TTL or deadline runs from ``at`` (default: now, on ``clock``).
        False (refused, counted) when ``max_queued`` wait already: an idle engine drains nothing."""
        if self.inbox.qsize() >= self.governor.limits.max_queued:
            # the directive socket's thread is the one poster, so this count has one writer
            self.governor.refused[REFUSED_QUEUED] += 1
            if (unlogged := self._log_due()) is not None:
                logger.warning("sluice retention: directive inbox full (%d waiting); refused %r "
                               "(%d not logged since the last line)", self.inbox.qsize(),
                               action, unlogged)
            return False
        self.inbox.put((action, self.clock() if at is None else at))
        return True

    # scheduler thread
    def drain(self) -> int:
        n = 0
        inbox = self.inbox
        self.forget_lapsed(self.clock())
        # the scheduler's thread is the only consumer: not empty means the get succeeds (and
        # no queue.Empty is raised to end every drain)
        while not inbox.empty():
            action, at = inbox.get_nowait()
            try:
                if self.apply(action, at):
                    n += 1
            except Exception as exc:  # never crash the engine on directive input
                self.dropped += 1
                if (unlogged := self._log_due()) is not None:
                    logger.warning("sluice retention: dropped directive %.300r: %s: %s (%d dropped, "
                                   "%d not logged since the last line)", action,
                                   type(exc).__name__, exc, self.dropped, unlogged)
        return n

    def apply(self, action: KvAction, at: float) -> bool:
        """Carry out one directive posted at ``at``, within the limits: the method named after
        its verb. False when the limits refuse it."""
        session_id = action.payload.session_id
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        admitted = self.governor.admit(action, at)
        if admitted is None:
            if (unlogged := self._log_due()) is not None:
                logger.warning("sluice retention: directive %.300r refused by the directive limits "
                               "(refused so far: %s; %d sessions hold state; %d not logged since "
                               "the last line)", action, dict(self.governor.refused),
                               self.governor.sessions, unlogged)
            return False
        getattr(self, verb_of(admitted))(admitted.payload, at)
        return True

    def forget_lapsed(self, now: float) -> None:
        """Release the sessions whose latest directive is ``forget_after_s`` old."""
        for session_id in self.governor.lapsed(now):
            try:
                self.release(SessionPayload(session_id), now)
            except Exception as exc:  # never crash the engine on directive state
                self.dropped += 1
                if (unlogged := self._log_due()) is not None:
                    logger.warning("sluice retention: releasing forgotten session %.300r failed: "
                                   "%s: %s (%d not logged since the last line)", session_id,
                                   type(exc).__name__, exc, unlogged)

    def class_of(self, session_id: str) -> int:
        entry = self._session_class.get(session_id)
        return NORMAL_CLASS if entry is None else entry[0]

    # the verbs: each takes its action's payload and when it was posted

    def retain(self, payload: RetainPayload, at: float) -> None:
        """``kv.retain``: the session's blocks in class ``priority`` until ``ttl_s`` from ``at``."""
        session_id = payload.session_id
        cls = max(LOW_CLASS + 1, min(100, int(payload.priority)))
        expires = at + float(payload.ttl_s)
        self._session_class[session_id] = (cls, expires)
        heap = self._expiries
        heapq.heappush(heap, (expires, session_id))
        if len(heap) > 2 * len(self._session_class) + HEAP_SLACK:
            # one entry per session that can still expire (as sim/block_pool.py): a session
            # retained again leaves its earlier entry behind, only ever skipped. In place: the
            # free queue holds this list.
            heap[:] = [(end, s) for s, (_, end) in self._session_class.items() if end != float("inf")]
            heapq.heapify(heap)
        self._reclass(session_id, cls)

    def demote(self, payload: SessionPayload, at: float) -> None:
        """``kv.demote``: the session's blocks go first."""
        self._demote(payload.session_id)

    def release(self, payload: SessionPayload, at: float) -> None:
        """``kv.release``: back to plain LRU, here and in the host tiers."""
        session_id = payload.session_id
        self._session_class.pop(session_id, None)
        self._reclass(session_id, NORMAL_CLASS)
        if self.queue is not None:
            self.queue.forget_session(session_id)
        for host in host_tiers():
            host.release(session_id)

    def offload(self, payload: OffloadPayload, at: float) -> None:
        """``kv.offload`` (:mod:`sluice_vllm_plugin.host_tier`): park in the host tier, then
        demote on the GPU."""
        session_id = payload.session_id
        hosts = host_tiers()
        if hosts:
            blocks = self._blocks_of(session_id)
            for host in hosts:
                host.offload(session_id, blocks)
        self._demote(session_id)

    def prefetch(self, payload: PrefetchPayload, at: float) -> None:
        """``kv.prefetch``: favour the session in the host tier until ``deadline_s`` from ``at``
        (none: until its blocks are loaded); undo a demotion on the GPU."""
        session_id, priority = payload.session_id, int(payload.priority)
        deadline_s = float("inf") if payload.deadline_s is None else float(payload.deadline_s)
        hosts = host_tiers()
        if hosts:
            blocks = self._blocks_of(session_id)
            for host in hosts:
                host.prefetch(session_id, priority, deadline_s, at, blocks)
        if self.class_of(session_id) == LOW_CLASS:
            self._session_class.pop(session_id, None)
            self._reclass(session_id, NORMAL_CLASS)

    def _demote(self, session_id: str) -> None:
        self._session_class[session_id] = (LOW_CLASS, float("inf"))
        self._reclass(session_id, LOW_CLASS)

    def _blocks_of(self, session_id: str) -> list:
        """The session's free cached blocks (those its requests freed last)."""
        return self.queue.owned(session_id) if self.queue is not None else []

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


# The host tiers in this process (none unless vLLM's offloading connector is on): attached by
# sluice_vllm_plugin.host_tier, which builds on this module (this one needs only their
# release / offload / prefetch), and held weakly, as the pools are.
_host_tiers: "weakref.WeakSet[Any]" = weakref.WeakSet()


def attach_host_tier(host: Any) -> None:
    """Let directives reach ``host`` (a :class:`sluice_vllm_plugin.host_tier.HostTier`)."""
    _host_tiers.add(host)


def host_tiers() -> list:
    return list(_host_tiers)


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


def post(action: KvAction) -> None:
    """Post a directive to every patched pool in this process (thread-safe)."""
    for pool in list(_pools):
        state(pool).post(action)
    if not _pools:
        logger.debug("sluice retention: no block pool yet; directive %r ignored", action)


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


def _wrap_reset(orig):
    @functools.wraps(orig)
    def reset_prefix_cache(self):
        ok = orig(self)
        r = getattr(self, _ATTR, None)
        if ok and r is not None and r.queue is not None:
            r.queue.prefix_cache_reset()
        return ok
    return reset_prefix_cache


_PATCHES = MethodPatches([
    (BlockPool, "__init__", then(install)),
    (BlockPool, "reset_prefix_cache", _wrap_reset),
    (_kcm.KVCacheManager, "free", _wrap_manager_free),
])

apply = _PATCHES.apply
remove = _PATCHES.remove
