"""The offline shell (sim/simulation.py): feeds, the event loop, KV events into the policy's
index, retention directives into the engines' pools, determinism and the summary schema.

Programs are small synthetic :class:`ProgramSpec` objects on tiny pools (block size 4, a
few dozen blocks) and a hand-made step-time model, so a run takes milliseconds.
"""

from __future__ import annotations

import dataclasses
import io
from collections import Counter

import numpy as np
import pytest

from scheduler.actions import Action, Demote, Release, Retain
from scheduler.config import ProgramAwareConfig, RouterConfig
from scheduler.kv_events import BlockRemoved
from scheduler.policies import make_policy
from scheduler.policies.routing import RoundRobinPolicy
from sim.feeds import Batches, ClosedLoop, ConversationLoop, OpenLoop
from sim.programs import CallSpec, ProgramSpec
from sim.report import Progress
from sim.simulation import Simulation, start_wait_by_size
from sim.step_time import StepTimeModel

BS = 4

MODEL = StepTimeModel(
    name="tiny", description="hand-made terms for tests",
    base_s=0.010, prefill_token_s=1e-4, seq_s=1e-3, context_token_s=1e-5,
    kv_capacity_tokens=10_000, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64,
)

SUMMARY_KEYS = {"policy", "output_tokens_per_s", "steps_per_min", "hit_rate", "reprefill_tokens",
                "p50_call_s", "p99_call_s", "pauses", "resumes"}


def program(index: int, turns: int = 3, *, first_prompt: int = 10, output: int = 5,
            observation: int = 7, think_s: float = 0.5, start_at: float = 0.0,
            session: str | None = None) -> ProgramSpec:
    """A growing-context program; no prompt is a whole number of blocks, so a prompt's
    full blocks are always all reusable (the one-token-short cap never re-computes a
    cached block) and the pool never holds two copies of a hash."""
    calls, prompt = [], first_prompt
    for turn in range(turns):
        if prompt % BS == 0:
            prompt += 1
        calls.append(CallSpec(prompt, output + (index + turn) % 3, think_s=0.0 if turn == 0 else think_s))
        prompt += calls[-1].output_tokens + observation
    return ProgramSpec(session or f"p{index}", calls, index, start_at=start_at)


def simulation(policy, feed, *, workers=1, num_blocks=64, duration_s=60.0, **kwargs) -> Simulation:
    if isinstance(policy, str):
        policy = make_policy(name=policy)
    return Simulation(policy, feed, workers=workers, model=MODEL, duration_s=duration_s,
                      block_size=BS, num_blocks=num_blocks, **kwargs)


class Recorder:
    """Wraps a feed's ``on_program_end`` and a policy's arrival/completion hooks to see
    what the simulation did, without changing it."""

    def __init__(self, sim: Simulation) -> None:
        self.ends: list[tuple[str, float]] = []
        self.arrivals: dict[str, float] = {}
        self.completions: list[tuple[str, float, int, int]] = []  # id, time, prompt, cached
        self.kv_batches = 0
        self.removed = 0
        feed, policy = sim.feed, sim.policy
        on_end, on_arrival, on_complete, observe_kv = (
            feed.on_program_end, policy.on_arrival, policy.on_complete, policy.observe_kv)

        def end(spec, now):
            self.ends.append((spec.session_id, now))
            return on_end(spec, now)

        def arrival(request, now):
            assert request.request_id not in self.arrivals, "a call arrived twice"
            self.arrivals[request.request_id] = now
            return on_arrival(request, now)

        def complete(request_id, usage, now):
            self.completions.append((request_id, now, usage.prompt_tokens, usage.cached_tokens))
            return on_complete(request_id, usage, now)

        def observe(worker, batch):
            self.kv_batches += 1
            self.removed += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockRemoved))
            return observe_kv(worker, batch)

        feed.on_program_end = end
        policy.on_arrival = arrival
        policy.on_complete = complete
        policy.observe_kv = observe


# -- feeds ----------------------------------------------------------------------------------


