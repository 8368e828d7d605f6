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
scheduler's thread when the pool next allocates (``get_new_blocks``) or when :meth:`Retention.drain`
is called between steps, never concurrently with an allocation. TTLs use ``Retention.clock``
(``time.monotonic`` by default) from when the directive was posted. The ZMQ directive socket
that posts here lives in :mod:`controller.vllm_plugin.directives`.

The class rules are written twice on purpose, here and in ``sim/block_pool.py``: this module runs
inside vLLM's environment, where ``sim/`` (and its dependencies) cannot be imported.
``tests/fidelity/test_vllm_plugin.py`` drives both through the same operations and directives
and asserts the same evictions, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import logging
import queue
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterable

from vllm.v1.core import block_pool as _bp
from vllm.v1.core import kv_cache_manager as _kcm

logger = logging.getLogger("sluice.vllm_plugin.retention")

BlockPool = _bp.BlockPool
UNHASHED_CLASS = -1
LOW_CLASS = 0
NORMAL_CLASS = 50
_ATTR = "_sluice_retention"
_pools: "weakref.WeakSet[Any]" = weakref.WeakSet()


class ClassedFreeQueue:
    """Drop-in for vLLM's ``FreeKVCacheBlockQueue`` with eviction classes."""

    def __init__(self, retention: "Retention", blocks: Iterable[Any]) -> None:
        self._r = retention
        self._free: dict[int, OrderedDict] = {UNHASHED_CLASS: OrderedDict(), NORMAL_CLASS: OrderedDict()}
        self._cls: dict[int, int] = {}
        self.num_free_blocks = 0
        front = self._free[UNHASHED_CLASS]
        for b in blocks:
            front[b.block_id] = b
            self._cls[b.block_id] = UNHASHED_CLASS
            self.num_free_blocks += 1

    # -- FreeKVCacheBlockQueue interface --

    def popleft(self) -> Any:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, {self.num_free_blocks} free")
        taken: list = []
        if n <= 0:
            return taken
        for cls in sorted(self._free):
            q = self._free[cls]
            while q and len(taken) < n:
                _, block = q.popitem(last=False)
                del self._cls[block.block_id]
                taken.append(block)
            if len(taken) == n:
                break
        self.num_free_blocks -= n
        forget = self._r._forget_owner
        for block in taken:
            forget(block.block_id)
        return taken

    def remove(self, block: Any) -> None:
        cls = self._cls.pop(block.block_id)
        del self._free[cls][block.block_id]
        self.num_free_blocks -= 1

    def append(self, block: Any) -> None:
        self.append_n([block])

    def append_n(self, blocks: list) -> None:
        if not blocks:
            return
        r = self._r
        session = r.free_session
        cls = NORMAL_CLASS if session is None else r.class_of(session)
        q = self._free.get(cls)
        if q is None:
            q = self._free[cls] = OrderedDict()
        for block in blocks:
            q[block.block_id] = block
            self._cls[block.block_id] = cls
            if session is not None:
                r._set_owner(block.block_id, block, session)
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list) -> None:
        if not blocks:
            return
        front = self._free[UNHASHED_CLASS]
        for block in reversed(blocks):
            front[block.block_id] = block
            front.move_to_end(block.block_id, last=False)
            self._cls[block.block_id] = UNHASHED_CLASS
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list:
        return [b for cls in sorted(self._free) for b in self._free[cls].values()]

    def iter_blocks_after(self, block: Any | None):
        """Free blocks in hand-out order after ``block`` (from the head when None or when
        ``block`` is no longer free), as vLLM's queue offers to the simple KV offloader."""
        blocks = self.get_all_free_blocks()
        start = 0
        if block is not None and block.block_id in self._cls:
            for i, b in enumerate(blocks):
                if b.block_id == block.block_id:
                    start = i + 1
                    break
        return iter(blocks[start:])

    # -- retention --

    def reclass(self, blocks: Iterable[Any], cls: int) -> None:
        for block in blocks:
            old = self._cls.get(block.block_id)
            if old is None or old == cls or block.ref_cnt != 0 or block.block_hash is None:
                continue
            del self._free[old][block.block_id]
            self._cls[block.block_id] = cls
            self._free.setdefault(cls, OrderedDict())[block.block_id] = block


