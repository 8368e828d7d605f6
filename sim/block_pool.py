"""A block pool with vLLM's prefix-caching semantics (vLLM 0.32 ``v1/core/block_pool.py``).

What is kept exactly, because hit rates and events depend on it:
- block 0 is the null block and is never handed out; free blocks start in id order;
- a freed block with a hash goes to the *tail* of the free queue (evicted last, LRU); one
  without a hash goes to the *head* (reused first); callers free a request's blocks in
  reverse so its chain tail is evicted before its head;
- eviction is lazy: a cached block keeps its hash while free, and loses it (emitting one
  ``BlockRemoved`` per hash) only when it is handed out again;
- duplicates are not de-duplicated: two blocks may be cached under one hash, and each
  caching emits its own ``BlockStored``; a lookup returns the first one cached;
- ``cache_full_blocks`` emits one ``BlockStored`` for the newly full range, with the parent
  hash of the block before it (None from block 0) and the request's session id;
  ``extra_keys`` is one ``None`` per block, as vLLM sends for requests without LoRA,
  multimodal inputs or cache salt (``emit_cached_block_events`` likewise);
- ``reset_prefix_cache`` only works when nothing is in use, and emits ``AllBlocksCleared``.

Since every free block without a hash precedes every cached one in vLLM's queue, the pool
keeps them in a queue of their own that is always served first.

Speed (the simulator frees and takes back whole prompts, hundreds of blocks, at every call):
reference counts, hash flags, eviction classes and owners are arrays, and the free queues are
lazy (``_FreeQueue``): a free appends its blocks as one segment, a prefix hit only changes
their stamps, and allocation skips entries whose stamp is no longer their block's. The order
blocks are handed out in, and every event, are those of the per-block queues this replaces
(checked against them op by op on random sequences, retention included).

Sluice adds the retention bias of architecture.md §5.4 (the engine plugin's semantics): a free
block sits in the queue of its eviction class; allocation takes from the lowest class
first, LRU inside a class. Without directives every block is in the normal class and the
pool is vLLM's. Retained sessions' blocks wait in a higher class until the TTL runs out;
demoted or expired ones go to class 0, ahead of normal blocks. A bias, never a pin: when
only retained blocks are free, they are evicted.

With ``attribute_removals`` (the engine plugin's V1b, ``sluice_vllm_plugin/labels.py``) each
``BlockRemoved`` also names the continuation that first cached the hash and the prefix length
in tokens it covers; the first caching of a hash wins while any block holds it, and the entry
goes when the last block holding it is evicted. Off, the events are vLLM's own, byte for byte.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from scheduler.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from sim.pool_bulk import FEW, MEDIUM_GPU, BulkPaths, PoolExhausted

# Free blocks without a hash cost nothing to reuse and always go first (in vLLM they sit at
# the head of the free queue, ahead of every cached block), whatever the retention classes.
UNHASHED_CLASS = -1
NORMAL_CLASS = 50
LOW_CLASS = 0
# The retention expiry heap is rebuilt from its live entries once its stale ones exceed them
# by this many.
EXPIRY_SLACK = 64
# The free queues are rebuilt from their standing entries once they hold more than this many
# times as many entries as the pool has blocks, plus QUEUE_MIN.
QUEUE_SLACK = 3
QUEUE_MIN = 1024
# Allocations of at most this many blocks take them entry by entry (array operations cost more
# than they save on a few).
SMALL = FEW


def _ids(block_ids: Iterable[int]) -> np.ndarray:
    """Block ids as an array (an array of them is taken as it is)."""
    if isinstance(block_ids, (list, tuple, np.ndarray)):
        return np.asarray(block_ids, dtype=np.intp)
    return np.fromiter(block_ids, dtype=np.intp)


class _FreeQueue:
    """One eviction class's free blocks in LRU order (front evicted first), kept lazily as a
    queue of segments, each the blocks of one free (an array) with the stamp of its first
    entry (entry ``j`` has stamp ``first + j``) and how far it has been taken. An entry stands
    only while its block's stamp (``BlockPool._stamp``) is the entry's: taking a block back (a
    prefix hit) or queueing it again elsewhere (a new class) changes its stamp, so a request's
    blocks are queued and taken back with a few array operations, not one per block."""

    __slots__ = ("segments",)

    def __init__(self) -> None:
        # [blocks, stamp of blocks[0], index of the first entry not yet taken]
        self.segments: deque[list] = deque()

    def standing(self, stamp: np.ndarray) -> list[np.ndarray]:
        """The standing entries' blocks, head first, segment by segment."""
        parts = []
        for blocks, first, pos in self.segments:
            rest = blocks[pos:]
            parts.append(rest[stamp[rest] == np.arange(first + pos, first + len(blocks))])
        return parts