def test_closed_loop_keeps_concurrency_programs_alive():
    made: list[ProgramSpec] = []

    def make(i: int) -> ProgramSpec:
        spec = program(i, turns=2 + i % 3, think_s=0.3 + 0.1 * (i % 4))
        made.append(spec)
        return spec

    sim = simulation("least_loaded", ClosedLoop(make, concurrency=3, ramp_s=0.0), workers=2,
                     duration_s=20.0)
    rec = Recorder(sim)
    result = sim.run()
    assert result.programs_completed == len(rec.ends) >= 10
    # one new program per ended one, started at the very moment the other ended
    assert len(made) == 3 + len(rec.ends)
    assert [spec.start_at for spec in made[3:]] == [t for _, t in rec.ends]
    assert [spec.start_at for spec in made[:3]] == [0.0, 0.0, 0.0]
    ended = dict(rec.ends)
    # at every moment something starts or ends, exactly three programs are alive
    for t in sorted({s.start_at for s in made} | set(ended.values())):
        alive = [s for s in made if s.start_at <= t and ended.get(s.session_id, float("inf")) > t]
        assert len(alive) == 3, t
    # each program's first call is sent as it starts
    for spec in made:
        if f"{spec.session_id}#0" in rec.arrivals:
            assert rec.arrivals[f"{spec.session_id}#0"] == pytest.approx(spec.start_at)


def test_closed_loop_ramp_spreads_the_first_programs():
    feed = ClosedLoop(lambda i: program(i), concurrency=4, ramp_s=8.0)
    assert [spec.start_at for spec in feed.initial()] == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="concurrency"):
        ClosedLoop(lambda i: program(i), concurrency=0)


def test_open_loop_plays_programs_at_their_times_and_stops_when_done():
    specs = [program(0, start_at=0.0), program(1, start_at=3.5), program(2, start_at=7.25)]
    # the third program's second call has an absolute arrival time (a trace)
    specs[2].calls[1] = dataclasses.replace(specs[2].calls[1], at=20.0)
    sim = simulation("round_robin", OpenLoop(specs), workers=2, duration_s=1000.0,
                     stop_when_done=True)
    rec = Recorder(sim)
    result = sim.run()
    assert rec.arrivals["p0#0"] == 0.0
    assert rec.arrivals["p1#0"] == 3.5
    assert rec.arrivals["p2#0"] == 7.25
    assert rec.arrivals["p2#1"] == 20.0
    # a relative call comes think_s after the previous response
    done = {rid: t for rid, t, _, _ in rec.completions}
    assert rec.arrivals["p1#1"] == pytest.approx(done["p1#0"] + specs[1].calls[1].think_s)
    assert result.programs_completed == 3
    assert result.calls_completed == sum(len(s.calls) for s in specs)
    # the run ends with the last completion, not at duration_s
    last = max(done.values())
    assert last > 20.0
    assert result.duration_s == pytest.approx(last)
    assert result.output_tokens_per_s == pytest.approx(result.output_tokens / last)


def test_without_stop_when_done_the_run_lasts_its_duration():
    sim = simulation("round_robin", OpenLoop([program(0)]), duration_s=50.0)
    result = sim.run()
    assert result.programs_completed == 1
    assert result.duration_s == 50.0


def test_batches_start_only_after_the_previous_batch_ended():
    made: dict[int, list[ProgramSpec]] = {}

    def make_batch(b: int) -> list[ProgramSpec]:
        # uneven programs so the batch's end is set by its slowest one
        made[b] = [program(10 * b + k, turns=1 + k, think_s=0.2 * (k + 1)) for k in range(3)]
        return made[b]

    sim = simulation("least_loaded", Batches(make_batch), workers=2, duration_s=15.0)
    rec = Recorder(sim)
    sim.run()
    ended = dict(rec.ends)
    assert len(made) >= 4
    for b in range(len(made) - 1):
        batch_end = max(ended[s.session_id] for s in made[b])
        starts = {s.start_at for s in made[b + 1]}
        assert starts == {batch_end}
        # no call of batch b+1 arrived while batch b had a program left
        first_next = min(t for rid, t in rec.arrivals.items()
                         if rid.split("#")[0] in {s.session_id for s in made[b + 1]})
        assert first_next >= batch_end
    assert {s.start_at for s in made[0]} == {0.0}


# -- sub-agents: spawned by their parent, awaited before its next call ----------------------


