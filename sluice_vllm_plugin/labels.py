"""V1a / V1b: continuation labels on vLLM's KV events (vLLM 0.32).

V1a. ``BlockStored`` carries ``continuation_id``, taken from the request's
``sampling_params.extra_args["continuation_id"]`` (the OpenAI server's ``vllm_xargs``). vLLM builds
``BlockStored`` in two places: ``BlockPool._build_block_stored_event`` (used for newly cached full
blocks *and*, in ``kv_cache_report_mode: "full"``, for reused ones), which is replaced by one that
builds the labelled event directly, and inline in ``BlockPool.cache_partial_block``, whose event is
relabelled after the call. The event is a :class:`LabelledBlockStored`, a subclass of vLLM's
struct with the same tag, so the wire map is vLLM's plus one trailing key (omitted when None) that
old consumers ignore.

V1b. ``BlockRemoved`` carries the continuation that *first* admitted the hash and the prefix length
in tokens that hash covers (``num_tokens``): a hash cached again while a copy is still cached (a
duplicate block, a partial entry on another block) keeps its first admitter, and every removal,
the last copy's included, is labelled with it; once no block holds the hash, the next admission
starts afresh. Only admissions by ``cache_full_blocks`` / ``cache_partial_block`` with events
enabled are labelled; hashes moved between blocks (``move_block_hashes``) keep their label;
``reset_prefix_cache`` forgets all.

How, cheaply (this runs for every cached and every evicted block): a hash a block holds as its
*primary* key (every full block's, and a partial entry on a block without one) is labelled by
block, in a list indexed by block id (``_sluice_cids``); the prefix length is the block's own
``block_hash_num_tokens``, which vLLM keeps for exactly that key. After ``cache_full_blocks`` the
pool's hash map tells whether every block's hash was new (its size grew by one per block): then
each block is its hash's first admitter. Otherwise (duplicates, re-caching) each block takes the
label of another copy. Partial entries a block holds besides its primary key keep
``hash -> (continuation_id, num_tokens)`` in a side map (``_sluice_admitted``), dropped with the
last copy. An eviction reads the block's label before vLLM clears the block's hash.
:func:`admitted` shows both as one map.

Labels never enter block hashing: hashes are computed by the request's block hasher from tokens
and extra keys only; nothing here touches ``request.block_hashes`` or the hash map keys.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core import block_pool as _bp
from vllm.v1.core.kv_cache_utils import (generate_block_hash_extra_keys, get_block_hash,
                                         get_group_id, make_block_hash_with_group_id,
                                         maybe_convert_block_hash, resolve_block_hashes,
                                         to_event_extra_keys)

logger = logging.getLogger("sluice.vllm_plugin.labels")

BlockPool = _bp.BlockPool

_ADMIT = "_sluice_admitted"    # side map, non-primary keys: hash -> (continuation_id, num_tokens)
_CIDS = "_sluice_cids"         # block id -> continuation_id of its primary key's first admitter


class _Untracked:
    """``_sluice_cids`` entry of a block whose primary key (if any) was not admitted by a
    labelled call: its removal carries neither ``continuation_id`` nor ``num_tokens``."""

    def __repr__(self) -> str:
        return "UNTRACKED"


_UNTRACKED: Any = _Untracked()

# Class-level defaults of the per-pool attributes, so the hot paths read and set them as plain
# attributes (never through ``pool.__dict__``, which makes CPython drop its fast attribute access
# on that pool).
_POOL_DEFAULTS = {
    _ADMIT: None,
    _CIDS: None,
    "_sluice_request": None,      # the request of the latest BlockStored built ...
    "_sluice_cid": None,          # ... and its continuation id
    "_sluice_removing": None,     # (primary key, label, num_tokens) of the block being cleared
}


class LabelledBlockStored(BlockStored, tag="BlockStored"):
    continuation_id: str | None = None


class LabelledBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    continuation_id: str | None = None
    num_tokens: int | None = None


_STORED_FIELDS = BlockStored.__struct_fields__
# the hot paths build both labelled events positionally (a third cheaper than by keyword);
# ``apply`` checks that vLLM's structs still have these fields, in this order, with None for
# every default (the ones the positional calls pass as None)
_STORED_POSITIONAL = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                      "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                      "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
                      "continuation_id")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership",
                   "continuation_id", "num_tokens")


def _positional_fields_match() -> bool:
    return (LabelledBlockStored.__struct_fields__ == _STORED_POSITIONAL
            and LabelledBlockRemoved.__struct_fields__ == _REMOVED_FIELDS
            and all(d is None for d in LabelledBlockStored.__struct_defaults__)
            and all(d is None for d in LabelledBlockRemoved.__struct_defaults__))


def continuation_of(request: Any) -> str | None:
    """The request's ``continuation_id`` from ``vllm_xargs``; None when absent or not a str."""
    params = request.sampling_params       # None for pooling requests
    extra = params.extra_args if params is not None else None
    if not extra:
        return None
    value = extra.get("continuation_id")
    return value if isinstance(value, str) and value else None


