"""The engine model (sim/engine.py) against the rules in its docstring, and the step-time
model (sim/step_time.py).

Every scenario uses a tiny pool (block size 4, a handful of blocks) and a hand-made
step-time model, so each expected number can be worked out by hand; the comments say how.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from scheduler.kv_events import BlockRemoved, BlockStored
from sim.engine import Engine, EngineRequest
from sim.step_time import StepTimeModel, preset, presets

BS = 4

MODEL = StepTimeModel(
    name="tiny", description="hand-made terms for tests",
    base_s=0.010, prefill_token_s=1e-4, seq_s=1e-3, context_token_s=1e-5,
    kv_capacity_tokens=10_000, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64,
)


def model(**changes) -> StepTimeModel:
    return dataclasses.replace(MODEL, **changes)


def hashes_for(base: int, tokens: int) -> list[int]:
    """Full-block hashes of a ``tokens``-long sequence owned by ``base`` (1000·base + i)."""
    return [base * 1000 + i for i in range(tokens // BS)]


def req(rid: str, prompt: int, output: int, *, priority: float = 0.0, base: int | None = None,
        hashes: list[int] | None = None, session: str | None = None,
        continuation: str | None = None, arrival: float = 0.0) -> EngineRequest:
    if hashes is None:
        hashes = hashes_for(base if base is not None else sum(map(ord, rid)), prompt + output)
    return EngineRequest(rid, session if session is not None else f"s-{rid}", hashes, prompt, output,
                         priority, arrival, continuation_id=continuation)


def one_iteration(engine: Engine, now: float) -> float | None:
    end = engine.start(now)
    if end is not None:
        engine.complete()
    return end


def run_to_idle(engine: Engine, now: float = 0.0) -> float:
    while engine.has_work():
        end = one_iteration(engine, now)
        assert end is not None, "work left but nothing schedulable"
        now = end
    return now


def drive(engine: Engine, arrivals: list[tuple[float, EngineRequest]]) -> tuple[list, list]:
    """Play ``arrivals`` as the simulation does: an arrival while the engine is busy is
    queued at its own time (cutting a decode run); an idle engine starts at once. Returns
    every KV event in order and every ``free_blocks`` call as (session, ordered ids)."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    events: list = []
    frees: list[tuple[str | None, list[int]]] = []
    free_blocks = engine.pool.free_blocks

    def recording_free(ids, session_id=None):
        ids = list(ids)
        frees.append((session_id, ids))
        return free_blocks(ids, session_id)

    engine.pool.free_blocks = recording_free  # type: ignore[method-assign]
    now, i = 0.0, 0
    while True:
        if engine.idle:
            while i < len(arrivals) and arrivals[i][0] <= now:
                engine.add_request(arrivals[i][1], arrivals[i][0])
                i += 1
            end = engine.start(now)
            events += engine.pool.take_events()
            if end is None:
                if i == len(arrivals):
                    return events, frees
                now = arrivals[i][0]
                continue
        while i < len(arrivals) and arrivals[i][0] < engine.busy_until:
            engine.add_request(arrivals[i][1], arrivals[i][0])
            i += 1
        now = engine.busy_until
        engine.complete()
        events += engine.pool.take_events()


# -- chunked prefill and the token budget --------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks_of_max_num_batched_tokens():
    engine = Engine("w", model(max_num_batched_tokens=8), num_blocks=20)
    a = req("a", 20, 3)
    engine.add_request(a, 0.0)
    computed, outputs = [], []
    now = 0.0
    for _ in range(3):
        now = one_iteration(engine, now)
        computed.append(a.num_computed)
        outputs.append(a.num_output)
    assert computed == [8, 16, 20]
    # the first token is sampled only when the whole prompt is computed
    assert outputs == [0, 0, 1]
    assert a.first_token_at == pytest.approx(now)


def _prefill_step_durations(m: StepTimeModel, prompt: int) -> list[float]:
    """The durations of the steps that prefill one ``prompt``-token request, alone."""
    engine = Engine("w", m, num_blocks=20)
    a = req("a", prompt, 3)
    engine.add_request(a, 0.0)
    durations, now = [], 0.0
    while a.num_output == 0:
        end = one_iteration(engine, now)
        durations.append(end - now)
        now = end
    return durations