def child(index: int, parent: str, after: int, **kwargs) -> ProgramSpec:
    """A sub-agent of ``parent`` started once the parent has completed ``after`` calls; a
    ``start_at`` far away shows it is not what starts it."""
    return dataclasses.replace(program(index, session=f"c{index}", start_at=500.0, **kwargs),
                               parent_session_id=parent, spawn_after_calls=after)


def completed_at(rec: Recorder) -> dict[str, float]:
    return {rid: t for rid, t, _, _ in rec.completions}


def test_a_subagent_starts_when_its_parent_has_completed_that_many_calls():
    parent = program(0, turns=2, think_s=0.5)
    children = [child(1, "p0", 0), child(2, "p0", 1), child(3, "p0", 2)]
    sim = simulation("least_loaded", OpenLoop([*children, parent]), workers=2,
                     duration_s=1000.0, stop_when_done=True)
    rec = Recorder(sim)
    result = sim.run()
    done = completed_at(rec)
    assert rec.arrivals["c1#0"] == rec.arrivals["p0#0"] == 0.0  # with the parent's start
    assert rec.arrivals["c2#0"] == done["p0#0"]  # as the parent's first call completes
    assert rec.arrivals["c3#0"] == done["p0#1"]  # after its last: nobody waits for it
    assert result.programs_completed == 4 and result.duration_s < 500.0


def test_a_call_that_waits_for_subagents_is_sent_when_the_last_one_ends():
    parent = dataclasses.replace(program(0, turns=3, think_s=0.5), waits_for={1: ("c1", "c2")})
    # the sub-agents take longer than the parent's own think time
    children = [child(1, "p0", 1, turns=3, think_s=2.0), child(2, "p0", 1, turns=2, think_s=3.0)]
    sim = simulation("least_loaded", OpenLoop([parent, *children]), workers=2,
                     duration_s=1000.0, stop_when_done=True)
    rec = Recorder(sim)
    sim.run()
    done = completed_at(rec)
    last_child_end = max(done["c1#2"], done["c2#1"])
    assert last_child_end > done["p0#0"] + 0.5
    assert rec.arrivals["p0#1"] == last_child_end
    # a call without sub-agents to wait for keeps its own think time
    assert rec.arrivals["p0#2"] == pytest.approx(done["p0#1"] + 0.5)


def test_a_kvtester_parent_sends_its_next_request_only_after_its_subagents_last_completed(
        tmp_path):
    import json

    from sim.traces import load_kvtester

    doc = {"id": "p", "block_size": BS, "requests": [
        {"t": 0.0, "in": 9, "out": 3, "hash_ids": [1, 2, 3]},
        {"type": "subagent", "agent_id": "a", "t": 1.0, "requests": [
            {"t": 0.0, "in": 9, "out": 3, "hash_ids": [5, 6, 7]},
            {"t": 4.0, "in": 13, "out": 3, "hash_ids": [5, 6, 7, 8], "think_time": 3.0}]},
        {"t": 2.0, "in": 13, "out": 3, "hash_ids": [1, 2, 3, 4], "think_time": 0.1},
    ]}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    for timing in ("think", "recorded"):
        programs, block_size = load_kvtester(path, timing=timing)
        assert block_size == BS
        sim = simulation("least_loaded", OpenLoop(programs), workers=2, duration_s=1000.0,
                         stop_when_done=True)
        rec = Recorder(sim)
        sim.run()
        done = completed_at(rec)
        # the sub-agent starts as the parent's first request completes (think) or at its
        # recorded time (1 s, the entry's t), and the parent's next request waits for it
        start = done["p#0"] if timing == "think" else 1.0
        assert rec.arrivals["p/a#0"] == pytest.approx(start), timing
        assert rec.arrivals["p/a#1"] == pytest.approx(
            done["p/a#0"] + 3.0 if timing == "think" else max(done["p/a#0"], 5.0)), timing
        assert rec.arrivals["p#1"] == done["p/a#1"], timing


def test_a_program_waiting_for_a_session_that_never_runs_is_an_error():
    parent = dataclasses.replace(program(0, turns=2), waits_for={1: ("ghost",)})
    sim = simulation("least_loaded", OpenLoop([parent]), duration_s=1000.0, stop_when_done=True)
    with pytest.raises(RuntimeError, match="can never finish.*ghost"):
        sim.run()


