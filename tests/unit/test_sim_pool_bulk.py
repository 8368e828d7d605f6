"""The block pool's bulk paths (sim/pool_bulk.py): a pool with ``coalesce_removals`` hands out
the same blocks and leaves the policy's KV index in the same state as one without; a lookup
that starts from a session's previous blocks answers what the full lookup answers; a kept
lookup holds exactly while none of its blocks is evicted."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from scheduler.kv_events import BlockRemoved
from scheduler.kv_index import KVIndex
from sim.block_pool import BlockPool, PoolExhausted
from sim.engine import Engine, EngineRequest
from sim.step_time import StepTimeModel

SESSIONS = [f"s{k}" for k in range(4)]


def _index_state(index: KVIndex) -> tuple:
    """What the index knows of the worker (``events_seen`` counts events, which coalescing
    makes fewer; it is only ever compared with 0)."""
    kv = index.worker("w")
    return (set(kv.blocks), dict(kv.session_tokens), kv.shared_tokens, dict(kv.holes),
            {c: list(v) for c, v in kv.caps.items()}, kv.evicted_tokens, kv.unknown_removals,
            kv.attributed_removals, kv.events_seen > 0)


def _play(seed: int) -> None:
    """Random arrivals (prefix hits, duplicates, prefill-sized allocations), frees, retention
    and plain allocations on a plain and a coalescing pool side by side."""
    rng = random.Random(seed)
    num_blocks, block_size = rng.randint(20, 120), rng.choice([1, 4, 16])
    plain = BlockPool(num_blocks, block_size, attribute_removals=True)
    bulk = BlockPool(num_blocks, block_size, attribute_removals=True, coalesce_removals=True)
    indexes = {id(plain): KVIndex(), id(bulk): KVIndex()}
    live: list[tuple[list[int], str]] = []
    left: dict[str, tuple[list, np.ndarray, int]] = {}  # the engine's _left, for the bulk pool
    now = 0.0
    for _ in range(250):
        now += rng.random()
        op = rng.random()
        if op < 0.45:
            session = rng.choice(SESSIONS)
            hashes = [(rng.randrange(2), i) if i < 3 else (session, i) for i in range(rng.randint(1, 30))]
            if rng.random() < 0.1:
                hashes += hashes[:2]  # a hash twice
            limit = rng.randint(0, len(hashes))
            hit = plain.longest_hit(hashes, limit)
            if session in left:
                from_left, from_left_ids = bulk.longest_hit_from(hashes, limit, *left[session])
                assert from_left == hit and from_left_ids.tolist() == hit
            continuation = rng.choice([None, None, f"c{rng.randrange(3)}"])
            new = rng.randint(0, 24)
            blocks = {}
            for pool in (plain, bulk):
                pool.touch(hit)
                try:
                    blocks[id(pool)] = hit + pool.get_new_blocks(new, now)
                except PoolExhausted:
                    pool.free_blocks(hit[::-1], session)
            if blocks:
                assert blocks[id(plain)] == blocks[id(bulk)]
                got = blocks[id(plain)]
                full = max(len(hit), min(len(got), len(hashes)))
                for pool in (plain, bulk):
                    pool.cache_full_blocks(got, hashes, len(hit), full, session_id=session,
                                           continuation_id=continuation)
                live.append((got, session))
                left.pop(session, None)
        elif op < 0.75 and live:
            got, session = live.pop(rng.randrange(len(live)))
            for pool in (plain, bulk):
                pool.free_blocks(got[::-1], session)
            if len(set(got)) == len(got):
                cached = len([b for b in got if bulk.block_hash[b] is not None])
                hashes = [bulk.block_hash[b] for b in got[:cached]]
                if None not in hashes:
                    left[session] = (hashes, np.asarray(got[:cached], dtype=np.intp), bulk.eviction_mark())
        elif op < 0.83:
            session, priority, ttl = rng.choice(SESSIONS), rng.randint(1, 100), rng.random() * 3
            for pool in (plain, bulk):
                pool.retain(session, priority, ttl, now)
        elif op < 0.88:
            session = rng.choice(SESSIONS)
            for pool in (plain, bulk):
                pool.release(session)
        elif plain.num_free:
            n = rng.randint(1, plain.num_free)
            got = plain.get_new_blocks(n, now)
            assert bulk.get_new_blocks(n, now) == got
            live.append((got, rng.choice(SESSIONS)))
        assert plain.free_queue_order() == bulk.free_queue_order()
        assert plain.ref_cnt.tolist() == bulk.ref_cnt.tolist()
        assert {s: plain.session_block_ids(s) for s in SESSIONS} == {s: bulk.session_block_ids(s) for s in SESSIONS}
        plain_events, bulk_events = plain.take_events(), bulk.take_events()
        removed = [h for e in plain_events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert removed == [h for e in bulk_events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert len(bulk_events) <= len(plain_events)
        indexes[id(plain)].apply_events("w", plain_events)
        indexes[id(bulk)].apply_events("w", bulk_events)
        assert _index_state(indexes[id(plain)]) == _index_state(indexes[id(bulk)])


@pytest.mark.parametrize("seed", range(30))
def test_coalesced_removals_and_lookups_from_known_blocks_change_nothing(seed):
    _play(seed)


def test_many_unlabelled_evictions_make_one_event():
    pool = BlockPool(20, 4, attribute_removals=True, coalesce_removals=True)
    blocks = pool.get_new_blocks(19)
    pool.cache_full_blocks(blocks, list(range(100, 119)), 0, 19, session_id="s")
    pool.free_blocks(blocks[::-1], "s")
    pool.take_events()
    pool.get_new_blocks(10)
    [event] = pool.take_events()
    assert isinstance(event, BlockRemoved) and event.block_hashes == list(range(118, 108, -1))
    assert event.continuation_id is None


def test_a_kept_lookup_holds_until_one_of_its_blocks_is_evicted():
    pool = BlockPool(10, 4, coalesce_removals=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [1, 2, 3], 0, 3, session_id="s")
    pool.free_blocks(blocks[::-1], "s")
    mark = pool.eviction_mark()
    hit = np.asarray(pool.longest_hit([1, 2, 3]), dtype=np.intp)
    pool.get_new_blocks(6)  # the blocks never cached: nothing evicted
    assert pool.hit_holds(hit, mark)
    pool.get_new_blocks(1)  # the least recently used cached block: the chain's tail
    assert not pool.hit_holds(hit, mark)
    assert pool.longest_hit([1, 2, 3]) == blocks[:2]


def _agents(coalesce: bool, shortcut: bool) -> tuple[list, tuple, list]:
    """Six sessions of six calls each, every prompt its session's previous sequence and a bit
    more, on one engine whose pool holds about half of what they compute: what each call saw,
    the engine's counters and its KV events."""
    tiny = StepTimeModel(name="tiny", description="hand-made terms for tests", base_s=0.010,
                         prefill_token_s=1e-4, seq_s=1e-3, context_token_s=1e-5,
                         kv_capacity_tokens=240, block_size=4, max_num_seqs=4,
                         max_num_batched_tokens=64)
    engine = Engine("w", tiny, coalesce_removals=coalesce)
    pool = engine.pool
    if not shortcut:  # every lookup in full, none kept
        pool.longest_hit_from = lambda hashes, limit, *known: (  # type: ignore[method-assign]
            pool.longest_hit(hashes, limit), np.asarray(pool.longest_hit(hashes, limit), dtype=np.intp))
        pool.hit_holds = lambda hit_ids, mark: False  # type: ignore[method-assign]
    rng = random.Random(7)
    calls = {f"a{k}": 0 for k in range(6)}
    lengths = {session: rng.randint(8, 40) for session in calls}
    seen, events, now = [], [], 0.0

    def send(session: str, at: float) -> None:
        prompt = lengths[session]
        output = rng.randint(2, 12)
        family = [10_000 + i for i in range(4)]  # a prefix every session shares
        stream = family + [hash((session, i)) for i in range((prompt + output) // 4)]
        engine.add_request(EngineRequest(f"{session}#{calls[session]}", session,
                                         stream[:(prompt + output) // 4], prompt, output, 0.0, at), at)
        lengths[session] = prompt + output + rng.randint(1, 9)

    for session in calls:
        send(session, 0.0)
    while engine.has_work():
        end = engine.start(now)
        assert end is not None
        now = end
        for request in engine.complete():
            seen.append((request.request_id, request.cached_tokens, request.first_token_at,
                         request.finished_at, request.reprefill_tokens))
            calls[request.session_id] += 1
            if calls[request.session_id] < 6:
                send(request.session_id, now)
        events.append(engine.take_events())
    return seen, dataclasses.astuple(engine.stats), events


def test_an_engine_with_the_bulk_paths_runs_as_one_without():
    reference, stats, plain_events = _agents(coalesce=False, shortcut=False)
    for coalesce in (False, True):
        seen, got_stats, events = _agents(coalesce=coalesce, shortcut=True)
        assert (seen, got_stats) == (reference, stats)
        if not coalesce:
            assert events == plain_events
        plain, bulk = KVIndex(), KVIndex()
        for plain_batch, bulk_batch in zip(plain_events, events):
            plain.apply_events("w", plain_batch)
            bulk.apply_events("w", bulk_batch)
            assert _index_state(plain) == _index_state(bulk)
    assert any(isinstance(e, BlockRemoved) for batch in plain_events for e in batch)  # evictions
    assert sum(cached for _, cached, *_ in reference) > 0  # and hits


def test_a_duplicate_evicted_with_its_first_is_no_first_when_cached_again():
    pool = BlockPool(8, 4, coalesce_removals=True)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(first, [5], 0, 1)
    pool.cache_full_blocks(second, [5], 0, 1)  # a duplicate: lookups return ``first``
    pool.free_blocks(first)
    pool.free_blocks(second)
    pool.free_blocks(pool.get_new_blocks(7))  # both evicted in one batch
    blocks = [pool.get_new_blocks(1) for _ in range(7)]
    for got in blocks:
        pool.cache_full_blocks(got, [7], 0, 1)  # the first of them first, the rest duplicates
    mark = pool.eviction_mark()
    for got in blocks:
        hit, _ = pool.longest_hit_from([7], 1, [7], np.asarray(got, dtype=np.intp), mark)
        assert hit == pool.longest_hit([7]) == blocks[0]