@pytest.mark.parametrize(("budget", "pairs"), [
    # one step: 20 new tokens over the 10 before each on average, 20·(0 + 20/2)
    (64, [20 * (0 + 20 / 2)]),
    # chunks of 8, 8, 4 behind 0, 8, 16 computed tokens: n·(c0 + n/2) each (summing to 200 too)
    (8, [8 * (0 + 8 / 2), 8 * (8 + 8 / 2), 4 * (16 + 4 / 2)]),
])
def test_prefill_attention_adds_its_pairs_to_each_prefill_step(budget, pairs):
    pair_s = 1e-6
    plain = _prefill_step_durations(model(max_num_batched_tokens=budget), 20)
    attending = _prefill_step_durations(model(max_num_batched_tokens=budget, prefill_attention_s=pair_s), 20)
    assert sum(pairs) == 20 * (20 - 20 / 2)  # chunked or not, a whole prompt's P·(C − P/2)
    assert len(plain) == len(attending) == len(pairs)
    assert [b - a for a, b in zip(plain, attending)] == pytest.approx([pair_s * p for p in pairs], rel=1e-9)


def test_a_decode_step_has_no_prefill_attention():
    plain, attending = Engine("w", MODEL, num_blocks=20), Engine("w", model(prefill_attention_s=1e-6), num_blocks=20)
    for engine in (plain, attending):
        engine.add_request(req("a", 8, 4), 0.0)
        one_iteration(engine, 0.0)  # the prefill
    decode = [engine.start(1.0, max_run_steps=1) for engine in (plain, attending)]
    assert decode[0] == decode[1]


def test_every_iteration_stays_within_the_token_budget_running_requests_first():
    engine = Engine("w", model(max_num_batched_tokens=8), num_blocks=30)
    a = req("a", 20, 2, priority=0.0)
    b = req("b", 5, 2, priority=1.0)
    engine.add_request(a, 0.0)
    engine.add_request(b, 0.0)
    now = 0.0
    history = []
    while engine.has_work():
        before = (a.num_computed, b.num_computed)
        now = one_iteration(engine, now)
        spent = (a.num_computed - before[0]) + (b.num_computed - before[1])
        assert spent <= 8
        history.append((a.num_computed, b.num_computed))
    # a takes the whole budget for two iterations; b is admitted into the 4 tokens left
    # after a's last chunk, and gets a chunk of 4 of its 5 prompt tokens
    assert history[:3] == [(8, 0), (16, 0), (20, 4)]


def test_max_num_seqs_caps_the_running_requests():
    engine = Engine("w", model(max_num_seqs=2), num_blocks=30)
    reqs = [req(r, 6, n) for r, n in (("a", 3), ("b", 9), ("c", 2))]
    for r in reqs:
        engine.add_request(r, 0.0)
    now = 0.0
    while engine.has_work():
        end = engine.start(now)
        assert len(engine.running) <= 2
        engine.complete()
        now = end
    a, b, c = reqs
    assert a.first_scheduled_at == b.first_scheduled_at == 0.0
    # c waits for a slot: it is first scheduled exactly when a (the shorter one) finishes
    assert c.first_scheduled_at == pytest.approx(a.finished_at)
    assert c.first_scheduled_at > 0
    assert all(r.finished for r in reqs)


# -- prefix caching -----------------------------------------------------------------------


def test_prefix_hit_reuses_the_cached_blocks_and_touches_them():
    engine = Engine("w", MODEL, num_blocks=20)
    shared = hashes_for(7, 16)  # 4 full blocks
    first = req("a", 16, 2, hashes=shared + [9001])
    engine.add_request(first, 0.0)
    now = run_to_idle(engine)
    cached_ids = [engine.pool.get_cached_block(h) for h in shared]
    assert None not in cached_ids and all(engine.pool.ref_cnt[b] == 0 for b in cached_ids)
    engine.pool.take_events()

    second = req("b", 22, 2, hashes=shared + hashes_for(8, 24)[4:])
    engine.add_request(second, now)
    engine.start(now)
    # admitted with the 4 cached blocks as the head of its block table, now referenced
    assert second.cached_tokens == 16
    assert second.num_computed == 16
    assert second.block_ids[:4] == cached_ids
    free = set(engine.pool.free_queue_order())
    for block_id in cached_ids:
        assert engine.pool.ref_cnt[block_id] == 1
        assert block_id not in free
    events = engine.pool.take_events()
    # nothing re-stored or evicted for the hit: only its own fifth block is new
    assert not any(isinstance(e, BlockRemoved) for e in events)
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == [second.hashes[4]]
    engine.complete()
    assert engine.stats.cached_tokens == 16
    assert engine.stats.computed_prefill_tokens == 16 + 6