def label_stored(event: BlockStored, continuation_id: str | None) -> LabelledBlockStored:
    if type(event) is LabelledBlockStored:
        return event
    return LabelledBlockStored(**{f: getattr(event, f) for f in _STORED_FIELDS},
                               continuation_id=continuation_id)


def admitted(pool: Any) -> dict:
    """Every labelled hash the pool holds: ``hash -> (continuation_id, num_tokens)`` (tests)."""
    out: dict = {}
    cids = getattr(pool, _CIDS, None)
    if cids is not None:
        for block in pool.blocks:
            key = block.block_hash
            if key is not None and cids[block.block_id] is not _UNTRACKED:
                out.setdefault(key, (cids[block.block_id], block.block_hash_num_tokens))
    for key, label in (getattr(pool, _ADMIT, None) or {}).items():
        out.setdefault(key, label)
    return out


def _cids(pool: Any) -> list:
    cids = pool._sluice_cids
    if cids is None:
        cids = pool._sluice_cids = [_UNTRACKED] * len(pool.blocks)
    return cids


def _first_admitter(pool: Any, key: Any, block: Any, default: str | None) -> str | None:
    """The label of ``key`` as another block holding it has it, else ``default``."""
    holders = pool.cached_block_hash_to_block._cache.get(key)
    if type(holders) is dict:
        cids = pool._sluice_cids
        for other in holders.values():
            if other is not block and other.block_hash == key:
                label = cids[other.block_id]
                if label is not _UNTRACKED:
                    return label
    side = pool._sluice_admitted
    entry = side.get(key) if side else None
    return default if entry is None else entry[0]


def _emit_removed(pool: Any, keys: list, primary: Any, label: Any, num_tokens: int | None) -> None:
    """vLLM's one ``BlockRemoved`` per key, labelled: ``primary`` (a block's primary key) with
    ``label`` / ``num_tokens``, any other key from the side map."""
    side = pool._sluice_admitted
    still_cached = pool.cached_block_hash_to_block._cache
    append = pool.kv_event_queue.append
    medium = pool.medium
    for key in keys:
        if key is primary and label is not _UNTRACKED:
            cid, ntok = label, num_tokens
            if side and key not in still_cached:
                side.pop(key, None)      # no block holds the hash now: nor any partial entry
        elif side:
            entry = side.get(key) if key in still_cached else side.pop(key, None)
            cid, ntok = (None, None) if entry is None else entry
        else:
            cid = ntok = None
        append(LabelledBlockRemoved(
            block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
            medium=medium,
            group_idx=get_group_id(key),
            continuation_id=cid,
            num_tokens=ntok,
        ))


# -- patches -------------------------------------------------------------------------------------
#
# The patches run once per allocated or cached block on the scheduler's hot path, so they take
# vLLM 0.32's exact parameter lists instead of ``*args, **kwargs`` (``apply`` checks them).

_originals: dict[str, Any] = {}


