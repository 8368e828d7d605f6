"""``kv.offload`` and ``kv.prefetch`` on vLLM's host KV tier (vLLM 0.32's offloading connector).

vLLM's scheduler-side offloading state is a ``CPUOffloadingManager``
(``vllm/v1/kv_offload/cpu/manager.py``): which offloaded chunks the host tier holds, keyed by
``OffloadKey`` (a block hash plus its KV cache group, ``vllm/v1/kv_offload/base.py``), and a
cache policy (``policies/lru.py``, ``policies/arc.py``) that picks what to give up when
``prepare_store`` needs room. The connector stores a request's blocks to the tier as they are
computed (write-through, ``OffloadingConnectorScheduler._build_store_jobs`` in
``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``) and loads a prefix
hit from it when a request arrives (``get_num_new_matched_tokens`` → ``lookup`` /
``prepare_load``). There is no call that stores the free blocks of a finished request, nor one
that loads blocks without a request, so the directives act on what vLLM offers:

* ``kv.offload``: the session's free cached blocks on the GPU (those its requests freed last,
  :meth:`retention.ClassedFreeQueue.owned`) are looked up in the tier; the ones it holds are
  *parked*: remembered as the session's, and touched (most recent in the tier's policy), so the
  host copy outlives others now that the GPU copy goes first; the session is then demoted on the
  GPU (eviction class 0). Blocks the tier does not hold (``offload_prompt_only`` leaves decode
  blocks out; ``store_threshold`` may skip a store) cannot be stored from here and stay on the
  GPU, demoted; :attr:`HostTier.not_held` counts them.
* ``kv.prefetch``: the session's parked keys, and any of its GPU blocks the tier holds, become
  *favoured*: when the tier must give up chunks, it gives up everyone else's first and favoured
  ones only when nothing else is left, lowest ``priority`` first. A bias, never a pin, as
  retention is. The favour ends at ``deadline_s`` (when given), when a request loads any of those
  keys (``prepare_load``: the program is back) or on ``kv.release``. On the GPU a demoted session
  goes back to the normal class: it is about to resume. Loading ahead of the request is not
  something vLLM 0.32's connector does (a load needs a request's GPU blocks to land in), so the
  load happens when the request arrives; the favour makes sure there is something to load.

Without a directive the policy's ``evict`` is called exactly as vLLM calls it.

Directives reach here through the GPU pool's inbox (:meth:`retention.Retention.drain`, on the
scheduler's thread), which reaches every tier :func:`install` attached
(:func:`retention.attach_host_tier`); ``prepare_store`` drains pending inboxes first, so a
directive posted between allocations is applied before the tier next evicts. This module builds
on :mod:`sluice_vllm_plugin.retention`, never the other way round.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Iterable

from vllm.v1.core.kv_cache_utils import (BlockHash, get_block_hash, get_group_id,
                                         make_block_hash_with_group_id)
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu import manager as _cpu_manager

from . import retention
from .patching import MethodPatches, then

logger = logging.getLogger("sluice.vllm_plugin.host_tier")

CPUOffloadingManager = _cpu_manager.CPUOffloadingManager
_VLLM_LOOKUP = CPUOffloadingManager.lookup
_ATTR = "_sluice_host_tier"
# lookup/touch take a request context; the CPU manager and its LRU/ARC policies do not read it
# for these calls, and a directive is no request of vLLM's
_DIRECTIVE_CONTEXT = ReqContext(req_id="sluice-directive")
_HELD = (LookupResult.HIT, LookupResult.HIT_PENDING)


def _keys_are_block_hashes() -> bool:
    """Whether vLLM packs an ``OffloadKey`` exactly as the GPU pool's ``BlockHashWithGroupId``
    (a block hash, then the group id as 4 big-endian bytes; true of 0.32): then a block's key in
    the tier is its hash as it is, with no unpacking and repacking per block."""
    sample = make_block_hash_with_group_id(BlockHash(b"sluice-probe"), 7)
    return make_offload_key(get_block_hash(sample), get_group_id(sample)) == sample


_SAME_KEYS = _keys_are_block_hashes()


def offload_keys(blocks: Iterable[Any]) -> list:
    """The ``OffloadKey`` each GPU block's hash would have in the tier (chunks of one block; with
    larger chunks only every chunk's last block has one there, and the rest are not held)."""
    if _SAME_KEYS:       # a directive walks every block the session owns
        return [block._block_hash for block in blocks if block._block_hash is not None]
    keys = []
    for block in blocks:
        block_hash = block.block_hash
        if block_hash is not None:
            keys.append(make_offload_key(get_block_hash(block_hash), get_group_id(block_hash)))
    return keys


