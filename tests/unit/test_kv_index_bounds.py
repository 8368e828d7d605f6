"""The KV index's bound per worker (scheduler/kv_index.py, "Bound"): once a worker's capacity is
known, neither side of its index holds more than a multiple of the blocks that capacity makes,
whatever the events say; the oldest stored blocks go first, counted, never as evictions; a
well-behaved stream is not changed by it at all.
"""

from __future__ import annotations

from bench.kv_ingest import build_stream
from scheduler.kv_events import BlockRemoved, BlockStored, EventBatch, EventBatchDecoder
from scheduler.kv_index import (
    BOUND_BLOCK_TOKENS,
    GPU_BOUND_FACTOR,
    HOST_BOUND_FACTOR,
    KVIndex,
    WorkerKV,
)

BS = 16
POOL_BLOCKS = 26_600  # the worker the forged flood was measured on
CAPACITY = POOL_BLOCKS * BS


def stored(hashes, session=None, parent=None, block_size=BS, token_ids=None, continuation=None,
           medium="GPU") -> BlockStored:
    ids = list(range(len(hashes) * block_size)) if token_ids is None else token_ids
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=ids,
                       block_size=block_size, lora_id=None, medium=medium, lora_name=None,
                       session_id=session, continuation_id=continuation)


def batch(*events) -> EventBatch:
    return EventBatch(0.0, list(events))


def state(kv: WorkerKV) -> dict:
    """Everything a query can read, and the bookkeeping behind it."""
    return {
        "blocks": {h: (b.parent, b.tokens, b.prefix_tokens, b.admitter, b.continuation,
                       tuple(b.sessions), b.children) for h, b in kv.blocks.items()},
        "session_tokens": dict(kv.session_tokens),
        "shared_tokens": kv.shared_tokens,
        "holes": dict(kv.holes),
        "caps": {c: list(v) for c, v in kv.caps.items()},
        "evicted_tokens": kv.evicted_tokens,
        "unknown_removals": kv.unknown_removals,
    }


def assert_consistent(kv: WorkerKV) -> None:
    """The index's invariants, recounted from its blocks (WorkerKV's invariants 1-4)."""
    sessions: dict[str, int] = {}
    zero: dict[str, int] = {}
    for block in kv.blocks.values():
        for session in block.sessions:
            sessions[session] = sessions.get(session, 0) + block.tokens
            if not block.tokens:
                zero[session] = zero.get(session, 0) + 1
    assert kv.session_tokens == sessions  # a session of zero-token blocks only included
    assert kv._zero_blocks == zero
    for session, owned in kv.shared_blocks.items():
        assert set(owned) == {h for h, b in kv.blocks.items() if session in b.sessions
                              and len(b.sessions) > 1}
    for cid, labelled in kv.continuation_blocks.items():
        assert set(labelled) == {h for h, b in kv.blocks.items() if b.continuation == cid}
    children: dict = {}
    for block in kv.blocks.values():
        if block.parent is not None:
            children[block.parent] = children.get(block.parent, 0) + 1
    for parent, n in children.items():
        held = kv.blocks[parent].children if parent in kv.blocks else (
            kv.holes.get(parent, 0) + kv._orphans.get(parent, 0))
        assert held == n, parent
    shared = sum(b.tokens * max(0, b.counted - 1) for b in kv.blocks.values() if len(b.sessions) > 1)
    assert kv.shared_tokens == shared


# -- forged floods ---------------------------------------------------------------------------


def test_a_forged_flood_is_held_to_the_bound_oldest_first_and_counted():
    index = KVIndex()
    index.set_capacity("w", CAPACITY)
    kv = index.worker("w")
    bound = GPU_BOUND_FACTOR * POOL_BLOCKS
    assert kv.max_blocks == bound
    # the worker's own blocks first, then 300,000 forged ones in chains of 1,000
    index.apply_batch("w", batch(stored(range(1, POOL_BLOCKS + 1), session="real")))
    forged = 300_000
    for start in range(10**9, 10**9 + forged, 1_000):
        index.apply_batch("w", batch(stored(range(start, start + 1_000), session=f"f{start}",
                                            parent=start - 1 if start > 10**9 else None)))
        assert len(kv.blocks) <= bound
    assert kv.overflow_dropped == POOL_BLOCKS + forged - len(kv.blocks)
    assert 10**9 + forged - 1 in kv.blocks  # the newest stays
    assert 1 not in kv.blocks and "real" not in kv.session_tokens  # the oldest went first
    assert kv.evicted_tokens == 0 and kv.unknown_removals == 0  # not the engine's evictions
    assert_consistent(kv)


