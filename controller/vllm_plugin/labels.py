"""V1a / V1b: continuation labels on vLLM's KV events (vLLM 0.32).

V1a. ``BlockStored`` carries ``continuation_id``, taken from the request's
``sampling_params.extra_args["continuation_id"]`` (the OpenAI server's ``vllm_xargs``). vLLM builds
``BlockStored`` in two places: ``BlockPool._build_block_stored_event`` (used for newly cached full
blocks *and*, in ``kv_cache_report_mode: "full"``, for reused ones) and inline in
``BlockPool.cache_partial_block``. Both are wrapped; the event becomes a
:class:`LabelledBlockStored`, a subclass of vLLM's struct with the same tag, so the wire map is
vLLM's plus one trailing key (omitted when None) that old consumers ignore.

V1b. ``BlockRemoved`` carries the continuation that *first* admitted the hash and the prefix length
in tokens that hash covers (``num_tokens``). The pool keeps a side map
``hash-with-group -> (continuation_id, num_tokens)``, filled when a hash key is inserted
(``_insert_block_hash``) while a caching call of a request is on the stack; it is kept only when
events are enabled. ``setdefault`` keeps the first admitter while any copy is cached. A removal is
labelled from the map; the entry is dropped only when no block holds the hash any more, so with
duplicate blocks under one hash every removal, the final one included, is labelled. Hashes moved
between blocks (``move_block_hashes``) keep their entry. ``reset_prefix_cache`` clears the map.

Labels never enter block hashing: hashes are computed by the request's block hasher from tokens
and extra keys only; nothing here touches ``request.block_hashes`` or the hash map keys.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core import block_pool as _bp
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

BlockPool = _bp.BlockPool

_CUR = "_sluice_cur_label"        # (continuation_id,) of the caching call on the stack
_ADMIT = "_sluice_admitted"       # side map: BlockHashWithGroupId -> (continuation_id, num_tokens)


class LabelledBlockStored(BlockStored, tag="BlockStored"):
    continuation_id: str | None = None


class LabelledBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    continuation_id: str | None = None
    num_tokens: int | None = None


_STORED_FIELDS = BlockStored.__struct_fields__


def continuation_of(request: Any) -> str | None:
    """The request's ``continuation_id`` from ``vllm_xargs``; None when absent or not a str."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) if params is not None else None
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
    """The pool's side map (empty dict when nothing was recorded)."""
    return getattr(pool, _ADMIT, None) or {}


# -- wrappers ------------------------------------------------------------------------------------

_originals: dict[str, Any] = {}


def _wrap_build(orig):
    @functools.wraps(orig)
    def _build_block_stored_event(self, request, *args, **kwargs):
        return label_stored(orig(self, request, *args, **kwargs), continuation_of(request))
    return _build_block_stored_event


def _wrap_cache_full(orig):
    @functools.wraps(orig)
    def cache_full_blocks(self, request, *args, **kwargs):
        if not self.enable_kv_cache_events:
            return orig(self, request, *args, **kwargs)
        self.__dict__[_CUR] = (continuation_of(request),)
        try:
            return orig(self, request, *args, **kwargs)
        finally:
            self.__dict__[_CUR] = None
    return cache_full_blocks


def _wrap_cache_partial(orig):
    @functools.wraps(orig)
    def cache_partial_block(self, request, *args, **kwargs):
        if not self.enable_kv_cache_events:
            return orig(self, request, *args, **kwargs)
        queue = self.kv_event_queue
        start = len(queue)
        cid = continuation_of(request)
        self.__dict__[_CUR] = (cid,)
        try:
            result = orig(self, request, *args, **kwargs)
        finally:
            self.__dict__[_CUR] = None
        for i in range(start, len(queue)):
            ev = queue[i]
            if type(ev) is BlockStored:
                queue[i] = label_stored(ev, cid)
        return result
    return cache_partial_block


def _wrap_insert(orig):
    @functools.wraps(orig)
    def _insert_block_hash(self, block_hash_with_group_id, block, num_tokens):
        d = self.__dict__
        label = d.get(_CUR)
        if label is not None:
            side = d.get(_ADMIT)
            if side is None:
                side = d[_ADMIT] = {}
            if block_hash_with_group_id not in side:
                side[block_hash_with_group_id] = (label[0], num_tokens)
        return orig(self, block_hash_with_group_id, block, num_tokens)
    return _insert_block_hash


def _wrap_removed(orig):
    @functools.wraps(orig)
    def _emit_block_removed_events(self, block_hashes):
        if not self.enable_kv_cache_events:
            return orig(self, block_hashes)
        side = self.__dict__.get(_ADMIT) or {}
        still_cached = self.cached_block_hash_to_block._cache
        for key in block_hashes:
            if key in still_cached:          # another block still holds this hash
                cid, ntok = side.get(key, (None, None))
            else:
                cid, ntok = side.pop(key, (None, None))
            self.kv_event_queue.append(LabelledBlockRemoved(
                block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
                medium=self.medium,
                group_idx=get_group_id(key),
                continuation_id=cid,
                num_tokens=ntok,
            ))
    return _emit_block_removed_events


def _wrap_reset(orig):
    @functools.wraps(orig)
    def reset_prefix_cache(self):
        ok = orig(self)
        if ok:
            side = self.__dict__.get(_ADMIT)
            if side:
                side.clear()
        return ok
    return reset_prefix_cache


_WRAPPERS = {
    "_build_block_stored_event": _wrap_build,
    "cache_full_blocks": _wrap_cache_full,
    "cache_partial_block": _wrap_cache_partial,
    "_insert_block_hash": _wrap_insert,
    "_emit_block_removed_events": _wrap_removed,
    "reset_prefix_cache": _wrap_reset,
}


def apply() -> None:
    """Patch ``BlockPool`` (idempotent)."""
    if _originals:
        return
    for name, wrap in _WRAPPERS.items():
        orig = getattr(BlockPool, name)
        _originals[name] = orig
        setattr(BlockPool, name, wrap(orig))


def remove() -> None:
    """Undo :func:`apply` (tests)."""
    for name, orig in _originals.items():
        setattr(BlockPool, name, orig)
    _originals.clear()


def is_applied() -> bool:
    return bool(_originals)