def test_prefix_hit_is_capped_one_token_short_of_the_sequence():
    engine = Engine("w", MODEL, num_blocks=20)
    shared = hashes_for(7, 16)
    engine.add_request(req("a", 16, 4, hashes=shared + [9001]), 0.0)
    now = run_to_idle(engine)

    # the same 16-token prompt: all 4 blocks are cached, but at most (16 - 1) // 4 = 3 are
    # reused so that the last token is computed and a token can be sampled
    same = req("b", 16, 2, hashes=list(shared))
    engine.add_request(same, now)
    end = one_iteration(engine, now)
    assert same.cached_tokens == 12
    assert same.num_computed == 16 and same.num_output == 1
    now = run_to_idle(engine, end)

    # one token longer: the 4 blocks cover all but the last token, so all 4 are reused
    longer = req("c", 17, 2, hashes=list(shared))
    engine.add_request(longer, now)
    one_iteration(engine, now)
    assert longer.cached_tokens == 16
    assert longer.num_computed == 17 and longer.num_output == 1


def test_report_reuse_reports_a_hit_as_a_store_from_block_zero():
    engine = Engine("w", MODEL, num_blocks=20, report_reuse=True)
    shared = hashes_for(7, 16)
    engine.add_request(req("a", 16, 2, hashes=shared + [9001]), 0.0)
    now = run_to_idle(engine)
    engine.pool.take_events()
    engine.add_request(req("b", 17, 1, hashes=list(shared), session="s-b", continuation="cb"), now)
    engine.start(now)
    first = engine.pool.take_events()[0]
    assert isinstance(first, BlockStored)
    assert first.block_hashes == shared and first.parent_block_hash is None
    assert (first.session_id, first.continuation_id) == ("s-b", "cb")


def test_blocks_are_cached_as_soon_as_their_tokens_are_scheduled():
    engine = Engine("w", model(max_num_batched_tokens=8), num_blocks=20)
    a = req("a", 20, 2, session="sess", continuation="cont")
    engine.add_request(a, 0.0)
    h = a.hashes

    end = engine.start(0.0)
    # the first chunk (8 tokens) fills blocks 0 and 1: stored before the iteration ends
    [stored] = engine.pool.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [h[0], h[1]]
    assert stored.parent_block_hash is None
    assert (stored.session_id, stored.continuation_id) == ("sess", "cont")
    assert stored.block_size == BS
    engine.complete()

    engine.start(end)
    [stored] = engine.pool.take_events()
    assert stored.block_hashes == [h[2], h[3]]
    assert stored.parent_block_hash == h[1]
    assert (stored.session_id, stored.continuation_id) == ("sess", "cont")


def test_finished_request_frees_its_blocks_in_reverse_order():
    engine = Engine("w", MODEL, num_blocks=9)  # blocks 1..8
    # 10 prompt + 4 output = 14 tokens: 3 full blocks are cached; the last output token is
    # never computed, so the 4th block (tokens 12, 13) holds 1 computed token, no hash
    a = req("a", 10, 4)
    engine.add_request(a, 0.0)
    engine.start(0.0)
    ids_after_admission = list(a.block_ids)
    engine.complete()
    run_to_idle(engine)
    assert ids_after_admission == [1, 2, 3]
    # the 4th block (4) was allocated during decode; unhashed, it goes to the head; the
    # hashed ones to the tail in reverse, so the chain's tail (3) is evicted before its head
    assert engine.pool.free_queue_order() == [4, 5, 6, 7, 8, 3, 2, 1]
    assert [engine.pool.get_cached_block(x) for x in a.hashes] == [1, 2, 3]