class Retention:
    """Per-pool retention state and directive inbox."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.inbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.free_session: str | None = None
        self.queue: ClassedFreeQueue | None = None
        self.dropped = 0
        self._session_class: dict[str, tuple[int, float]] = {}
        self._session_blocks: dict[str, dict[int, Any]] = {}
        self._block_session: dict[int, str] = {}
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

    def expire(self, now: float) -> None:
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expires, session_id = heapq.heappop(heap)
            entry = self._session_class.get(session_id)
            if entry is not None and entry[1] == expires:
                self._session_class[session_id] = (LOW_CLASS, float("inf"))
                self._reclass(session_id, LOW_CLASS)

    def _reclass(self, session_id: str, cls: int) -> None:
        blocks = self._session_blocks.get(session_id)
        if blocks and self.queue is not None:
            self.queue.reclass(list(blocks.values()), cls)

    def _set_owner(self, block_id: int, block: Any, session_id: str) -> None:
        previous = self._block_session.get(block_id)
        if previous == session_id:
            return
        if previous is not None:
            owned = self._session_blocks[previous]
            owned.pop(block_id, None)
            if not owned:
                del self._session_blocks[previous]
        self._block_session[block_id] = session_id
        self._session_blocks.setdefault(session_id, {})[block_id] = block

    def _forget_owner(self, block_id: int) -> None:
        previous = self._block_session.pop(block_id, None)
        if previous is not None:
            owned = self._session_blocks[previous]
            owned.pop(block_id, None)
            if not owned:
                del self._session_blocks[previous]


def state(pool: Any) -> Retention:
    """The pool's retention state (installed by the patched ``BlockPool.__init__``)."""
    return pool.__dict__[_ATTR]


def install(pool: Any) -> Retention:
    """Give an existing pool a classed free queue (keeps its current free order)."""
    existing = pool.__dict__.get(_ATTR)
    if existing is not None:
        return existing
    r = Retention()
    q = ClassedFreeQueue(r, pool.free_block_queue.get_all_free_blocks())
    r.queue = q
    pool.free_block_queue = q
    pool.__dict__[_ATTR] = r
    _pools.add(pool)
    return r


def post(action: str, session_id: str, priority: int = NORMAL_CLASS, ttl_s: float = 0.0) -> None:
    """Post a directive to every patched pool in this process (thread-safe)."""
    for pool in list(_pools):
        state(pool).post(action, session_id, priority, ttl_s)
    if not _pools:
        logger.debug("sluice retention: no block pool yet; directive %s for %s ignored",
                     action, session_id)


@contextlib.contextmanager
def freeing(pool: Any, session_id: str | None):
    """Blocks freed inside this context belong to ``session_id``."""
    r = pool.__dict__.get(_ATTR)
    if r is None:
        yield
        return
    previous, r.free_session = r.free_session, session_id
    try:
        yield
    finally:
        r.free_session = previous


# -- patches -------------------------------------------------------------------------------------

_originals: dict[tuple[type, str], Any] = {}


def _wrap_init(orig):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        install(self)
    return __init__


def _wrap_get_new_blocks(orig):
    @functools.wraps(orig)
    def get_new_blocks(self, num_blocks):
        r = self.__dict__.get(_ATTR)
        if r is not None:
            if not r.inbox.empty():
                r.drain()
            # expiry is lazy, as in sim/block_pool.py: only when blocks are really handed out
            if r._expiries and 0 < num_blocks <= self.free_block_queue.num_free_blocks:
                r.expire(r.clock())
        return orig(self, num_blocks)
    return get_new_blocks


def _wrap_manager_free(orig):
    @functools.wraps(orig)
    def free(self, request):
        with freeing(self.block_pool, getattr(request, "session_id", None)):
            return orig(self, request)
    return free


_PATCHES = [
    (BlockPool, "__init__", _wrap_init),
    (BlockPool, "get_new_blocks", _wrap_get_new_blocks),
    (_kcm.KVCacheManager, "free", _wrap_manager_free),
]


def apply() -> None:
    if _originals:
        return
    for cls, name, wrap in _PATCHES:
        orig = cls.__dict__[name]
        _originals[(cls, name)] = orig
        setattr(cls, name, wrap(orig))


def remove() -> None:
    for (cls, name), orig in _originals.items():
        setattr(cls, name, orig)
    _originals.clear()