# -- the closed-loop replay of conversations ----------------------------------------------


def conversations(count: int) -> list[ProgramSpec]:
    """``count`` conversations ``k`` of a top-level session ``r{k}`` and a sub-agent ``c{k}``
    it starts after its first call and waits for; the recorded starts are far apart, as in
    an open-loop trace, and their lengths differ."""
    programs = []
    for k in range(count):
        root = dataclasses.replace(program(2 * k, turns=2 + k % 3, session=f"r{k}",
                                           start_at=1000.0 * k, think_s=0.3),
                                   waits_for={1: (f"c{k}",)})
        sub = dataclasses.replace(program(2 * k + 1, turns=1 + k % 2, session=f"c{k}",
                                          start_at=1000.0 * k + 1.0),
                                  parent_session_id=f"r{k}", spawn_after_calls=1)
        programs += [root, sub]
    return programs


def test_conversation_loop_keeps_n_conversations_in_flight_and_starts_the_next_when_one_ends():
    count, concurrency = 7, 3
    sim = simulation("least_loaded", ConversationLoop(conversations(count), concurrency),
                     workers=2, duration_s=float("inf"), stop_when_done=True)
    rec = Recorder(sim)
    result = sim.run()
    assert result.programs_completed == 2 * count
    ended = dict(rec.ends)
    starts = [rec.arrivals[f"r{k}#0"] for k in range(count)]
    ends = [max(ended[f"r{k}"], ended[f"c{k}"]) for k in range(count)]
    assert starts[:concurrency] == [0.0] * concurrency
    # each later conversation starts, in trace order, the moment an earlier one ended
    assert starts == sorted(starts)
    for k in range(concurrency, count):
        assert starts[k] in ends[:k], k
    # at every start, exactly `concurrency` conversations are in flight (counting it)
    for k in range(count):
        alive = [j for j in range(count) if starts[j] <= starts[k] < ends[j]]
        assert len(alive) == concurrency, (k, alive)
    # the run ends with the last conversation, far before the recorded starts
    assert result.duration_s == pytest.approx(max(ends)) and max(ends) < 1000.0


def test_conversation_loop_keeps_recorded_gaps_relative_to_the_conversations_start():
    first = program(0, turns=2, session="a", start_at=50.0)
    second = program(1, turns=3, session="b", start_at=200.0)
    second.calls[1] = dataclasses.replace(second.calls[1], at=206.0)  # 6 s after its start
    sim = simulation("least_loaded", ConversationLoop([first, second], 1), duration_s=1000.0,
                     stop_when_done=True)
    rec = Recorder(sim)
    sim.run()
    ended = dict(rec.ends)
    assert rec.arrivals["a#0"] == 0.0
    assert rec.arrivals["b#0"] == ended["a"]
    assert rec.arrivals["b#1"] == pytest.approx(ended["a"] + 6.0)
    assert second.calls[1].at == 206.0  # the feed copies what it shifts


def test_a_closed_loop_replay_shows_its_progress_by_conversations_ended():
    # no end in time: the run reports how many of its conversations have ended, as it goes
    count = 12
    fractions: list[float] = []
    sim = simulation("least_loaded", ConversationLoop(conversations(count), 2), workers=2,
                     duration_s=float("inf"), stop_when_done=True, progress=fractions.append,
                     sample_every_s=0.5)
    sim.run()
    assert fractions == sorted(fractions)
    assert fractions[-1] == 1.0
    seen = {round(f * count) for f in fractions}
    assert len(seen) >= count // 2, fractions  # steps along the way, not one line at the end
    assert all(f == pytest.approx(round(f * count) / count) for f in fractions)


def test_an_open_loop_replay_counts_programs_ended_ahead_of_its_time_cap():
    programs = [program(k, start_at=float(k)) for k in range(4)]
    fractions: list[float] = []
    sim = simulation("least_loaded", OpenLoop(programs), duration_s=10_000.0, stop_when_done=True,
                     progress=fractions.append)
    sim.run()
    # the cap is far away; the programs' ends, not simulated time, drive the bar to the end
    assert fractions[-1] == 1.0 and fractions == sorted(fractions)