def test_evicted_blocks_name_the_continuation_that_cached_them_and_their_prefix_length():
    engine = Engine("w", MODEL, num_blocks=5)  # blocks 1..4
    a = req("a", 10, 4, continuation="ca")    # 3 full blocks cached, the 4th unhashed
    engine.add_request(a, 0.0)
    now = run_to_idle(engine)
    engine.pool.take_events()
    engine.add_request(req("b", 10, 4, continuation="cb"), now)  # needs all 4 blocks
    run_to_idle(engine, now)
    removed = [e for e in engine.pool.take_events() if isinstance(e, BlockRemoved)]
    assert sorted((e.block_hashes[0], e.continuation_id, e.num_tokens) for e in removed) == [
        (h, "ca", (i + 1) * BS) for i, h in enumerate(a.hashes[:3])]


# -- recompute preemption -------------------------------------------------------------------


def _preemption_scenario(priority_b: float, priority_a: float):
    """Six usable blocks. b (arrives first) and a each have an 8-token prompt and 8 output
    tokens (4 blocks each at the end); c is a 3-token call that takes the second slot at
    first. b and a run together after c; when a needs its 4th block, none is free."""
    engine = Engine("w", model(max_num_seqs=2), num_blocks=7)
    b = req("b", 8, 8, priority=priority_b, base=100)
    a = req("a", 8, 8, priority=priority_a, base=200)
    c = req("c", 3, 1, priority=min(priority_a, priority_b) - 0.5, base=300)
    for r in (b, a, c):
        engine.add_request(r, 0.0)
    return engine, a, b, c


def test_pool_exhaustion_preempts_the_running_request_with_the_largest_priority_value():
    engine, a, b, c = _preemption_scenario(priority_b=1.0, priority_a=0.0)
    now = 0.0
    while engine.stats.preemptions == 0:
        now = one_iteration(engine, now)
    # b arrived first but has the larger priority value: it is the victim
    assert [r.request_id for r in engine.running] == ["a"]
    assert b.preemptions == 1 and a.preemptions == 0
    assert b.block_ids == [] and b.num_computed == 0
    assert [r for _, _, r in engine.waiting] == [b]
    run_to_idle(engine, now)
    assert a.finished_at < b.finished_at
    assert (a.num_output, b.num_output, c.num_output) == (8, 8, 1)


def test_preemption_between_equal_priorities_takes_the_latest_arrival():
    engine, a, b, c = _preemption_scenario(priority_b=1.0, priority_a=1.0)
    now = 0.0
    while engine.stats.preemptions == 0:
        now = one_iteration(engine, now)
    assert a.preemptions == 1 and b.preemptions == 0
    assert [r.request_id for r in engine.running] == ["b"]


def test_no_request_is_admitted_in_an_iteration_that_preempted():
    engine, a, b, c = _preemption_scenario(priority_b=1.0, priority_a=0.0)
    now = 0.0
    while not (a in engine.running and b in engine.running):
        now = one_iteration(engine, now)
    # d is first in line and needs one block, but both slots are taken
    d = req("d", 3, 1, priority=-5.0, base=400)
    engine.add_request(d, now)
    while True:
        end = engine.start(now)
        if engine.stats.preemptions:
            break
        engine.complete()
        now = end
    # b's blocks were freed and a slot opened, so d would fit; the preempting iteration
    # admits nobody
    assert engine.pool.num_free >= 1 and len(engine.running) < engine.max_num_seqs
    assert d not in engine.running and d.first_scheduled_at is None
    engine.complete()
    engine.start(end)
    assert d in engine.running and d.first_scheduled_at == pytest.approx(end)