def _replace_build(orig):
    # vLLM 0.32 ``BlockPool._build_block_stored_event`` (vllm/v1/core/block_pool.py) with the
    # labelled struct built directly: same fields from the same sources, plus the label. Wrapping
    # it instead would build every event twice.
    # The continuation id is worked out here, once per caching call with events on, and left in
    # ``_sluice_cid`` for cache_full_blocks (replaced below) to label the blocks with.
    @functools.wraps(orig)
    def _build_block_stored_event(self, request, block_hashes, parent_block_hash,
                                  start_token_idx, end_token_idx, block_size,
                                  kv_cache_group_id, extra_keys_list):
        if request is self._sluice_request:      # a decode step of the same request
            cid = self._sluice_cid
        else:
            # continuation_of(request), inlined; anything but a plain non-empty str goes the
            # long way
            params = request.sampling_params
            extra = params.extra_args if params is not None else None
            cid = extra.get("continuation_id") if extra else None
            if cid is not None and (type(cid) is not str or not cid):
                cid = continuation_of(request)
            self._sluice_request = request
            self._sluice_cid = cid
        lora = request.lora_request
        # positional, in _STORED_POSITIONAL's order
        return LabelledBlockStored(
            block_hashes, parent_block_hash,
            request.all_token_ids[start_token_idx:end_token_idx], block_size,
            lora.adapter_id if lora else None, self.medium, lora.name if lora else None,
            to_event_extra_keys(extra_keys_list), kv_cache_group_id, None, None, None, None,
            request.session_id, cid)
    return _build_block_stored_event


def _replace_cache_full(orig):
    # vLLM 0.32 ``BlockPool.cache_full_blocks`` (vllm/v1/core/block_pool.py) with the labelling
    # in the same frame: it runs once per caching call (every decode block), and a wrapper
    # around it cost a frame each time. Same steps, same helpers, in the same order; with
    # events off it is vLLM's own method.
    @functools.wraps(orig)
    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, block_mask=None):
        if not self.enable_kv_cache_events:
            return orig(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                        kv_cache_group_id, block_mask)
        if num_cached_blocks >= num_full_blocks:
            return None          # vLLM caches nothing (most calls of an engine step)
        cache = self.cached_block_hash_to_block._cache
        before = len(cache)
        # -- vLLM's body, events on --
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        assert block_mask is None or len(block_mask) == len(new_full_blocks)
        block_hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size,
                                            block_size)
        new_block_hashes = block_hashes[num_cached_blocks:]
        new_hashes = []
        for i, blk in enumerate(new_full_blocks):
            if blk.is_null or (block_mask is not None and not block_mask[i]):
                continue
            block_hash = new_block_hashes[i]
            num_hash_tokens = (num_cached_blocks + i + 1) * block_size
            block_hash_with_group_id = make_block_hash_with_group_id(block_hash,
                                                                     kv_cache_group_id)
            if blk.block_hash is not None:
                # partial -> full promotion of the same block (vLLM asserts it)
                assert (blk.block_hash_num_tokens is not None
                        and blk.block_hash_num_tokens < num_hash_tokens)
                removed_hashes = self._remove_cached_block_hashes(blk)
                self._emit_block_removed_events(removed_hashes)
            self._insert_block_hash(block_hash_with_group_id, blk, num_tokens=num_hash_tokens)
            new_hashes.append(maybe_convert_block_hash(block_hash))
        if num_cached_blocks == 0:
            parent_block_hash = None
        else:
            parent_block_hash = maybe_convert_block_hash(block_hashes[num_cached_blocks - 1])
        extra_keys_list = []
        curr_mm_idx = 0
        for i in range(num_cached_blocks, num_full_blocks):
            if blocks[i].is_null:
                continue
            if block_mask is not None and not block_mask[i - num_cached_blocks]:
                continue
            block_start = i * block_size
            extra_keys, curr_mm_idx = generate_block_hash_extra_keys(
                request, block_start, block_start + block_size, curr_mm_idx)
            extra_keys_list.append(extra_keys)
        self.kv_event_queue.append(self._build_block_stored_event(
            request, block_hashes=new_hashes, parent_block_hash=parent_block_hash,
            start_token_idx=num_cached_blocks * block_size,
            end_token_idx=num_full_blocks * block_size, block_size=block_size,
            kv_cache_group_id=kv_cache_group_id, extra_keys_list=extra_keys_list))
        # -- the labels --
        # the request's continuation id, as _build_block_stored_event just found it
        cid = self._sluice_cid
        # vLLM gave each block it cached here (all but null and masked-out ones) the range's
        # hash as its primary key; a block that had a partial hash lost it first (labelled
        # removal via _remove_cached_block_hashes).
        cids = self._sluice_cids or _cids(self)
        added = len(cache) - before
        if added == num_full_blocks - num_cached_blocks and block_mask is None:
            # one new hash-map key per block: no block held any of these hashes
            if added == 1:                  # a decode filled a block
                cids[blocks[num_cached_blocks].block_id] = cid
                return None
            for i in range(num_cached_blocks, num_full_blocks):
                cids[blocks[i].block_id] = cid
            return None
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                continue
            key = blk.block_hash
            # a block already labelled held this very hash before the call
            if key is not None and cids[blk.block_id] is _UNTRACKED:
                cids[blk.block_id] = _first_admitter(self, key, blk, cid)
        return None
    return cache_full_blocks