def test_progress_lines_step_by_tenths_when_stderr_is_not_a_terminal():
    stream = io.StringIO()
    bar = Progress("replay x", stream=stream)
    for fraction in (0.0, 0.04, 0.15, 0.19, 0.5, 1.0):
        bar(fraction)
    bar.close()
    assert stream.getvalue().splitlines() == ["replay x: 0%", "replay x: 15%", "replay x: 50%",
                                              "replay x: 100%"]


def test_conversation_loop_needs_a_positive_concurrency():
    with pytest.raises(ValueError, match="concurrency"):
        ConversationLoop(conversations(2), 0)
    assert ConversationLoop(conversations(5), 2).conversations == 5


# -- calls ----------------------------------------------------------------------------------


def test_every_call_completes_once_with_latency_at_least_its_service_time():
    specs = [program(i, turns=4, start_at=0.3 * i, think_s=0.4) for i in range(8)]
    sim = simulation("round_robin", OpenLoop(specs), workers=2, num_blocks=40, duration_s=600.0,
                     stop_when_done=True)
    rec = Recorder(sim)
    result = sim.run()
    expected = {f"{s.session_id}#{k}" for s in specs for k in range(len(s.calls))}
    completed = [rid for rid, _, _, _ in rec.completions]
    assert Counter(completed) == Counter(expected)  # each exactly once
    assert result.calls_completed == len(expected) == len(result.call_latencies_s)
    assert sum(len(e.finished) for e in sim.engines) == len(expected)
    outputs = {f"{s.session_id}#{k}": c.output_tokens for s in specs for k, c in enumerate(s.calls)}
    for (rid, done_at, prompt, cached), latency in zip(rec.completions, result.call_latencies_s):
        assert latency == pytest.approx(done_at - rec.arrivals[rid])
        # a call needs one iteration per output token, each at least base + one sequence,
        # and its uncached prompt tokens (all but a final 1-token chunk) as prefill
        service = (outputs[rid] * (MODEL.base_s + MODEL.seq_s)
                   + max(0, prompt - cached - 1) * MODEL.prefill_token_s)
        assert latency >= service - 1e-12
    assert result.output_tokens == sum(outputs.values())


# -- KV events ------------------------------------------------------------------------------


def _pool_session_tokens(engine) -> dict[str, int]:
    """Tokens of every session's blocks the engine's pool holds cached (free or in use).
    Each program's hashes carry its index in bits 32 and up (its own token stream)."""
    pool = engine.pool
    cached = [h for h in pool.block_hash if h is not None]
    assert len(cached) == len(set(cached)), "the scenario must not duplicate blocks"
    tokens: Counter[str] = Counter()
    for h in cached:
        tokens[f"p{h >> 32}"] += BS
    return dict(tokens)


def test_kv_events_reach_the_policy_index_exactly():
    specs = [program(i, turns=6, first_prompt=10 + 3 * i, start_at=0.2 * i, think_s=1.0)
             for i in range(10)]
    checks = []

    def check(now: float, sim: Simulation) -> None:
        for engine in sim.engines:
            kv = sim.policy.index.worker(engine.name)
            resident = {h for h in engine.pool.block_hash if h is not None}
            assert set(kv.blocks) == resident, (now, engine.name)
            assert kv.session_tokens == _pool_session_tokens(engine), (now, engine.name)
        checks.append(now)

    # round robin scatters each program's turns over both workers; 40 blocks per worker
    # force evictions
    sim = simulation("round_robin", OpenLoop(specs), workers=2, num_blocks=41, duration_s=600.0,
                     stop_when_done=True, on_sample=check, sample_every_s=0.5)
    rec = Recorder(sim)
    result = sim.run()
    assert result.calls_completed == 60
    assert len(checks) >= 5
    check(float("inf"), sim)
    assert rec.removed > 0, "the pool must have evicted something"
    # both workers hold some session's blocks at the end
    assert all(sim.policy.index.worker(e.name).session_tokens for e in sim.engines)