def test_preempted_request_is_recomputed_and_its_lost_tokens_count_as_reprefill():
    engine, a, b, c = _preemption_scenario(priority_b=1.0, priority_a=0.0)
    computed_at_preemption = []
    preempt = engine._preempt

    def recording(request):
        computed_at_preemption.append((request.request_id, request.num_computed))
        preempt(request)

    engine._preempt = recording  # type: ignore[method-assign]
    run_to_idle(engine)
    # b had computed its 8 prompt tokens and 3 output tokens (positions 8..10; the 4th
    # sampled token was never computed) when a needed a block. Its full blocks 0 and 1
    # stayed cached; block 2 (3 tokens, not full) was lost. On readmission its sequence
    # is 12 tokens: 8 hit, 4 computed, of which 3 had been computed before.
    assert computed_at_preemption == [("b", 11)]
    assert b.finished and b.num_output == 8 and b.preemptions == 1
    assert b.reprefill_tokens == 3
    assert engine.stats.reprefill_tokens == 3
    assert engine.stats.preemptions == 1
    # hit rate counts first admissions only: b's first admission hit nothing
    assert b.cached_tokens == 0
    assert engine.stats.prompt_tokens == 8 + 8 + 3
    # computed prompt tokens: a 8, c 3, b 8 at first and 4 again after preemption
    assert engine.stats.computed_prefill_tokens == 8 + 3 + 8 + 4
    assert engine.stats.output_tokens == 8 + 8 + 1


def test_request_preempted_mid_prefill_counts_only_what_it_had_computed():
    # b's 40-token prompt is prefilled in chunks beside a's decode; the pool runs out while
    # b is still in its prompt. Counting b's whole sequence as "lost" would overstate it.
    engine = Engine("w", model(max_num_batched_tokens=8), num_blocks=11)  # 10 usable blocks
    a = req("a", 4, 30, priority=0.0, base=1)
    b = req("b", 36, 2, priority=1.0, base=2)
    seen = []
    preempt = engine._preempt

    def recording(request):
        seen.append((request.request_id, request.num_computed, request.seq_len))
        preempt(request)

    engine._preempt = recording  # type: ignore[method-assign]
    engine.add_request(a, 0.0)
    engine.add_request(b, 0.0)
    readmitted_with = None
    now = 0.0
    while engine.has_work():
        end = engine.start(now)
        if seen and readmitted_with is None and b in engine.running:
            readmitted_with = b.num_computed  # its cached prefix, before this chunk runs
        engine.complete()
        now = end
    [(rid, computed, seq_len)] = seen
    assert rid == "b" and computed < seq_len  # preempted inside its prompt
    assert b.finished and a.finished
    assert b.reprefill_tokens == max(0, computed - readmitted_with)
    assert b.reprefill_tokens < seq_len - readmitted_with


# -- the waiting queue ------------------------------------------------------------------------


def test_waiting_requests_run_lowest_priority_value_first_then_by_arrival():
    engine = Engine("w", model(max_num_seqs=1), num_blocks=30)
    arrivals = [req("p5", 4, 2, priority=5.0), req("p1", 4, 2, priority=1.0),
                req("p3a", 4, 2, priority=3.0), req("p3b", 4, 2, priority=3.0)]
    for r in arrivals:
        engine.add_request(r, 0.0)
    run_to_idle(engine)
    order = [r.request_id for r in sorted(arrivals, key=lambda r: r.first_scheduled_at)]
    assert order == ["p1", "p3a", "p3b", "p5"]
    assert [r.request_id for r in engine.finished] == order


# -- decode runs ----------------------------------------------------------------------------


def _single_steps(engine: Engine) -> Engine:
    engine._decode_run_length = lambda: (0, 0)  # type: ignore[method-assign]
    return engine


def _play(scenario, single: bool):
    engine, arrivals = scenario()
    if single:
        _single_steps(engine)
    events, frees = drive(engine, arrivals)
    return engine, [r for _, r in arrivals], events, frees


def _ample():
    engine = Engine("w", MODEL, num_blocks=200)
    return engine, [(0.0, req("a", 10, 60)), (0.0, req("b", 7, 45)), (0.0, req("c", 13, 80)),
                    (0.37, req("d", 5, 30))]


def _evicting():
    # Another session's finished work fills the cache first, so the decodes' new blocks
    # evict its blocks (BlockRemoved events) in the pool's order.
    engine = Engine("w", MODEL, num_blocks=40)
    return engine, [(0.0, req("old", 60, 40)), (2.0, req("a", 9, 50)), (2.0, req("b", 6, 70)),
                    (2.0, req("c", 14, 33)), (2.2, req("d", 3, 20))]


