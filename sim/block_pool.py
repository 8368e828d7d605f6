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

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from scheduler.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

# Free blocks without a hash cost nothing to reuse and always go first (in vLLM they sit at
# the head of the free queue, ahead of every cached block), whatever the retention classes.
UNHASHED_CLASS = -1
NORMAL_CLASS = 50
LOW_CLASS = 0
MEDIUM_GPU = "GPU"
# The retention expiry heap is rebuilt from its live entries once its stale ones exceed them
# by this many.
EXPIRY_SLACK = 64


class PoolExhausted(RuntimeError):
    """More blocks were asked for than are free."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 enable_events: bool = True, attribute_removals: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be ≥ 2 (block 0 is the null block), got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.attribute_removals = attribute_removals and enable_events
        # hash -> (continuation id, prefix tokens) of its first caching (attribute_removals)
        self._admitted: dict[BlockHash, tuple[str | None, int]] = {}
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # hash -> block id, or {block id: None} when duplicates exist (first one wins lookups)
        self._cached: dict[BlockHash, int | dict[int, None]] = {}
        self._duplicated = 0  # how many hashes map to more than one block
        # eviction class -> free blocks in LRU order (front evicted first)
        self._free: dict[int, OrderedDict[int, None]] = {
            UNHASHED_CLASS: OrderedDict((i, None) for i in range(1, num_blocks)),
            NORMAL_CLASS: OrderedDict(),
        }
        self._free_count = num_blocks - 1
        self._block_class: list[int] = [UNHASHED_CLASS] * num_blocks
        self._events: list[KVEvent] = []
        # retention: session -> (class, expires_at); session -> block ids it last freed
        self._session_class: dict[str, tuple[int, float]] = {}
        self._session_blocks: dict[str, dict[int, None]] = {}
        self._block_session: list[str | None] = [None] * num_blocks
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
        return [block_id for cls in sorted(self._free) for block_id in self._free[cls]]

    # -- allocation ------------------------------------------------------------------

    def get_new_blocks(self, n: int, now: float = 0.0) -> list[int]:
        """Pop ``n`` free blocks, evicting (and reporting) any cached hash they still carry."""
        if n > self._free_count:
            raise PoolExhausted(f"cannot get {n} free blocks, {self._free_count} free")
        if n <= 0:
            return []
        self._expire(now)
        taken: list[int] = []
        for cls in sorted(self._free):
            queue = self._free[cls]
            while queue and len(taken) < n:
                block_id, _ = queue.popitem(last=False)
                taken.append(block_id)
            if len(taken) == n:
                break
        self._free_count -= n
        for block_id in taken:
            if self.enable_caching and self.block_hash[block_id] is not None:
                self._evict(block_id)
            self._forget_owner(block_id)
            self.ref_cnt[block_id] = 1
        return taken

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        self.block_hash[block_id] = None
        entry = self._cached.get(block_hash)
        if isinstance(entry, int):
            if entry == block_id:
                del self._cached[block_hash]
        elif entry is not None:
            entry.pop(block_id, None)
            if len(entry) == 1:
                self._cached[block_hash] = next(iter(entry))
                self._duplicated -= 1
            elif not entry:
                del self._cached[block_hash]
                self._duplicated -= 1
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
        ref = self.ref_cnt
        free = self._free
        block_class = self._block_class
        taken = 0
        for block_id in block_ids:
            if ref[block_id] == 0 and block_id != 0:
                del free[block_class[block_id]][block_id]
                taken += 1
            ref[block_id] += 1
        self._free_count -= taken

    def free_blocks(self, ordered_ids: Iterable[int], session_id: str | None = None) -> None:
        """Drop one reference from each block, in eviction order (callers pass a request's
        blocks reversed, as vLLM does). ``session_id`` names the request's session: its
        freed cached blocks take the session's retention class."""
        ref = self.ref_cnt
        block_hash = self.block_hash
        block_class = self._block_class
        caching = self.enable_caching
        cls = NORMAL_CLASS if session_id is None else self._class_of(session_id)
        queue = self._free.get(cls)
        if queue is None:
            queue = self._free[cls] = OrderedDict()
        if session_id is not None:
            owner = self._block_session
            owned = self._session_blocks.setdefault(session_id, {})
            session_blocks = self._session_blocks
        unhashed: list[int] = []
        freed = 0
        for block_id in ordered_ids:
            count = ref[block_id] - 1
            ref[block_id] = count
            if count > 0 or block_id == 0:
                if count < 0:
                    raise RuntimeError(f"block {block_id} freed more often than allocated")
                continue
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            freed += 1
            if not caching or block_hash[block_id] is None:
                unhashed.append(block_id)
                block_class[block_id] = UNHASHED_CLASS
                continue
            block_class[block_id] = cls
            queue[block_id] = None
            if session_id is not None:
                previous = owner[block_id]
                if previous != session_id:
                    if previous is not None:
                        del session_blocks[previous][block_id]
                    owner[block_id] = session_id
                    owned[block_id] = None
        self._free_count += freed
        if session_id is not None and not owned:
            del session_blocks[session_id]
        # vLLM prepends blocks without a hash, keeping their given order at the front.
        front = self._free[UNHASHED_CLASS]
        for block_id in reversed(unhashed):
            front[block_id] = None
            front.move_to_end(block_id, last=False)

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
        new_hashes: list[BlockHash] = []
        admitted = self._admitted if self.attribute_removals else None
        for i in range(num_cached, num_full):
            block_id = block_ids[i]
            if block_id == 0:
                continue
            block_hash = hashes[i]
            if self.block_hash[block_id] is not None:
                raise RuntimeError(f"block {block_id} is already cached")
            self.block_hash[block_id] = block_hash
            entry = self._cached.get(block_hash)
            if entry is None:
                self._cached[block_hash] = block_id
            elif isinstance(entry, int):
                self._cached[block_hash] = {entry: None, block_id: None}
                self._duplicated += 1
            else:
                entry[block_id] = None
            if admitted is not None and block_hash not in admitted:
                admitted[block_hash] = (continuation_id, (i + 1) * self.block_size)
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
        self._admitted.clear()
        self._duplicated = 0
        self.block_hash = [None] * self.num_blocks
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
        for block_id in self._session_blocks.get(session_id, ()):
            if (self.ref_cnt[block_id] != 0 or self._block_class[block_id] == cls
                    or self.block_hash[block_id] is None):
                continue
            del self._free[self._block_class[block_id]][block_id]
            self._block_class[block_id] = cls
            self._free.setdefault(cls, OrderedDict())[block_id] = None

    def _forget_owner(self, block_id: int) -> None:
        previous = self._block_session[block_id]
        if previous is not None:
            owned = self._session_blocks[previous]
            owned.pop(block_id, None)
            if not owned:
                del self._session_blocks[previous]
            self._block_session[block_id] = None
