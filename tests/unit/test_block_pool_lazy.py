"""The block pool's lazy free queues (sim/block_pool.py ``_FreeQueue``): what the pool hands out
and reports must not depend on when stale entries are dropped, and blocks named twice in a hit
or a free behave as they would one by one."""

from __future__ import annotations

import random

import pytest

from sim import block_pool
from sim.block_pool import BlockPool, PoolExhausted


def _play(seed: int) -> list:
    """A random sequence of arrivals (prefix hits), frees, retention and plain allocations;
    everything observable after each op."""
    rng = random.Random(seed)
    pool = BlockPool(rng.randint(6, 50), rng.choice([1, 4, 16]), attribute_removals=True)
    sessions = [f"s{k}" for k in range(4)]
    live: list[tuple[list[int], str]] = []
    seen = []
    now = 0.0
    for _ in range(300):
        now += rng.random()
        op = rng.random()
        if op < 0.4:
            session = rng.choice(sessions)
            hashes = [(rng.randrange(2), i) if i < 2 else (session, i) for i in range(rng.randint(1, 10))]
            if rng.random() < 0.1:
                hashes += hashes[:2]  # a hash twice: its block is hit twice
            hit = pool.longest_hit(hashes, rng.randint(0, len(hashes)))
            pool.touch(hit)
            try:
                blocks = hit + pool.get_new_blocks(rng.randint(0, 8), now)
            except PoolExhausted:
                pool.free_blocks(hit[::-1], session)
                seen.append("exhausted")
            else:
                pool.cache_full_blocks(blocks, hashes, len(hit), max(len(hit), min(len(blocks), len(hashes))),
                                       session_id=session)
                live.append((blocks, session))
        elif op < 0.7 and live:
            blocks, session = live.pop(rng.randrange(len(live)))
            pool.free_blocks(blocks[::-1], session)
        elif op < 0.8:
            pool.retain(rng.choice(sessions), rng.randint(1, 100), rng.random() * 3, now)
        elif op < 0.85:
            pool.demote(rng.choice(sessions))
        elif op < 0.9:
            pool.release(rng.choice(sessions))
        elif pool.num_free:
            live.append((pool.get_new_blocks(rng.randint(1, pool.num_free), now), rng.choice(sessions)))
        seen.append((pool.num_free, pool.free_queue_order(), pool.ref_cnt.tolist(),
                     {s: pool.session_block_ids(s) for s in sessions}, pool.take_events()))
    return seen


@pytest.mark.parametrize("seed", range(25))
def test_dropping_stale_entries_at_any_time_changes_nothing(seed, monkeypatch):
    lazy = _play(seed)
    monkeypatch.setattr(block_pool, "QUEUE_SLACK", 0)
    monkeypatch.setattr(block_pool, "QUEUE_MIN", 0)  # drop them at every free
    assert _play(seed) == lazy


def test_a_block_hit_twice_is_taken_once_and_freed_where_its_count_reaches_zero():
    pool = BlockPool(10, 2)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, ["a", "b", "c", "d"], 0, 3, session_id="s")
    pool.free_blocks(blocks[::-1], "s")
    hit = pool.longest_hit(["a", "b", "a"], 3)
    assert hit == [1, 2, 1]
    pool.touch(hit)
    assert pool.num_free == 7 and pool.ref_cnt[1] == 2
    assert pool.free_queue_order() == [4, 5, 6, 7, 8, 9, 3]
    pool.free_blocks(hit[::-1], "t")  # 1, 2, 1: block 1 is freed at its second naming
    assert pool.num_free == 9
    assert pool.free_queue_order() == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert pool.session_block_ids("t") == [2, 1]


def test_freeing_a_block_more_often_than_it_was_taken_fails():
    pool = BlockPool(4, 1)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks(blocks + blocks[:1])