def _preempting():
    engine = Engine("w", MODEL, num_blocks=22)
    return engine, [(0.0, req("a", 8, 40, priority=0.0)), (0.0, req("b", 5, 45, priority=1.0)),
                    (0.0, req("c", 11, 25, priority=2.0)), (0.3, req("d", 6, 10, priority=0.5))]


def _one_short():
    # a 17-token prompt in chunks of 8: the second chunk ends one token short, so the
    # request enters a decode run before its first token is sampled
    engine = Engine("w", model(max_num_batched_tokens=8), num_blocks=40)
    return engine, [(0.0, req("a", 17, 40)), (0.05, req("b", 6, 30))]


def _with_token_ids():
    # requests that carry their token ids: every BlockStored carries its blocks' tokens
    if "token_ids" not in EngineRequest.__dataclass_fields__:
        pytest.skip("this engine has no token_ids")
    engine, arrivals = _evicting()
    for _, r in arrivals:
        r.token_ids = [(sum(map(ord, r.request_id)) * 131 + i) % 50_000
                       for i in range(r.prompt_tokens + r.output_tokens)]
    return engine, arrivals


@pytest.mark.parametrize("scenario", [_ample, _evicting, _preempting, _one_short, _with_token_ids],
                         ids=["ample-pool", "evicting", "preempting", "chunk-one-short", "token-ids"])
def test_decode_run_gives_the_same_result_as_single_steps(scenario):
    run_engine, run_reqs, run_events, run_frees = _play(scenario, single=False)
    step_engine, step_reqs, step_events, step_frees = _play(scenario, single=True)
    assert run_engine.stats.decode_runs > 0, "the scenario must take decode runs"
    assert step_engine.stats.decode_runs == 0
    assert run_engine.stats.steps == step_engine.stats.steps
    for r, s in zip(run_reqs, step_reqs):
        assert r.finished and s.finished
        assert r.num_output == s.num_output == r.output_tokens
        assert r.finished_at == pytest.approx(s.finished_at, rel=1e-9)
        assert r.first_token_at == pytest.approx(s.first_token_at, rel=1e-9)
        assert r.first_scheduled_at == pytest.approx(s.first_scheduled_at, rel=1e-9)
        assert (r.preemptions, r.reprefill_tokens, r.cached_tokens) == \
            (s.preemptions, s.reprefill_tokens, s.cached_tokens)
    # the same KV events in the same order, and the same block ids per request
    assert run_events == step_events
    assert run_frees == step_frees
    assert run_engine.pool.free_queue_order() == step_engine.pool.free_queue_order()
    assert run_engine.pool.block_hash == step_engine.pool.block_hash
    assert run_engine.stats.busy_s == pytest.approx(step_engine.stats.busy_s, rel=1e-9)
    rs, ss = dataclasses.asdict(run_engine.stats), dataclasses.asdict(step_engine.stats)
    for key in ("steps", "decode_runs", "busy_s"):
        rs.pop(key), ss.pop(key)
    assert rs == ss


def test_scenarios_exercise_what_they_claim():
    _, _, events, _ = _play(_evicting, single=False)
    assert any(isinstance(e, BlockRemoved) for e in events)
    engine, _, _, _ = _play(_preempting, single=False)
    assert engine.stats.preemptions > 0
    engine, _, _, _ = _play(_one_short, single=False)
    assert engine.stats.decode_runs > 0
    if "token_ids" in EngineRequest.__dataclass_fields__:
        _, reqs, events, _ = _play(_with_token_ids, single=False)
        by_hash = {h: r for r in reqs for h in r.hashes}
        stores = [e for e in events if isinstance(e, BlockStored)]
        assert stores and all(len(e.token_ids) == BS * len(e.block_hashes) for e in stores)
        for e in stores:
            r = by_hash[e.block_hashes[0]]
            first = r.hashes.index(e.block_hashes[0])
            assert e.token_ids == list(r.token_ids[first * BS:(first + len(e.block_hashes)) * BS])


