"""The simulator's block pool with ``attribute_removals`` emits the engine plugin's V1b
removals (first admitter, prefix tokens), and without it exactly vLLM's own."""

from __future__ import annotations

from scheduler.kv_events import BlockRemoved, EventBatch, EventBatchDecoder, EventBatchEncoder
from sim.block_pool import BlockPool

BS = 4


def cache(pool: BlockPool, hashes: list[int], continuation: str | None) -> list[int]:
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache_full_blocks(blocks, hashes, 0, len(hashes), session_id="s", continuation_id=continuation)
    return blocks


def evict_everything(pool: BlockPool) -> list[BlockRemoved]:
    pool.take_events()
    pool.free_blocks(pool.get_new_blocks(pool.num_free))
    return [e for e in pool.take_events() if isinstance(e, BlockRemoved)]


def test_removal_names_the_first_admitter_and_the_prefix_tokens_the_hash_covers():
    pool = BlockPool(6, BS, attribute_removals=True)
    first = cache(pool, [11, 12, 13], "c1")
    pool.free_blocks(reversed(first))
    removed = evict_everything(pool)
    assert [(e.block_hashes, e.continuation_id, e.num_tokens) for e in removed] == [
        ([13], "c1", 12), ([12], "c1", 8), ([11], "c1", 4)]


def test_duplicates_keep_the_first_admitter_until_the_last_copy_goes():
    pool = BlockPool(6, BS, attribute_removals=True)
    a = cache(pool, [21], "c1")
    b = cache(pool, [21], "c2")      # a second block under the same hash, by another request
    pool.free_blocks(a)
    pool.free_blocks(b)
    removed = evict_everything(pool)
    assert [(e.continuation_id, e.num_tokens) for e in removed] == [("c1", 4), ("c1", 4)]
    assert pool._admitted == {}
    again = cache(pool, [21], "c3")  # a fresh caching after the last copy went
    pool.free_blocks(again)
    assert [e.continuation_id for e in evict_everything(pool)] == ["c3"]


def test_an_unlabelled_caching_still_attributes_its_prefix_length():
    pool = BlockPool(4, BS, attribute_removals=True)
    pool.free_blocks(cache(pool, [31, 32], None))
    assert [(e.continuation_id, e.num_tokens) for e in evict_everything(pool)] == [(None, 4), (None, 8)]


def test_reset_forgets_the_admitters():
    pool = BlockPool(4, BS, attribute_removals=True)
    pool.free_blocks(cache(pool, [41], "c1"))
    assert pool.reset_prefix_cache()
    assert pool._admitted == {}


def test_without_attribution_removals_are_vllms_own_on_the_wire():
    plain, labelled = BlockPool(4, BS), BlockPool(4, BS, attribute_removals=True)
    for pool in (plain, labelled):
        pool.free_blocks(cache(pool, [51], "c1"))
    [bare], [full] = evict_everything(plain), evict_everything(labelled)
    assert bare.continuation_id is None and bare.num_tokens is None
    encoder, decoder = EventBatchEncoder(), EventBatchDecoder()
    wire = encoder.encode(EventBatch(0.0, [bare], 0))
    assert b"num_tokens" not in wire and b"continuation_id" not in wire
    assert decoder.decode(encoder.encode(EventBatch(0.0, [full], 0))).events == [full]