class HostTier:
    """The Sluice state of one offloading manager: parked keys and favoured sessions."""

    def __init__(self, manager: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.manager = manager
        self.clock = clock
        self.parked: dict[str, list] = {}                   # session -> keys, parking order
        self.favoured: dict[str, tuple[int, float]] = {}    # session -> (priority, expires)
        self._favoured_keys: dict[str, list] = {}           # session -> keys it is favoured for
        self.not_held = 0
        policy = manager._policy
        # vLLM's own lookup (not a subclass's): held() may read the policy instead
        self._lookup_is_policy_get = type(manager).lookup is _VLLM_LOOKUP
        self._policy_evict = policy.evict
        # an attribute of this policy object only: the class, and every other manager, keep
        # vLLM's own method
        policy.evict = self._evict

    def held(self, keys: Iterable[Any]) -> list:
        """The keys the tier holds (``lookup`` HIT or HIT_PENDING). A directive looks up every
        block its session owns, so this asks the manager's policy directly, as vLLM 0.32's
        ``CPUOffloadingManager.lookup`` does (a chunk is held while the policy has it)."""
        if self._lookup_is_policy_get:
            get = self.manager._policy.get
            return [k for k in keys if get(k) is not None]
        lookup = self.manager.lookup
        return [k for k in keys if lookup(k, _DIRECTIVE_CONTEXT) in _HELD]

    def offload(self, session: str, blocks: Iterable[Any]) -> list:
        """Park the keys of the session's GPU blocks that the tier holds; the others are
        counted in ``not_held``."""
        keys = offload_keys(blocks)
        held = self.held(keys)
        self.not_held += len(keys) - len(held)
        parked = self.parked.setdefault(session, [])
        known = set(parked)
        parked.extend(k for k in held if k not in known)
        if held:
            self.manager.touch(held, _DIRECTIVE_CONTEXT)
        return held

    def prefetch(self, session: str, priority: int, deadline_s: float, now: float,
                 blocks: Iterable[Any]) -> list:
        """Favour the session's parked keys and the keys of its GPU ``blocks`` the tier holds,
        until ``deadline_s`` from ``now`` (``inf``: until loaded or released)."""
        candidates = list(self.parked.get(session, ()))
        known = set(candidates)
        candidates.extend(k for k in offload_keys(blocks) if k not in known)
        held = self.held(candidates)
        self.favoured[session] = (max(0, min(100, int(priority))), now + deadline_s)
        self._favoured_keys[session] = held
        if held:
            self.manager.touch(held, _DIRECTIVE_CONTEXT)
        return held

    def release(self, session: str) -> None:
        self.parked.pop(session, None)
        self._end_favour(session)

    def loaded(self, keys: Iterable[Any]) -> None:
        """A request loads ``keys``: every favoured session with one of them is back."""
        loaded = set(keys)
        for session, favoured in list(self._favoured_keys.items()):
            if not loaded.isdisjoint(favoured):
                self._end_favour(session)

    def _end_favour(self, session: str) -> None:
        self.favoured.pop(session, None)
        self._favoured_keys.pop(session, None)

    def _evict(self, n: int, protected: set) -> Any:
        if not self.favoured:
            return self._policy_evict(n, protected)
        now = self.clock()
        for session, (_, expires) in list(self.favoured.items()):
            if expires <= now:
                self._end_favour(session)
        # Everyone else's chunks first, then the favoured ones a priority level at a time,
        # lowest first. The policy's evict is all-or-nothing (CachePolicy.evict,
        # vllm/v1/kv_offload/cpu/policies/base.py), so each level takes what it can give and
        # the next level the rest.
        levels: list = sorted({priority for priority, _ in self.favoured.values()})
        taken: list = []
        for level in levels + [None]:
            shield = set() if level is None else {
                k for session, (priority, _) in self.favoured.items() if priority >= level
                for k in self._favoured_keys.get(session, ())}
            excluded = protected | shield
            got = self._policy_evict(n - len(taken), excluded)
            if got is not None:
                return taken + got
            available = self._evictable_outside(excluded) - len(taken)
            if available > 0:
                part = self._policy_evict(available, excluded)
                if part:
                    taken += part
        # not even everything unprotected is enough: put back what was taken, as vLLM's
        # refused evict leaves the cache unchanged
        policy = self.manager._policy
        for key, chunk in taken:
            policy.insert(key, chunk)
        return None

    def _evictable_outside(self, excluded: set) -> int:
        """Chunks the policy could evict that are not in ``excluded`` (the manager's count of
        idle chunks, less the idle ones in ``excluded``)."""
        get = self.manager._policy.get
        idle_excluded = 0
        for key in excluded:
            chunk = get(key)
            if chunk is not None and chunk.ref_cnt == 0:
                idle_excluded += 1
        return self.manager._num_evictable_cache_chunks - idle_excluded


def tier(manager: Any) -> HostTier | None:
    return getattr(manager, _ATTR, None)


def install(manager: Any) -> HostTier:
    existing = tier(manager)
    if existing is not None:
        return existing
    host = HostTier(manager)
    setattr(manager, _ATTR, host)
    retention.attach_host_tier(host)
    return host


# -- patches -------------------------------------------------------------------------------------

def _wrap_prepare_store(orig):
    @functools.wraps(orig)
    def prepare_store(self, keys, req_context):
        retention.drain_all()
        return orig(self, keys, req_context)
    return prepare_store


def _wrap_prepare_load(orig):
    @functools.wraps(orig)
    def prepare_load(self, keys, req_context):
        spec = orig(self, keys, req_context)
        host = getattr(self, _ATTR, None)
        if host is not None and host.favoured:
            host.loaded(keys)
        return spec
    return prepare_load


_PATCHES = MethodPatches([
    (CPUOffloadingManager, "__init__", then(install)),
    (CPUOffloadingManager, "prepare_store", _wrap_prepare_store),
    (CPUOffloadingManager, "prepare_load", _wrap_prepare_load),
])

apply = _PATCHES.apply
remove = _PATCHES.remove