def test_decode_run_covers_many_steps_in_one_iteration():
    engine = Engine("w", MODEL, num_blocks=200)
    a = req("a", 8, 100)
    engine.add_request(a, 0.0)
    t1 = one_iteration(engine, 0.0)  # prefill, first token
    end = engine.start(t1)
    assert engine._run is not None and engine._run.steps == 99
    assert end == pytest.approx(t1 + MODEL.decode_run_s(1, 9, 99))
    engine.complete()
    assert a.finished and a.finished_at == pytest.approx(end)


@pytest.mark.parametrize("k,where", [(1, 0.0), (1, 0.5), (11, 0.5), (11, 1.0), (198, 0.5)])
def test_arrival_during_a_decode_run_cuts_it_at_the_next_step_boundary(k, where):
    """The arrival falls ``where`` of the way through step ``k`` of a 199-step run (1.0:
    exactly on its end boundary); the run then ends after step ``k``."""
    engine = Engine("w", MODEL, num_blocks=200)
    a = req("a", 8, 200)
    engine.add_request(a, 0.0)
    t1 = one_iteration(engine, 0.0)  # prefill and first token
    planned_end = engine.start(t1)
    assert engine._run.steps == 199
    context = 9  # a's 8 computed prompt tokens + the token it decodes

    def boundary(steps: int) -> float:
        return t1 + MODEL.decode_run_s(1, context, steps)

    arrival = boundary(k - 1) + where * (boundary(k) - boundary(k - 1))
    b = req("b", 4, 3)
    engine.add_request(b, arrival)
    assert engine._run.steps == k
    assert engine.busy_until == pytest.approx(boundary(k))
    assert engine.busy_until < planned_end
    assert engine.busy_until >= arrival or engine.busy_until == pytest.approx(arrival)
    engine.complete()
    assert a.num_output == 1 + k and a.num_computed == 8 + k
    engine.start(boundary(k))
    assert b in engine.running and b.first_scheduled_at == pytest.approx(boundary(k))


def test_arrival_that_cannot_be_admitted_does_not_change_the_outcome():
    # a full slot table: the arrival cuts the run but the next run picks up where it was
    def scenario():
        engine = Engine("w", model(max_num_seqs=1), num_blocks=200)
        return engine, [(0.0, req("a", 8, 100)), (0.2, req("b", 4, 3))]

    run = _play(scenario, single=False)
    step = _play(scenario, single=True)
    for r, s in zip(run[1], step[1]):
        assert r.finished_at == pytest.approx(s.finished_at, rel=1e-9)
    assert run[2] == step[2]


# -- admission limits ---------------------------------------------------------------------


def test_add_request_rejects_a_request_larger_than_the_whole_pool():
    engine = Engine("w", MODEL, num_blocks=5)  # 4 usable blocks of 4 = 16 tokens
    assert engine.capacity_tokens == 16
    with pytest.raises(ValueError, match=r"needs 17 tokens of KV, more than the whole pool \(16\)") as err:
        engine.add_request(req("big", 15, 2), 0.0)
    assert "big" in str(err.value) and "w" in str(err.value)
    assert not engine.waiting
    fits = req("fits", 14, 2)
    engine.add_request(fits, 0.0)
    run_to_idle(engine)
    assert fits.finished


def test_pool_defaults_to_the_model_kv_capacity():
    engine = Engine("w", model(kv_capacity_tokens=1000))
    assert engine.block_size == BS
    assert engine.capacity_tokens == 1000


# -- step time ----------------------------------------------------------------------------

@pytest.mark.parametrize("seqs,context,steps", [(1, 0, 1), (1, 9, 37), (5, 1234, 200), (64, 50_000, 3)])
def test_decode_run_s_is_the_sum_of_its_steps(seqs, context, steps):
    for m in [MODEL, *presets().values()]:
        total = sum(m.step_s(0, seqs, context + seqs * i) for i in range(steps))
        assert m.decode_run_s(seqs, context, steps) == pytest.approx(total, rel=1e-12)