def test_engine_capacity_is_reported_to_the_policy():
    policy = make_policy(name="least_loaded")
    sim = simulation(policy, OpenLoop([program(0)]), workers=2, num_blocks=31)
    assert [e.capacity_tokens for e in sim.engines] == [120, 120]
    assert all(policy.ledger.worker(e.name).capacity_tokens == 120 for e in sim.engines)


# -- retention ------------------------------------------------------------------------------


class ScriptedPolicy(RoundRobinPolicy):
    """Round robin that also returns scripted retention actions from its periodic tick."""

    def __init__(self, script: list[tuple[float, Action]]) -> None:
        super().__init__(RouterConfig(name="round_robin"))
        self.script = sorted(script, key=lambda item: item[0])

    def tick(self, now: float) -> list[Action]:
        actions = super().tick(now)
        while self.script and self.script[0][0] <= now:
            actions.append(self.script.pop(0)[1])
        return actions


def _retention_run(script, apply_retention=True):
    """A, B, C run one 16-token call each (3 cached blocks each, freed in that order);
    at t=5, D's 34-token prompt needs 9 blocks: the 3 never-cached ones, then 6 evicted."""
    specs = [ProgramSpec(name, [CallSpec(14, 2)], index, start_at=float(index))
             for index, name in enumerate("ABC")]
    specs.append(ProgramSpec("D", [CallSpec(34, 2)], 3, start_at=5.0))
    policy = ScriptedPolicy(script)
    orders = {}

    def sample(now, sim):
        orders[now] = sim.engines[0].pool.free_queue_order()

    sim = simulation(policy, OpenLoop(specs), num_blocks=13, duration_s=10.0,
                     apply_retention=apply_retention, on_sample=sample, sample_every_s=1.0)
    sim.run()
    pool = sim.engines[0].pool
    kept = {name for index, name in enumerate("ABC")
            if all(pool.is_cached((index << 32) | i) for i in range(3))}
    evicted = {name for index, name in enumerate("ABC")
               if not any(pool.is_cached((index << 32) | i) for i in range(3))}
    assert kept | evicted == {"A", "B", "C"}, "a session was partly evicted"
    return kept, orders


# Block ids: A gets 1-4, B gets 4-7 (A's unhashed 4th block comes back first), C 7-10;
# each keeps 3 cached blocks. Free order at t=4 (sampled at the tick): never-cached blocks
# 10, 11, 12 first, then the cached ones by eviction class and LRU.


def test_without_directives_eviction_is_lru():
    kept, orders = _retention_run([])
    assert kept == {"C"}
    assert orders[4.0] == [10, 11, 12, 3, 2, 1, 6, 5, 4, 9, 8, 7]


def test_demoted_session_blocks_are_evicted_before_others():
    kept, orders = _retention_run([(3.0, Demote("C", "w0"))])
    assert kept == {"B"}
    # C's blocks jump ahead of every other cached block (never-cached ones still go first)
    assert orders[4.0] == [10, 11, 12, 9, 8, 7, 3, 2, 1, 6, 5, 4]


def test_retained_session_blocks_are_evicted_last():
    kept, orders = _retention_run([(3.0, Retain("A", "w0", 90, 100.0))])
    assert kept == {"A"}
    assert orders[4.0][-3:] == [3, 2, 1]


def test_released_session_loses_its_retention():
    script = [(3.0, Retain("A", "w0", 90, 100.0)), (3.0, Retain("B", "w0", 90, 100.0)),
              (4.0, Release("B", "w0", "final"))]
    kept, orders = _retention_run(script)
    # B went back to the normal class (behind C), so D evicted C then B; A stayed retained
    assert kept == {"A"}
    kept_without_release, _ = _retention_run(script[:2])
    assert kept_without_release == {"B"}


def test_retention_is_ignored_when_not_applied():
    kept, orders = _retention_run([(3.0, Demote("C", "w0"))], apply_retention=False)
    assert kept == {"C"}
    assert orders[4.0] == [10, 11, 12, 3, 2, 1, 6, 5, 4, 9, 8, 7]