def test_blocks_claiming_no_tokens_cannot_stretch_the_bound():
    index = KVIndex()
    index.set_capacity("w", CAPACITY)
    kv = index.worker("w")
    # block_size 0, and one token id for a thousand blocks: each block counts no token
    for start in range(0, 200_000, 1_000):
        index.apply_batch("w", batch(stored(range(start, start + 1_000), block_size=0, token_ids=[])))
        index.apply_batch("w", batch(stored(range(10**7 + start, 10**7 + start + 1_000),
                                            token_ids=[5])))
    assert len(kv.blocks) <= GPU_BOUND_FACTOR * -(-CAPACITY // BOUND_BLOCK_TOKENS)
    assert kv.overflow_dropped == 400_000 - len(kv.blocks)
    assert_consistent(kv)


def test_one_event_larger_than_the_bound_never_holds_more_than_a_part_over_it():
    index = KVIndex()
    index.set_capacity("w", 100 * BS)  # 400 blocks
    kv = index.worker("w")
    bound = kv.max_blocks
    assert bound == 400

    class Watched(dict):
        """The index's block map, remembering the most blocks it ever held."""
        peak = 0

        def __setitem__(self, key, value):
            super().__setitem__(key, value)
            Watched.peak = max(Watched.peak, len(self))

    kv.blocks = Watched()
    index.apply_batch("w", batch(stored(range(1, 10_001), session="s", continuation="c")))
    assert Watched.peak <= bound + bound // 8
    assert len(kv.blocks) <= bound and kv.overflow_dropped == 10_000 - len(kv.blocks)
    # the newest part of the chain, its positions running on as in one store
    last = kv.blocks[10_000]
    assert last.parent == 9_999 and last.prefix_tokens == 10_000 * BS
    assert kv.session_tokens == {"s": len(kv.blocks) * BS}
    assert_consistent(kv)


def test_a_chain_whose_head_was_dropped_is_cut_off_not_counted_past_it():
    index = KVIndex()
    index.set_capacity("w", 100 * BS)  # 400 blocks
    kv = index.worker("w")
    index.apply_batch("w", batch(stored(range(1, 101), session="a", continuation="a1")))
    assert kv.continuation_tokens(["a1"]) == 100 * BS
    # a later chain of 301 blocks takes the index over 400: the oldest go, down to 350 (a's
    # first 51), and a's tail stays resident without its head
    index.apply_batch("w", batch(stored(range(1_000, 1_301), session="b", continuation="b1")))
    assert kv.overflow_dropped == 51
    assert 51 not in kv.blocks and 52 in kv.blocks and 100 in kv.blocks
    assert kv.continuation_tokens(["a1"]) == 0  # its prefix is no longer whole: under, not over
    assert kv.continuation_tokens(["b1"]) == 301 * BS
    assert_consistent(kv)


def test_the_host_tier_is_bounded_too():
    index = KVIndex()
    index.set_capacity("w", 1_000 * BS)
    host_bound = HOST_BOUND_FACTOR * 1_000
    flood = host_bound + 6_000
    for start in range(0, flood, 2_000):
        index.apply_batch("w", batch(stored(range(start, start + 2_000), session="x", medium="CPU")))
        assert len(index.host("w").blocks) <= host_bound  # after every event
    host = index.host("w")
    assert host.max_blocks == host_bound
    assert len(host.blocks) <= host_bound
    assert host.overflow_dropped == flood - len(host.blocks)
    assert flood - 1 in host.blocks and 0 not in host.blocks
    assert index.host_tokens("w", "x") == len(host.blocks) * BS
    assert index.worker("w").blocks == {}  # the GPU side holds none of it


# -- what the bound leaves alone --------------------------------------------------------------


def test_a_well_behaved_stream_is_not_changed_by_the_bound():
    """The benchmark's stream (full pools, FIFO eviction, "full"-mode re-reports of resident
    prefixes, chained prefills of up to 32 blocks) through an index bounded by the pool's own
    capacity and through an unbounded one: the same index, nothing dropped."""
    pool = 3_000
    fill, _, steady = build_stream(seed=5, workers=2, batches=3_000, pool_blocks=pool, sessions=40)
    bounded, unbounded = KVIndex(), KVIndex()
    for worker in ("w0", "w1"):
        bounded.set_capacity(worker, pool * BS)
    decoder = EventBatchDecoder()
    for worker, payload in fill + steady:
        decoded = decoder.decode(payload)
        bounded.apply_batch(worker, decoded)
        unbounded.apply_batch(worker, decoded)
    for worker in ("w0", "w1"):
        kv = bounded.worker(worker)
        assert kv.overflow_dropped == 0
        assert state(kv) == state(unbounded.worker(worker))
        assert pool <= len(kv.blocks) <= pool + 32  # a full pool (a step may overshoot it)


def test_a_store_split_into_parts_equals_one_store():
    """A prefill of more blocks than a part (an eighth of the bound), well within the bound:
    stored in parts, it leaves the index exactly as one store would."""
    bounded, unbounded = KVIndex(), KVIndex()
    bounded.set_capacity("w", 2_000 * BS)  # 8,000 blocks, parts of 1,000
    events = [stored(range(1, 101), session="a", continuation="a1"),
              stored(range(101, 5_101), session="a", parent=100, continuation="a2",
                     token_ids=list(range(5_000 * BS - 7))),  # a last block short of full
              stored(range(1, 3_001), session="b", continuation="b1")]  # a re-report from 0
    for index in (bounded, unbounded):
        kv = index.worker("w")
        kv.set_counted("a", True)
        kv.set_counted("b", True)
        for event in events:
            index.apply_batch("w", batch(event))
    kv = bounded.worker("w")
    assert kv.overflow_dropped == 0
    assert state(kv) == state(unbounded.worker("w"))
    assert kv.continuation_tokens(["a2"]) == 5_100 * BS - 7
    assert kv.shared_tokens == 3_000 * BS
    assert_consistent(kv)


def test_lowering_the_capacity_sheds_at_once_and_the_bound_outlives_resets_not_the_worker():
    index = KVIndex()
    index.apply_batch("w", batch(stored(range(10_000), session="s")))
    kv = index.worker("w")
    assert kv.max_blocks is None and len(kv.blocks) == 10_000  # unknown capacity: unbounded
    index.set_capacity("w", 1_000 * BS)
    assert len(kv.blocks) <= 4_000 and kv.overflow_dropped == 10_000 - len(kv.blocks)
    assert_consistent(kv)
    index.reset_worker("w")
    assert kv.max_blocks == 4_000 and kv.overflow_dropped > 0  # a counter: survives resets
    index.apply_batch("w", batch(stored(range(20_000, 30_000))))
    assert len(kv.blocks) <= 4_000
    index.drop_worker("w")
    fresh = index.worker("w")  # back in the fleet before its capacity is known again
    assert fresh.max_blocks is None
    index.apply_batch("w", batch(stored(range(10_000))))
    assert len(fresh.blocks) == 10_000


def test_removals_of_dropped_blocks_count_as_unknown_like_any_hash_the_index_lost():
    index = KVIndex()
    index.set_capacity("w", 100 * BS)
    index.apply_batch("w", batch(stored(range(1, 501), session="s")))
    kv = index.worker("w")
    dropped = kv.overflow_dropped
    assert dropped >= 100
    index.apply_batch("w", batch(BlockRemoved(block_hashes=[1], medium="GPU")))
    assert kv.unknown_removals == 1 and kv.evicted_tokens == 0
    index.apply_batch("w", batch(BlockRemoved(block_hashes=[500], medium="GPU")))
    assert kv.evicted_tokens == BS
    assert_consistent(kv)


def test_the_bound_counts_in_the_engines_block_size_when_given():
    """A pool of 4-token blocks full to its capacity: counted in the default 16-token blocks the
    bound would be its very size; told the block size, it keeps the usual margin."""
    pool = 1_000
    exact, default = KVIndex(), KVIndex()
    exact.set_capacity("w", pool * 4, block_size=4)
    default.set_capacity("w", pool * 4)
    assert exact.worker("w").max_blocks == GPU_BOUND_FACTOR * pool
    assert default.worker("w").max_blocks == GPU_BOUND_FACTOR * pool // 4
    for index in (exact, default):
        index.apply_batch("w", batch(stored(range(pool), session="s", block_size=4)))
        assert index.worker("w").overflow_dropped == 0
    exact.apply_batch("w", batch(stored(range(pool, 2 * pool), block_size=4)))  # twice the pool
    assert exact.worker("w").overflow_dropped == 0