@pytest.mark.parametrize("seqs,context", [(1, 9), (7, 3000), (200, 400_000)])
def test_decode_steps_within_returns_the_fewest_steps_reaching_the_time(seqs, context):
    for m in [MODEL, *presets().values()]:
        step = m.decode_run_s(seqs, context, 1)
        for seconds in (step * 0.5, step, step * 1.0001, step * 7.3, step * 1000.1,
                        m.decode_run_s(seqs, context, 513)):
            k = m.decode_steps_within(seqs, context, seconds)
            assert m.decode_run_s(seqs, context, k) >= seconds
            assert k == 1 or m.decode_run_s(seqs, context, k - 1) < seconds
        assert m.decode_steps_within(seqs, context, m.decode_run_s(seqs, context, 513)) == 513
        assert m.decode_steps_within(seqs, context, 0.0) == 1
        assert m.decode_steps_within(seqs, context, -1.0) == 1


def test_every_preset_builds_with_positive_terms():
    table = presets()
    assert len(table) >= 4
    for name, m in table.items():
        assert m.name == name and m.description
        for term in (m.base_s, m.prefill_token_s, m.seq_s, m.context_token_s):
            assert term > 0 and math.isfinite(term)
        assert m.kv_capacity_tokens > 0 and m.block_size > 0
        assert m.max_num_seqs > 0 and m.max_num_batched_tokens > 0
        assert preset(name) == m
        # a small decode step is milliseconds, not seconds or microseconds
        assert 1e-3 < m.step_s(0, 1, 1000) < 0.1
        # no datasheet gives prefill attention's efficiency: only a measured preset has the term
        assert m.prefill_attention_s == 0.0


def test_step_s_adds_prefill_attention_per_pair():
    m = model(prefill_attention_s=2e-7)
    plain = m.step_s(100, 2, 600)
    assert plain == MODEL.step_s(100, 2, 600)  # no pairs given: no attention
    assert m.step_s(100, 2, 600, prefill_pairs=45_000) == pytest.approx(plain + 2e-7 * 45_000, rel=1e-12)
    # a zero coefficient adds exactly nothing, whatever the pairs
    assert MODEL.step_s(100, 2, 600, prefill_pairs=45_000) == MODEL.step_s(100, 2, 600)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="unknown preset 'nope'") as err:
        preset("nope")
    for name in presets():
        assert name in str(err.value)


# -- the scheduling policy (vLLM's --scheduling-policy) ------------------------------------


def _first_admitted(engine: Engine, requests: list[EngineRequest]) -> list[str]:
    for r in requests:
        engine.add_request(r, 0.0)
    run_to_idle(engine)
    return [r.request_id for r in sorted(requests, key=lambda r: (r.first_scheduled_at, r.order))]


def test_priority_scheduling_admits_the_lowest_priority_value_first():
    # one sequence at a time: the admission order is the queue order
    engine = Engine("w", model(max_num_seqs=1), num_blocks=30, scheduling_policy="priority")
    reqs = [req("late", 4, 1, priority=5.0), req("soon", 4, 1, priority=-1.0),
            req("mid", 4, 1, priority=2.0)]
    assert _first_admitted(engine, reqs) == ["soon", "mid", "late"]


def test_fcfs_scheduling_ignores_priority_and_admits_by_arrival():
    engine = Engine("w", model(max_num_seqs=1), num_blocks=30, scheduling_policy="fcfs")
    reqs = [req("late", 4, 1, priority=5.0), req("soon", 4, 1, priority=-1.0),
            req("mid", 4, 1, priority=2.0)]
    assert _first_admitted(engine, reqs) == ["late", "soon", "mid"]


def test_fcfs_preempts_the_last_admitted_and_priority_the_largest_priority_value():
    # 5 usable blocks of 4 tokens; two requests of 8 + 4 tokens each fill them and then need
    # one more block each: one must be preempted
    for policy, preempted in (("fcfs", "second"), ("priority", "first")):
        engine = Engine("w", MODEL, num_blocks=6, scheduling_policy=policy)
        first, second = req("first", 8, 5, priority=9.0), req("second", 8, 5, priority=1.0)
        engine.add_request(first, 0.0)
        engine.add_request(second, 0.0)
        run_to_idle(engine)
        assert {r.request_id: r.preemptions > 0 for r in (first, second)} == {
            "first": preempted == "first", "second": preempted == "second"}, policy


def test_an_unknown_scheduling_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="fcfs, priority"):
        Engine("w", MODEL, num_blocks=6, scheduling_policy="lifo")