def test_every_retention_action_of_a_real_policy_reaches_its_worker_pool():
    specs = [program(i, turns=4, first_prompt=20 + 5 * i, start_at=0.5 * i, think_s=1.5)
             for i in range(6)]
    # a growth reserve and buffer sized to the tiny pools, so programs are admitted and
    # some get paused (Demote) and resumed (Retain)
    config = ProgramAwareConfig(growth_reserve_tokens=8, buffer_per_program=0)
    policy = make_policy(config)
    sim = simulation(policy, OpenLoop(specs), workers=2, num_blocks=40, duration_s=600.0,
                     stop_when_done=True)
    returned: list[Action] = []
    for name in ("tick", "on_complete"):
        original = getattr(policy, name)

        def wrapped(*args, _original=original):
            actions = _original(*args)
            returned.extend(a for a in actions if isinstance(a, (Retain, Demote, Release)))
            return actions

        setattr(policy, name, wrapped)
    applied: list[tuple[str, str, str]] = []
    for engine in sim.engines:
        pool = engine.pool
        for kind in ("retain", "demote", "release"):
            original = getattr(pool, kind)

            def wrapped(session, *args, _original=original, _kind=kind, _name=engine.name):
                applied.append((_kind, session, _name))
                return _original(session, *args)

            setattr(pool, kind, wrapped)
    sim.run()
    expected = [(type(a).__name__.lower(), a.session_id, a.worker) for a in returned
                if a.worker is not None]
    assert {kind for kind, _, _ in expected} == {"retain", "demote", "release"}
    assert policy.stats.pauses > 0
    assert applied == expected


# -- determinism and the summary ------------------------------------------------------------


def _swebench_result(seed: int, policy: str = "program_aware"):
    from sim.workloads import SwebenchWorkload

    feed = ClosedLoop(SwebenchWorkload(seed=seed).make_program, concurrency=6, ramp_s=5.0)
    sim = Simulation(make_policy(name=policy), feed, workers=2, model=MODEL, duration_s=40.0,
                     block_size=64, num_blocks=2200)
    return sim.run()


def test_same_seed_gives_an_identical_result():
    first, second = _swebench_result(7), _swebench_result(7)
    assert first.summary() == second.summary()
    assert first.call_latencies_s == second.call_latencies_s
    assert first.program_times_s == second.program_times_s
    assert first.calls_completed > 0
    assert _swebench_result(8).summary() != first.summary()


def test_summary_has_exactly_the_report_schema():
    result = _swebench_result(7, "kv_aware")
    summary = result.summary()
    assert set(summary) == SUMMARY_KEYS
    assert summary["policy"] == "kv_aware"
    assert summary["output_tokens_per_s"] == round(result.output_tokens / result.duration_s, 2)
    assert summary["steps_per_min"] == round(result.calls_completed / (result.duration_s / 60), 2)
    assert 0.0 <= summary["hit_rate"] <= 1.0
    assert summary["hit_rate"] == round(result.cached_tokens / result.prompt_tokens, 4)
    assert summary["p50_call_s"] <= summary["p99_call_s"]
    for key in ("reprefill_tokens", "pauses", "resumes"):
        assert isinstance(summary[key], int)


def test_summary_of_a_run_without_calls_has_no_latency():
    sim = simulation("round_robin", OpenLoop([program(0, start_at=100.0)]), duration_s=10.0)
    summary = sim.run().summary()
    assert set(summary) == SUMMARY_KEYS
    assert summary["hit_rate"] == 0.0 and summary["output_tokens_per_s"] == 0.0
    assert summary["p50_call_s"] != summary["p50_call_s"]  # NaN


def test_invalid_simulation_arguments_are_rejected():
    with pytest.raises(ValueError, match="workers"):
        simulation("round_robin", OpenLoop([program(0)]), workers=0)
    with pytest.raises(ValueError, match="duration"):
        simulation("round_robin", OpenLoop([program(0)]), duration_s=0.0)


# -- the engines' scheduling policy -----------------------------------------------------------


