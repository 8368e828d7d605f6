"""The block pool's bulk paths (sim/block_pool.py), for the simulator's hot loops: evictions,
cachings and owner changes of many blocks in a few C-level passes, and prefix lookups that
start from the blocks a session's previous call left (its next prompt repeats that call's
sequence).

Each path ends in the state, and emits the events, that the pool's block-by-block code
would (``BlockPool._evict`` / ``cache_full_blocks`` / ``longest_hit``); the one difference is
opt-in (``coalesce_removals``, the simulator's engines): evictions that carry no continuation
are reported as one ``BlockRemoved`` per allocation, without ``num_tokens``, which the policy's
index applies exactly as it applies the plugin's one-hash events (``KVIndex.apply_events``
joins runs of them and reads no ``num_tokens`` on them); only its ``events_seen`` counts fewer
events, and that is only ever compared with 0.

Bookkeeping they rely on, kept by the pool on every path: ``_evicted_at[b]`` is the eviction
count (``_evictions``) when block ``b`` last lost its hash, and ``_first[b]`` says that ``b``
is the block a lookup of its hash returns (the first cached of its duplicates).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from operator import itemgetter

import numpy as np

from scheduler.kv_events import BlockHash, BlockRemoved, KVEvent

MEDIUM_GPU = "GPU"
# At most this many blocks take per-block steps instead of array operations, which cost
# more than they save on a few (sim/block_pool.py's SMALL).
FEW = 4


class PoolExhausted(RuntimeError):
    """More blocks were asked for than are free."""


class BulkPaths:
    """Mixed into :class:`~sim.block_pool.BlockPool` (whose ``__init__`` sets these)."""

    block_hash: list[BlockHash | None]
    block_size: int
    enable_caching: bool
    enable_events: bool
    attribute_removals: bool
    version: int
    _cached: dict[BlockHash, int | dict[int, None]]
    _admitted: dict[BlockHash, tuple[str | None, int]]
    _duplicated: int
    _hashed: np.ndarray
    _first: np.ndarray
    _evicted_at: np.ndarray
    _evictions: int
    _events: list[KVEvent]
    _session_names: list[str]
    _session_blocks: dict[str, dict[int, None]]

    # BlockPool's
    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int | None = None) -> list[int]:
        raise NotImplementedError

    # -- lookups -----------------------------------------------------------------------

    def eviction_mark(self) -> int:
        """A mark to test later (:meth:`hit_holds`, :meth:`longest_hit_from`) whether blocks
        have lost their hashes since."""
        return self._evictions

    def hit_holds(self, hit_ids: np.ndarray, mark: int) -> bool:
        """Whether a lookup's hit blocks still answer it: none has been evicted since
        ``mark`` (a hash's first block changes only when that block is evicted)."""
        return not len(hit_ids) or int(self._evicted_at[hit_ids].max()) <= mark

    def longest_hit_from(self, hashes: Sequence[BlockHash], max_blocks: int,
                         known_hashes: Sequence[BlockHash], known_ids: np.ndarray, mark: int
                         ) -> tuple[list[int], np.ndarray]:
        """``longest_hit(hashes, max_blocks)`` and its blocks as an array, given blocks
        ``known_ids`` that held ``known_hashes`` (in order) at ``mark``: as far as those hashes
        are the prefix of ``hashes`` and their blocks are neither evicted since nor behind a
        duplicate, they are the answer without a lookup each."""
        limit = min(max_blocks, len(hashes))
        j = min(limit, len(known_ids))
        k = 0
        if j and self.enable_caching and known_hashes[:j] == hashes[:j]:
            head = known_ids[:j]
            bad = (self._evicted_at[head] > mark) | ~self._first[head]
            k = int(bad.argmax()) if bad.any() else j
        if not k:
            hit = self.longest_hit(hashes, limit)
            return hit, np.asarray(hit, dtype=np.intp)
        head = known_ids[:k]
        rest = self.longest_hit(hashes[k:limit]) if k < limit else []
        if not rest:
            return head.tolist(), head
        return head.tolist() + rest, np.concatenate([head, np.asarray(rest, dtype=np.intp)])

    # -- evictions ---------------------------------------------------------------------

    def _evict_coalesced(self, block_ids: list[int], id_array: np.ndarray) -> None:
        """``_evict`` of each of ``block_ids`` (all cached; ``id_array`` the same as an array)
        in order, the removals reported as one ``BlockRemoved`` per run of unattributed hashes
        (attributed ones keep their own)."""
        self.version += 1
        self._evictions += 1
        block_hash = self.block_hash
        hashes = [block_hash[block_id] for block_id in block_ids]
        for block_id in block_ids:
            block_hash[block_id] = None
        self._hashed[id_array] = False
        self._evicted_at[id_array] = self._evictions
        cached = self._cached
        admitted = self._admitted
        attributions: list[tuple[str | None, int | None]] | None = None
        if not self._duplicated:
            # each hash is held by its block alone (a block's hash is always in _cached)
            for block_hash_ in hashes:
                del cached[block_hash_]
            if self.attribute_removals and admitted:  # (coalesced: only labelled cachings)
                attributions = [admitted.pop(h, (None, None)) for h in hashes]
        else:
            attribute = self.attribute_removals
            attributions = [] if attribute else None
            for block_id, block_hash_ in zip(block_ids, hashes):
                self._uncache(block_id, block_hash_)
                if attribute:
                    if block_hash_ in cached:  # another block still holds it: keep the entry
                        attributions.append(admitted.get(block_hash_, (None, None)))
                    else:
                        attributions.append(admitted.pop(block_hash_, (None, None)))
        # after the dictionary: dropping a first duplicate hands "first" to the next one, which
        # may be among these blocks too
        self._first[id_array] = False
        if not self.enable_events:
            return
        events = self._events
        if attributions is None or not any(c is not None for c, _ in attributions):
            events.append(BlockRemoved(hashes, MEDIUM_GPU, group_idx=0))
            return
        run: list[BlockHash] = []
        for block_hash_, (continuation_id, num_tokens) in zip(hashes, attributions):
            if continuation_id is None:
                run.append(block_hash_)
                continue
            if run:
                events.append(BlockRemoved(run, MEDIUM_GPU, group_idx=0))
                run = []
            events.append(BlockRemoved([block_hash_], MEDIUM_GPU, group_idx=0,
                                       continuation_id=continuation_id, num_tokens=num_tokens))
        if run:
            events.append(BlockRemoved(run, MEDIUM_GPU, group_idx=0))

    def _uncache(self, block_id: int, block_hash: BlockHash) -> None:
        """Drop ``block_id`` from the blocks cached under ``block_hash``; the next duplicate,
        if any, becomes the one lookups return."""
        cached = self._cached
        entry = cached.get(block_hash)
        if isinstance(entry, int):
            if entry == block_id:
                del cached[block_hash]
        elif entry is not None:
            was_first = next(iter(entry)) == block_id
            entry.pop(block_id, None)
            if len(entry) == 1:
                cached[block_hash] = next(iter(entry))
                self._duplicated -= 1
            elif not entry:
                del cached[block_hash]
                self._duplicated -= 1
            if was_first and entry:
                self._first[next(iter(entry))] = True

    # -- owners ------------------------------------------------------------------------

    def _forget_owners(self, block_ids: np.ndarray, owners: np.ndarray) -> None:
        """``_forget_owner`` of each of ``block_ids`` (``owners`` theirs, all ≥ 0), but for the
        owner array, which the caller resets."""
        names = self._session_names
        session_blocks = self._session_blocks
        if owners[0] == owners[-1] and owners.min() == owners.max():  # one session's (the rule)
            name = names[int(owners[0])]
            owned = session_blocks[name]
            for block_id in block_ids.tolist():
                owned.pop(block_id, None)
            if not owned:
                del session_blocks[name]
            return
        for block_id, index in zip(block_ids.tolist(), owners.tolist()):
            name = names[index]
            owned = session_blocks[name]
            owned.pop(block_id, None)
            if not owned:
                del session_blocks[name]

    # -- caching -----------------------------------------------------------------------

    def _cache_fresh(self, block_ids: Sequence[int], hashes: Sequence[BlockHash], num_cached: int,
                     num_full: int, admitted: dict | None, continuation_id: str | None
                     ) -> list[BlockHash] | None:
        """``cache_full_blocks``'s block-by-block loop in a few C-level passes, for the common
        case (a prefill chunk's blocks, more than a few): none the null block or cached, under
        distinct hashes nothing caches yet. Returns the hashes cached, or None (nothing done)
        otherwise."""
        n = num_full - num_cached
        ids = list(block_ids[num_cached:num_full])
        new_hashes = list(hashes[num_cached:num_full])
        block_hashes = self.block_hash
        if 0 in ids or itemgetter(*ids)(block_hashes).count(None) != n:
            return None
        cached = self._cached
        if not cached.keys().isdisjoint(new_hashes) or len(set(new_hashes)) != n:
            return None
        for block_id, block_hash in zip(ids, new_hashes):
            block_hashes[block_id] = block_hash
        id_array = np.asarray(ids, dtype=np.intp)
        self._hashed[id_array] = True
        self._first[id_array] = True
        cached.update(zip(new_hashes, ids))
        if admitted is not None:
            bs = self.block_size
            admitted.update(zip(new_hashes, zip(itertools.repeat(continuation_id, n),
                                                range((num_cached + 1) * bs, (num_full + 1) * bs, bs))))
        return new_hashes