class BlockPool(BulkPaths):
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 enable_events: bool = True, attribute_removals: bool = False,
                 coalesce_removals: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be ≥ 2 (block 0 is the null block), got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.attribute_removals = attribute_removals and enable_events
        # one BlockRemoved per allocation for its unattributed evictions, not one per hash, and
        # no num_tokens on removals without a continuation: the same index state
        # (KVIndex.apply_events joins such runs and reads no num_tokens on them) at a fraction
        # of the cost; off, the stream is the plugin's, event for event (the simulator opts in)
        self.coalesce_removals = coalesce_removals
        # hash -> (continuation id, prefix tokens) of its first caching while cached
        # (attribute_removals; with coalesce_removals only cachings with a continuation)
        self._admitted: dict[BlockHash, tuple[str | None, int]] = {}
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int64)
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._hashed = np.zeros(num_blocks, dtype=bool)  # block_hash[i] is not None
        # block i is the one a lookup of its hash returns (sim/pool_bulk.py), and the eviction
        # count when it last lost its hash
        self._first = np.zeros(num_blocks, dtype=bool)
        self._evicted_at = np.zeros(num_blocks, dtype=np.int64)
        self._evictions = 0
        # hash -> block id, or {block id: None} when duplicates exist (first one wins lookups)
        self._cached: dict[BlockHash, int | dict[int, None]] = {}
        self._duplicated = 0  # how many hashes map to more than one block
        # eviction class -> free blocks in LRU order (front evicted first); a block's queue
        # entry stands while its stamp is the entry's (0: the block is in no queue)
        self._free: dict[int, _FreeQueue] = {UNHASHED_CLASS: _FreeQueue(), NORMAL_CLASS: _FreeQueue()}
        self._stamp = np.zeros(num_blocks, dtype=np.int64)
        self._next_stamp = 1
        self._entries = 0  # queue entries, standing or not
        self._free_count = 0
        self._block_class = np.full(num_blocks, UNHASHED_CLASS, dtype=np.int64)
        self._push(UNHASHED_CLASS, np.arange(1, num_blocks))
        self._free_count = num_blocks - 1
        # the eviction classes in allocation order (lowest first), kept as classes appear
        self._classes: list[int] = sorted(self._free)
        # bumped whenever the hash → block map changes, so callers may keep a lookup's
        # result (``longest_hit``) while it holds
        self.version = 0
        # bumped whenever touch or free_blocks changes reference counts (a hit's free blocks
        # can change no other way while none of them is evicted)
        self.refs = 0
        self._events: list[KVEvent] = []
        # retention: session -> (class, expires_at); session -> block ids it last freed
        self._session_class: dict[str, tuple[int, float]] = {}
        self._session_blocks: dict[str, dict[int, None]] = {}
        # each block's owner (the session that last freed it with a hash), as an index into
        # _session_names (-1: none)
        self._owner = np.full(num_blocks, -1, dtype=np.int64)
        self._session_index: dict[str, int] = {}
        self._session_names: list[str] = []
        self._expiries: list[tuple[float, str]] = []

    # -- queries ---------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._free_count

    @property
    def usage(self) -> float:
        """Share of blocks in use (vLLM's ``kv_cache_usage_perc``, free cached blocks excluded)."""
        return 1.0 - self._free_count / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        entry = self._cached.get(block_hash)
        if entry is None:
            return None
        if isinstance(entry, int):
            return entry
        return next(iter(entry))

    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (at most ``max_blocks``)."""
        if not self.enable_caching:
            return []
        limit = len(hashes) if max_blocks is None else min(max_blocks, len(hashes))
        # One C-level pass over the hashes, then cut at the first miss.
        entries = list(map(self._cached.get, hashes[:limit]))
        try:
            entries = entries[: entries.index(None)]
        except ValueError:
            pass
        if self._duplicated:
            entries = [e if type(e) is int else next(iter(e)) for e in entries]
        return entries

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    def free_queue_order(self) -> list[int]:
        """Free block ids in the order they would be handed out (vLLM's free queue, head first)."""
        return [block_id for cls in self._classes
                for part in self._free[cls].standing(self._stamp) for block_id in part.tolist()]

    def count_free(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` (each time it is named) nobody references."""
        if not len(block_ids):
            return 0
        return int(np.count_nonzero(self.ref_cnt[_ids(block_ids)] == 0))

    # -- allocation ------------------------------------------------------------------

    def get_new_blocks(self, n: int, now: float = 0.0) -> list[int]:
        """Pop ``n`` free blocks, evicting (and reporting) any cached hash they still carry."""
        if n > self._free_count:
            raise PoolExhausted(f"cannot get {n} free blocks, {self._free_count} free")
        if n <= 0:
            return []
        if self._expiries and self._expiries[0][0] <= now:
            self._expire(now)
        taken: list[int] = []
        stamp = self._stamp
        need = n
        for cls in self._classes:
            segments = self._free[cls].segments
            while need and segments:
                segment = segments[0]
                blocks, first, pos = segment
                size = len(blocks)
                if need <= SMALL:  # a few blocks (a decode step's): entry by entry
                    end = min(size, pos + 2 * SMALL)
                    while pos < end and need:
                        block_id = int(blocks[pos])
                        if stamp[block_id] == first + pos:
                            taken.append(block_id)
                            need -= 1
                        pos += 1
                    end = pos
                else:
                    end = min(size, pos + max(2 * need, 64))
                    window = blocks[pos:end]
                    standing = np.flatnonzero(stamp[window] == np.arange(first + pos, first + end))
                    if len(standing) > need:
                        standing = standing[:need]
                        end = pos + int(standing[-1]) + 1
                    taken += window[standing].tolist()
                    need -= len(standing)
                self._entries -= end - segment[2]
                if end == size:
                    segments.popleft()
                else:
                    segment[2] = end
            if not need:
                break
        self._free_count -= n
        # the same work block by block as one pass each: evictions (and their events) in the
        # order the blocks were taken, then owners and references, which no event depends on
        taken_ids = np.asarray(taken, dtype=np.intp) if n > SMALL else None
        if self.enable_caching:
            if self.coalesce_removals and taken_ids is not None:
                evicted_ids = taken_ids[self._hashed[taken_ids]]
                if len(evicted_ids) > 1:
                    self._evict_coalesced(evicted_ids.tolist(), evicted_ids)
                elif len(evicted_ids):
                    self._evict(int(evicted_ids[0]))
            else:
                block_hash = self.block_hash
                for block_id in taken:
                    if block_hash[block_id] is not None:
                        self._evict(block_id)
        if taken_ids is None:
            owner = self._owner
            ref = self.ref_cnt
            for block_id in taken:
                stamp[block_id] = 0
                if owner[block_id] >= 0:
                    self._forget_owner(block_id)
                ref[block_id] = 1
        else:
            stamp[taken_ids] = 0
            owner = self._owner
            owned_ids = taken_ids[owner[taken_ids] >= 0]
            if len(owned_ids):
                self._forget_owners(owned_ids, owner[owned_ids])
                owner[owned_ids] = -1
            self.ref_cnt[taken_ids] = 1
        return taken

    def _evict(self, block_id: int) -> None:
        self.version += 1
        self._evictions += 1
        block_hash = self.block_hash[block_id]
        self.block_hash[block_id] = None
        self._hashed[block_id] = False
        self._first[block_id] = False
        self._evicted_at[block_id] = self._evictions
        self._uncache(block_id, block_hash)
        if self.attribute_removals:
            if block_hash in self._cached:  # another block still holds it: keep the entry
                continuation_id, num_tokens = self._admitted.get(block_hash, (None, None))
            else:
                continuation_id, num_tokens = self._admitted.pop(block_hash, (None, None))
            self._events.append(BlockRemoved([block_hash], MEDIUM_GPU, group_idx=0,
                                             continuation_id=continuation_id, num_tokens=num_tokens))
        elif self.enable_events:
            self._events.append(BlockRemoved([block_hash], MEDIUM_GPU, group_idx=0))

    def touch(self, block_ids: Iterable[int]) -> None:
        """A prefix hit: take the blocks out of the free queue if they were free."""
        ids = _ids(block_ids)
        if not len(ids):
            return
        self.refs += 1
        ref = self.ref_cnt
        before = ref[ids]
        was_free = ids[(before == 0) & (ids != 0)]
        np.add.at(ref, ids, 1)
        if len(was_free):
            if len(ids) > 1 and int((ref[ids] - before).max()) > 1:  # a block named twice
                was_free = np.unique(was_free)
            self._stamp[was_free] = 0  # out of its queue
            self._free_count -= len(was_free)

    def free_blocks(self, ordered_ids: Iterable[int], session_id: str | None = None) -> None:
        """Drop one reference from each block, in eviction order (callers pass a request's
        blocks reversed, as vLLM does). ``session_id`` names the request's session: its
        freed cached blocks take the session's retention class."""
        ids = _ids(ordered_ids)
        ref = self.ref_cnt
        if len(ids):
            self.refs += 1
            before = ref[ids]
            np.subtract.at(ref, ids, 1)
            after = ref[ids]
            if int(after.min()) < 0:
                raise RuntimeError(f"block {int(ids[np.argmin(after)])} freed more often than allocated")
            freed = ids[(after == 0) & (ids != 0)]
            if len(freed) > 1 and int((before - after).max()) > 1:
                # a block named twice: it is freed where its count reaches 0, its last naming
                last = {int(block_id): i for i, block_id in enumerate(ids.tolist())}
                freed = np.asarray(sorted({b for b in freed.tolist()}, key=last.__getitem__),
                                   dtype=np.intp)
        else:
            freed = ids
        if not len(freed):
            if session_id is not None and not self._session_blocks.get(session_id, True):
                del self._session_blocks[session_id]
            return
        self._free_count += len(freed)
        if self.enable_caching:
            hashed_mask = self._hashed[freed]
            hashed = freed[hashed_mask]
            unhashed = freed[~hashed_mask] if len(hashed) != len(freed) else freed[:0]
        else:
            hashed, unhashed = freed[:0], freed
        if len(hashed):
            cls = NORMAL_CLASS if session_id is None else self._class_of(session_id)
            self._push(cls, hashed)
        if session_id is not None:
            owner = self._owner
            index = self._session_index.get(session_id)
            if index is None:
                index = self._session_index[session_id] = len(self._session_names)
                self._session_names.append(session_id)
            session_blocks = self._session_blocks
            owned = session_blocks.setdefault(session_id, {})
            changed = hashed[owner[hashed] != index]
            if len(changed):
                previous = owner[changed]
                if previous.max() < 0:  # all newly cached (the rule): one C-level update
                    owned.update(dict.fromkeys(changed.tolist()))
                else:
                    names = self._session_names
                    for block_id, before_id in zip(changed.tolist(), previous.tolist()):
                        if before_id >= 0:
                            del session_blocks[names[before_id]][block_id]
                        owned[block_id] = None
                owner[changed] = index
            if not owned:
                del session_blocks[session_id]
        if len(unhashed):
            # vLLM prepends blocks without a hash, keeping their given order at the front.
            self._push(UNHASHED_CLASS, unhashed, front=True)

    def _push(self, cls: int, block_ids: np.ndarray, *, front: bool = False) -> None:
        """Queue ``block_ids`` (in this order) in class ``cls``, at its tail or its front."""
        first = self._next_stamp
        self._next_stamp = first + len(block_ids)
        self._stamp[block_ids] = np.arange(first, self._next_stamp)
        self._block_class[block_ids] = cls
        segments = self._queue(cls).segments
        if front:
            segments.appendleft([block_ids, first, 0])
        else:
            segments.append([block_ids, first, 0])
        self._entries += len(block_ids)
        if self._entries > QUEUE_SLACK * self.num_blocks + QUEUE_MIN:
            self._compact()

    def _compact(self) -> None:
        """Drop the queue entries that no longer stand, keeping the order of the rest (each
        class's in one segment)."""
        self._entries = 0
        for queue in self._free.values():
            parts = queue.standing(self._stamp)
            queue.segments.clear()
            blocks = np.concatenate(parts) if parts else np.zeros(0, dtype=np.intp)
            if len(blocks):
                first = self._next_stamp
                self._next_stamp = first + len(blocks)
                self._stamp[blocks] = np.arange(first, self._next_stamp)
                queue.segments.append([blocks, first, 0])
                self._entries += len(blocks)

    def _queue(self, cls: int) -> _FreeQueue:
        """The free queue of eviction class ``cls`` (made on first use)."""
        queue = self._free.get(cls)
        if queue is None:
            queue = self._free[cls] = _FreeQueue()
            bisect.insort(self._classes, cls)
        return queue

    # -- caching ---------------------------------------------------------------------

    def cache_full_blocks(self, block_ids: Sequence[int], hashes: Sequence[BlockHash],
                          num_cached: int, num_full: int, *, session_id: str | None = None,
                          continuation_id: str | None = None,
                          token_ids: Sequence[int] | None = None) -> None:
        """Register ``block_ids[num_cached:num_full]`` under ``hashes[num_cached:num_full]``.

        ``token_ids`` are the tokens of that range when the caller has them (the simulator
        has none, and sends an empty list as a stand-in; every block then counts
        ``block_size`` tokens downstream).
        """
        if not self.enable_caching or num_cached >= num_full:
            return
        self.version += 1
        # a hash's attribution is its first caching's (no other caching adds an entry); with
        # coalesced removals one without a continuation has none to give
        admitted = (self._admitted if self.attribute_removals
                    and (continuation_id is not None or not self.coalesce_removals) else None)
        new_hashes = (None if num_full - num_cached <= SMALL else
                      self._cache_fresh(block_ids, hashes, num_cached, num_full, admitted, continuation_id))
        if new_hashes is None:  # block by block (a decode step's block, duplicates, the null block)
            new_hashes = []
            block_hashes = self.block_hash
            hashed_flags = self._hashed
            cached = self._cached
            block_size = self.block_size
            for i in range(num_cached, num_full):
                block_id = block_ids[i]
                if block_id == 0:
                    continue
                block_hash = hashes[i]
                if block_hashes[block_id] is not None:
                    raise RuntimeError(f"block {block_id} is already cached")
                block_hashes[block_id] = block_hash
                hashed_flags[block_id] = True
                entry = cached.get(block_hash)
                if entry is None:
                    cached[block_hash] = block_id
                    self._first[block_id] = True
                    if admitted is not None:
                        admitted[block_hash] = (continuation_id, (i + 1) * block_size)
                else:  # a duplicate: lookups keep returning the first
                    self._first[block_id] = False
                    if isinstance(entry, int):
                        cached[block_hash] = {entry: None, block_id: None}
                        self._duplicated += 1
                    else:
                        entry[block_id] = None
                new_hashes.append(block_hash)
        if self.enable_events:
            parent = hashes[num_cached - 1] if num_cached > 0 else None
            self._events.append(
                BlockStored(new_hashes, parent, list(token_ids or ()), self.block_size, None,
                            MEDIUM_GPU, None, extra_keys=[None] * len(new_hashes) or None,
                            group_idx=0, session_id=session_id, continuation_id=continuation_id)
            )

    def emit_cached_block_events(self, hashes: Sequence[BlockHash], num_hit: int, *,
                                 session_id: str | None, continuation_id: str | None = None,
                                 token_ids: Sequence[int] | None = None) -> None:
        """``kv_cache_report_mode: "full"``: report a prefix hit as a store from block 0.

        ``token_ids`` are the hit blocks' tokens (the request's first ``num_hit`` blocks),
        as vLLM sends them, when the caller has them; as in ``cache_full_blocks`` an empty
        list stands in otherwise.
        """
        if self.enable_events and num_hit > 0:
            self._events.append(
                BlockStored(list(hashes[:num_hit]), None, list(token_ids or ()), self.block_size,
                            None, MEDIUM_GPU, None, extra_keys=[None] * num_hit, group_idx=0,
                            session_id=session_id, continuation_id=continuation_id)
            )

    def reset_prefix_cache(self) -> bool:
        if self._free_count != self.num_blocks - 1:
            return False
        self._cached.clear()
        self.version += 1
        self._admitted.clear()
        self._duplicated = 0
        self.block_hash = [None] * self.num_blocks
        self._hashed[:] = False
        self._first[:] = False
        self._evictions += 1
        self._evicted_at[:] = self._evictions
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    # -- retention bias --------------------------------------------------------------

    def retain(self, session_id: str, priority: int, ttl_s: float, now: float) -> None:
        """Bias eviction against the session's free blocks until ``now + ttl_s``."""
        cls = max(LOW_CLASS + 1, min(100, int(priority)))
        expires = now + ttl_s
        self._session_class[session_id] = (cls, expires)
        heap = self._expiries
        heapq.heappush(heap, (expires, session_id))
        if len(heap) > 2 * len(self._session_class) + EXPIRY_SLACK:
            self._compact_expiries()
        self._reclass(session_id, cls)

    def demote(self, session_id: str) -> None:
        self._session_class[session_id] = (LOW_CLASS, float("inf"))
        self._reclass(session_id, LOW_CLASS)

    def release(self, session_id: str) -> None:
        """Forget the session's bias; its free blocks go back to the normal class."""
        self._session_class.pop(session_id, None)
        self._reclass(session_id, NORMAL_CLASS)

    def session_block_ids(self, session_id: str) -> list[int]:
        """The blocks the session owns (stored them first), in the order it got them."""
        return list(self._session_blocks.get(session_id, ()))

    def session_block_count(self, session_id: str) -> int:
        """How many blocks the session owns (what a retain of it would hold back)."""
        return len(self._session_blocks.get(session_id, ()))

    def _class_of(self, session_id: str) -> int:
        entry = self._session_class.get(session_id)
        return NORMAL_CLASS if entry is None else entry[0]

    def _expire(self, now: float) -> None:
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expires, session_id = heapq.heappop(heap)
            entry = self._session_class.get(session_id)
            if entry is not None and entry[1] == expires:
                self._session_class[session_id] = (LOW_CLASS, float("inf"))
                self._reclass(session_id, LOW_CLASS)

    def _compact_expiries(self) -> None:
        """Keep one expiry per session that can still expire. A session retained again, or
        released, leaves its earlier entry behind, which ``_expire`` would only skip; without
        this a stream of retains grows the heap until their TTLs pass (which, in a worker
        that allocates nothing, is never). Expiries happen exactly as before."""
        heap = self._expiries
        heap[:] = [(expires, session_id) for session_id, (_, expires) in self._session_class.items()
                   if expires != float("inf")]
        heapq.heapify(heap)

    def _reclass(self, session_id: str, cls: int) -> None:
        """Move the session's free blocks to ``cls``, keeping their relative LRU order."""
        owned = self._session_blocks.get(session_id)
        if not owned:
            return
        ids = np.fromiter(owned, dtype=np.intp, count=len(owned))
        moved = ids[(self.ref_cnt[ids] == 0) & (self._block_class[ids] != cls) & self._hashed[ids]]
        if len(moved):
            self._push(cls, moved)

    def _forget_owner(self, block_id: int) -> None:
        previous = int(self._owner[block_id])
        if previous >= 0:
            name = self._session_names[previous]
            owned = self._session_blocks[name]
            owned.pop(block_id, None)
            if not owned:
                del self._session_blocks[name]
            self._owner[block_id] = -1