def _queue_jump_run(scheduling_policy: str) -> tuple[list[str], dict[str, int]]:
    """One engine that runs one sequence at a time, under autellix. ``heavy`` has 2 s of
    attained service once its first call ends (PLAS queue 3); its second call arrives while
    ``blocker`` runs, and ``light``'s first call (queue 1) after it. Returns the order in which
    those two completed and the priority each call's engine request carried."""
    one_at_a_time = dataclasses.replace(MODEL, max_num_seqs=1)
    programs = [
        ProgramSpec("heavy", [CallSpec(9, 100), CallSpec(117, 5, think_s=0.1)], 0, start_at=0.0),
        ProgramSpec("blocker", [CallSpec(9, 200)], 1, start_at=0.5),
        ProgramSpec("light", [CallSpec(9, 5)], 2, start_at=2.0),
    ]
    sim = Simulation(make_policy(name="autellix"), OpenLoop(programs), workers=1,
                     model=one_at_a_time, duration_s=60.0, block_size=BS, num_blocks=64,
                     stop_when_done=True, scheduling_policy=scheduling_policy)
    engine = sim.engines[0]
    sent: dict[str, int] = {}
    add_request = engine.add_request

    def record(request, now):
        sent[request.request_id] = request.priority
        return add_request(request, now)

    engine.add_request = record
    rec = Recorder(sim)
    sim.run()
    order = [rid for rid, *_ in rec.completions if rid in ("heavy#1", "light#0")]
    return order, sent


def test_under_priority_the_engine_runs_the_better_queue_first_and_under_fcfs_by_arrival():
    by_priority, sent = _queue_jump_run("priority")
    by_arrival, sent_fcfs = _queue_jump_run("fcfs")
    # the engine requests carry engine_priority: ms relative to dispatch, autellix's queue
    # index 2 as 2 × 10^9 (every call here is admitted on arrival)
    assert sent == sent_fcfs == {"heavy#0": 0, "blocker#0": 0, "heavy#1": 2 * 10**9, "light#0": 0}
    assert by_priority == ["light#0", "heavy#1"]  # light arrived later but is in a better queue
    assert by_arrival == ["heavy#1", "light#0"]   # fcfs ignores the priority


# -- start waits (a burst's fairness) -------------------------------------------------------


def test_a_burst_feed_reports_each_programs_start_wait_with_its_first_prompt():
    programs = [program(k, turns=3, first_prompt=10 + 20 * k, output=6) for k in range(6)]
    sim = simulation("thunderagent", OpenLoop(programs, report_start_waits=True),
                     num_blocks=40, duration_s=2000.0, stop_when_done=True)
    result = sim.run()
    assert sorted(tokens for tokens, _ in result.start_waits) == sorted(
        p.calls[0].prompt_tokens for p in programs)
    # 40 blocks of 4 tokens hold only some of them at once: the rest wait to start
    assert all(wait >= 0 for _, wait in result.start_waits)
    assert any(wait > 0 for _, wait in result.start_waits)
    row = result.summary()
    assert row["p99_start_wait_s"] == pytest.approx(
        float(np.quantile([w for _, w in result.start_waits], 0.99)), abs=0.01)
    # a router starts every program on arrival; other feeds do not report start waits
    router = simulation("least_loaded", OpenLoop(programs, report_start_waits=True),
                        num_blocks=40, duration_s=2000.0, stop_when_done=True).run()
    assert {wait for _, wait in router.start_waits} == {0.0}
    plain = simulation("least_loaded", OpenLoop(programs), num_blocks=40, duration_s=2000.0,
                       stop_when_done=True).run()
    assert plain.start_waits == [] and "p99_start_wait_s" not in plain.summary()


def test_a_program_never_started_waits_until_the_run_ends():
    programs = [program(k, turns=2, first_prompt=30, output=5) for k in range(4)]
    sim = simulation("thunderagent", OpenLoop(programs, report_start_waits=True),
                     num_blocks=12, duration_s=3.0)
    result = sim.run()
    assert len(result.start_waits) == 4
    assert max(wait for _, wait in result.start_waits) == pytest.approx(3.0)


def test_start_wait_by_size_compares_the_smallest_and_largest_tenths():
    waits = [(size, 100.0 if size > 90 else 1.0) for size in range(1, 101)]
    row = start_wait_by_size(waits)
    assert row["p99_start_wait_smallest_tenth_s"] == 1.0
    assert row["p99_start_wait_largest_tenth_s"] == 100.0
    assert start_wait_by_size([(5, 2.0)]) == {"p99_start_wait_s": 2.0,
                                             "p99_start_wait_smallest_tenth_s": 2.0,
                                             "p99_start_wait_largest_tenth_s": 2.0}