def _wrap_cache_partial(orig):
    @functools.wraps(orig)
    def cache_partial_block(self, request, block, num_tokens, kv_cache_group_id, block_size,
                            replace_existing_hashes=False):
        if not self.enable_kv_cache_events:
            return orig(self, request, block, num_tokens, kv_cache_group_id, block_size,
                        replace_existing_hashes)
        queue = self.kv_event_queue
        start = len(queue)
        key = orig(self, request, block, num_tokens, kv_cache_group_id, block_size,
                   replace_existing_hashes)
        cid = continuation_of(request)
        if key is not None:       # None: a null block, nothing inserted
            if block.block_hash == key:
                cids = _cids(self)
                if cids[block.block_id] is _UNTRACKED:
                    cids[block.block_id] = _first_admitter(self, key, block, cid)
            else:
                side = self._sluice_admitted
                if side is None:
                    side = self._sluice_admitted = {}
                if key not in side:
                    if self._sluice_cids is None:
                        _cids(self)
                    hbs = self.hash_block_size
                    side[key] = (_first_admitter(self, key, block, cid), num_tokens // hbs * hbs)
        for i in range(start, len(queue)):
            ev = queue[i]
            if type(ev) is BlockStored:
                queue[i] = label_stored(ev, cid)
        return key
    return cache_partial_block


def _replace_evict(orig):
    remove_hashes = _originals["_remove_cached_block_hashes"]   # vLLM's, not the wrapper below

    # vLLM 0.32 ``BlockPool._maybe_evict_cached_block`` (vllm/v1/core/block_pool.py): same
    # steps, plus reading the block's label before its hash is cleared and emitting the
    # labelled removals. This is the allocation path's eviction, so it calls vLLM's
    # ``_remove_cached_block_hashes`` itself rather than through the wrapper.
    @functools.wraps(orig)
    def _maybe_evict_cached_block(self, block):
        if self.metrics_collector:
            self.metrics_collector.on_block_evicted(block)
        cids = self._sluice_cids
        if cids is None:              # nothing labelled in this pool (events off, or not yet)
            evicted_hashes = remove_hashes(self, block)
            if not evicted_hashes:
                return False
            self._emit_block_removed_events(evicted_hashes)
            return True
        block_id = block.block_id
        label = cids[block_id]
        # KVCacheBlock's fields behind its block_hash / block_hash_num_tokens properties: this
        # runs for every evicted block
        primary = block._block_hash
        num_tokens = block._block_hash_num_tokens
        evicted_hashes = remove_hashes(self, block)
        cids[block_id] = _UNTRACKED
        if not evicted_hashes:
            return False
        # _sluice_cids exists only on pools with events on
        if (label is not _UNTRACKED and len(evicted_hashes) == 1
                and evicted_hashes[0] is primary and not self._sluice_admitted):
            # the usual eviction: a full block's one hash, labelled by block (positional
            # fields: block_hashes, medium, group_idx, locality, ownership, then the labels)
            self.kv_event_queue.append(LabelledBlockRemoved(
                [maybe_convert_block_hash(get_block_hash(primary))], self.medium,
                get_group_id(primary), None, None, label, num_tokens))
            return True
        _emit_removed(self, evicted_hashes, primary, label, num_tokens)
        return True
    return _maybe_evict_cached_block


def _wrap_remove_hashes(orig):
    # Every other path that clears a block's hashes (a partial hash promoted or replaced, a move)
    # calls this and then, but for a move, _emit_block_removed_events: keep the block's label
    # for that call.
    @functools.wraps(orig)
    def _remove_cached_block_hashes(self, block):
        cids = self._sluice_cids
        if cids is not None:
            primary = block.block_hash
            if primary is not None:
                self._sluice_removing = (primary, cids[block.block_id], block.block_hash_num_tokens)
                cids[block.block_id] = _UNTRACKED
        return orig(self, block)
    return _remove_cached_block_hashes


def _replace_removed(orig):
    # vLLM 0.32 ``BlockPool._emit_block_removed_events`` (one BlockRemoved per hash key), with
    # the labels.
    @functools.wraps(orig)
    def _emit_block_removed_events(self, block_hashes):
        if not self.enable_kv_cache_events:
            return
        removing = self._sluice_removing
        if removing is None:
            _emit_removed(self, block_hashes, None, _UNTRACKED, None)
        else:
            self._sluice_removing = None
            _emit_removed(self, block_hashes, *removing)
    return _emit_block_removed_events


def _wrap_move(orig):
    @functools.wraps(orig)
    def move_block_hashes(self, src_block, dst_block):
        orig(self, src_block, dst_block)
        removing, self._sluice_removing = self._sluice_removing, None
        cids = self._sluice_cids
        key = dst_block.block_hash
        if cids is None or key is None:
            return
        if removing is not None and removing[0] == key:
            cids[dst_block.block_id] = removing[1]
        else:                 # src's primary key was not in the map: a partial entry leads now
            side = self._sluice_admitted
            entry = side.get(key) if side else None
            cids[dst_block.block_id] = _UNTRACKED if entry is None else entry[0]
    return move_block_hashes


def _wrap_reset(orig):
    @functools.wraps(orig)
    def reset_prefix_cache(self):
        ok = orig(self)
        if ok:
            if self._sluice_admitted:
                self._sluice_admitted.clear()
            if self._sluice_cids is not None:
                self._sluice_cids = None
            self._sluice_removing = None
        return ok
    return reset_prefix_cache


_PATCHES = {
    "_build_block_stored_event": _replace_build,
    "cache_full_blocks": _replace_cache_full,
    "cache_partial_block": _wrap_cache_partial,
    "_maybe_evict_cached_block": _replace_evict,
    "_remove_cached_block_hashes": _wrap_remove_hashes,
    "_emit_block_removed_events": _replace_removed,
    "move_block_hashes": _wrap_move,
    "reset_prefix_cache": _wrap_reset,
}


def _parameters(fn) -> list[str]:
    return list(inspect.signature(fn, follow_wrapped=False).parameters)


def apply() -> None:
    """Patch ``BlockPool`` (idempotent). Leaves vLLM alone, with a log line, when a method's
    parameters differ from the ones the patches were written against."""
    if _originals:
        return
    if not _positional_fields_match():
        logger.warning("sluice labels: BlockStored%s / BlockRemoved%s are not vLLM 0.32's; "
                       "labels not applied", BlockStored.__struct_fields__,
                       BlockRemoved.__struct_fields__)
        return
    _originals.update((name, getattr(BlockPool, name)) for name in _PATCHES)
    patched = {name: patch(_originals[name]) for name, patch in _PATCHES.items()}
    for name, fn in patched.items():
        if _parameters(fn) != _parameters(_originals[name]):
            logger.warning("sluice labels: BlockPool.%s%s is not vLLM 0.32's; labels not applied",
                           name, inspect.signature(_originals[name]))
            _originals.clear()
            return
    for name, fn in patched.items():
        setattr(BlockPool, name, fn)
    for name, value in _POOL_DEFAULTS.items():
        setattr(BlockPool, name, value)


def remove() -> None:
    """Undo :func:`apply` (tests)."""
    for name, orig in _originals.items():
        setattr(BlockPool, name, orig)
    if _originals:
        for name in _POOL_DEFAULTS:
            delattr(BlockPool, name)
    _originals.clear()


def is_applied() -> bool:
    return bool(_originals)
