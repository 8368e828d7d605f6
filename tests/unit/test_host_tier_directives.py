"""Offload and Prefetch: program_aware's host-tier rules, the directive mapping,
and the simulator's execution of them with the engine plugin's semantics."""

from __future__ import annotations

import pytest

from controller.directives import kv_action
from scheduler.actions import Admit, Demote, Offload, Pause, Prefetch, Resume, Retain
from scheduler.kv_events import MEDIUM_CPU, BlockStored, EventBatch
from sim.host_tier import HostTier
from sluice_vllm_plugin.directive_envelope import KvOffload, KvPrefetch
from tests.unit.test_program_aware import Driver, _learn_tool_times, make, of, sessions


def _tier(overcommit: float = 0.95, **retention):
    """The tier on; by default overcommitting no further than make()'s pause threshold, so
    pauses happen as without a tier (the overcommit rule has tests of its own)."""
    return {"retention": {"host_tier": True, **retention}, "host_tier_overcommit": overcommit}


def _paused_pair(d: Driver) -> list:
    for sid, ctx in [("d", 360), ("b", 200), ("c", 300), ("a", 100)]:
        d.acting(sid, ctx)
    return d.p.tick(1.0)


def _host_holds(d: Driver, session: str, worker: str = "w0", blocks: int = 2) -> None:
    event = BlockStored(block_hashes=[f"{session}{i}".encode() for i in range(blocks)],
                        parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                        medium=MEDIUM_CPU, lora_name=None, session_id=session)
    d.p.observe_kv(worker, EventBatch(0.0, [event], 0))


def test_without_the_key_a_pause_demotes_as_before() -> None:
    actions = _paused_pair(Driver(make()))
    assert sessions(actions, Demote) == ["a", "b"] and of(actions, Offload) == []


def test_with_the_tier_a_pause_offloads_instead_of_demoting() -> None:
    actions = _paused_pair(Driver(make(**_tier())))
    assert sessions(actions, Pause) == ["a", "b"]
    assert of(actions, Offload) == [Offload("a", "w0"), Offload("b", "w0")]
    assert of(actions, Demote) == []


def test_a_resumed_program_whose_kv_the_tier_holds_is_prefetched_before_its_calls() -> None:
    d = Driver(make(**_tier(prefetch_priority=70, prefetch_deadline_s=20.0)))
    _paused_pair(d)
    _host_holds(d, "a")
    assert d.p.index.host_tokens("w0", "a") == 32 and d.p.index.session_tokens("w0", "a") == 0
    assert not isinstance(d.arrive("a", 100, 2.0), Admit)  # paused: held
    actions = d.p.tick(3.0)
    assert sessions(actions, Resume) == ["a"]
    assert actions[0] == Prefetch("a", "w0", 70, None, 20.0)
    assert of(actions, Admit) and of(actions, Retain)  # its call goes, and it is retained again


def test_no_prefetch_when_the_tier_holds_nothing_of_it() -> None:
    d = Driver(make(**_tier()))
    _paused_pair(d)
    d.arrive("a", 100, 2.0)
    actions = d.p.tick(3.0)
    assert sessions(actions, Resume) == ["a"] and of(actions, Prefetch) == []


def test_offload_dormant_offloads_a_program_turning_dormant_and_retains_it_at_its_next_call() -> None:
    d = Driver(make(dormant_quantile=0.5, dormant_min_s=0.0, **_tier(offload_dormant=True)))
    now = _learn_tool_times(d, 2.0)
    d.acting("a", 600, now)
    d.p.tick(now + 1.0)  # its Retain goes out
    actions = d.p.tick(now + 2.0)
    assert of(actions, Offload) == [Offload("a", "w0")]
    assert d.p.ledger.is_dormant("a")
    assert isinstance(d.arrive("a", 650, now + 30.0), Admit)
    assert sessions(d.p.tick(now + 31.0), Retain) == ["a"]  # retained again at its next call


def test_dormancy_alone_does_not_offload() -> None:
    d = Driver(make(dormant_quantile=0.5, dormant_min_s=0.0, **_tier(offload_dormant=False)))
    now = _learn_tool_times(d, 2.0)
    d.acting("a", 600, now)
    assert of(d.p.tick(now + 2.0), Offload) == []


def _paused_a_with_room_elsewhere(d: Driver) -> None:
    """``a`` paused on w0 with a call waiting that w0 has no room for (its context grew to
    300), and a second worker, empty, added."""
    _paused_pair(d)
    d.p.add_worker("w1", 1000)
    assert not isinstance(d.arrive("a", 300, 2.0), Admit)


def test_with_the_tier_a_paused_program_whose_home_holds_its_kv_waits_for_room_there() -> None:
    d = Driver(make(**_tier()))
    _host_holds(d, "a")
    _paused_a_with_room_elsewhere(d)
    assert "a" not in sessions(d.p.tick(3.0), Resume)  # w1 has room, but w0's tier holds a's KV
    d.finish(d.arrive("d", 10, 4.0).request_id, 10, 4.0)  # d shrinks: w0 has room again
    actions = d.p.tick(5.0)
    assert "a" in sessions(actions, Resume)
    assert [admit.worker for admit in of(actions, Admit) if admit.session_id == "a"] == ["w0"]


def test_with_the_tier_a_paused_program_its_home_holds_nothing_of_resumes_where_there_is_room() -> None:
    d = Driver(make(**_tier()))
    _paused_a_with_room_elsewhere(d)
    actions = d.p.tick(3.0)
    assert [admit.worker for admit in of(actions, Admit) if admit.session_id == "a"] == ["w1"]


def test_without_the_tier_a_paused_program_resumes_where_there_is_room() -> None:
    d = Driver(make())
    _host_holds(d, "a")
    _paused_a_with_room_elsewhere(d)
    actions = d.p.tick(3.0)
    assert [admit.worker for admit in of(actions, Admit) if admit.session_id == "a"] == ["w1"]


def _waiting_on_its_home(d: Driver, tier_holds: bool = True) -> list:
    """``a`` paused on w0 (the tier holding its KV, or not), then a call of it held there for
    want of room; returns the next tick's actions."""
    if tier_holds:
        _host_holds(d, "a")
    _paused_pair(d)
    assert not isinstance(d.arrive("a", 300, 2.0), Admit)
    return d.p.tick(3.0)


def test_a_paused_program_whose_call_is_held_is_favoured_in_the_tier_below_a_resumed_one() -> None:
    d = Driver(make(**_tier(held_priority=30)))
    actions = _waiting_on_its_home(d)
    assert "a" not in sessions(actions, Resume)
    assert of(actions, Prefetch) == [Prefetch("a", "w0", 30, None, None)]
    assert of(d.p.tick(4.0), Prefetch) == []  # once per held call, not at every tick
    assert not isinstance(d.arrive("a", 300, 5.0), Admit)  # another call held: favoured again
    assert of(d.p.tick(6.0), Prefetch) == [Prefetch("a", "w0", 30, None, None)]


def test_a_held_call_is_not_favoured_without_held_priority_or_kv_in_the_tier() -> None:
    assert of(_waiting_on_its_home(Driver(make(**_tier(held_priority=None)))), Prefetch) == []
    assert of(_waiting_on_its_home(Driver(make(**_tier())), tier_holds=False), Prefetch) == []


def test_a_held_call_of_a_program_resumed_at_once_gets_the_resumes_prefetch_only() -> None:
    d = Driver(make(**_tier(prefetch_priority=70)))
    _paused_pair(d)
    _host_holds(d, "a")
    assert not isinstance(d.arrive("a", 100, 2.0), Admit)
    assert of(d.p.tick(3.0), Prefetch) == [Prefetch("a", "w0", 70, None, None)]


def test_offload_and_prefetch_map_to_the_envelopes_actions() -> None:
    offload = kv_action(Offload("s", "w0", "c1"), "m.0")
    assert isinstance(offload, KvOffload)
    assert (offload.payload.session_id, offload.payload.continuation_id) == ("s", "c1")
    prefetch = kv_action(Prefetch("s", "w0", 60, None, 5.0), "m.1")
    assert isinstance(prefetch, KvPrefetch)
    assert (prefetch.payload.priority, prefetch.payload.deadline_s) == (60, 5.0)


# -- the simulator's tier: park and favour ------------------------------------------------------

def _filled(keys: list[str]) -> HostTier:
    tier = HostTier(len(keys), 16, enable_events=False)
    for i, key in enumerate(keys):
        assert tier.prepare_store([key], f"r{i}", 0) is not None
        tier.complete_store([key])
    return tier


def test_park_makes_the_sessions_held_keys_most_recent() -> None:
    tier = _filled(["a0", "a1", "x", "y"])
    assert tier.park("a", ["a0", "a1", "gone"]) == 2
    # re-ranked tail first, as vLLM's touch: the prefix's head ends most recent
    assert tier.keys_lru_first() == ["x", "y", "a1", "a0"]
    assert tier.parked_keys("a") == ["a0", "a1"]


def test_favoured_keys_are_evicted_after_everyone_elses_lowest_priority_first() -> None:
    tier = _filled(["a0", "b0", "x", "y"])
    tier.park("a", ["a0"])
    tier.park("b", ["b0"])
    tier.favour("a", 80, float("inf"))
    tier.favour("b", 20, float("inf"))
    outcome = tier.prepare_store(["n0", "n1", "n2"], "r", 0)
    assert outcome is not None and outcome.evicted == ["x", "y", "b0"]
    assert "a0" in tier and tier.parked_keys("b") == []


def _favoured_a0_behind_x(until: float) -> HostTier:
    tier = _filled(["a0", "x"])
    tier.park("a", ["a0"])
    tier.touch(["x"])  # a0 is the least recent again: only the favour spares it
    tier.favour("a", 50, until)
    return tier


def test_a_favour_ends_at_its_deadline_and_with_a_load_of_its_keys() -> None:
    tier = _favoured_a0_behind_x(10.0)
    tier.expire_favours(9.0)
    outcome = tier.prepare_store(["n"], "r", 0)
    assert outcome is not None and outcome.evicted == ["x"]  # favoured: spared
    tier = _favoured_a0_behind_x(10.0)
    tier.expire_favours(10.0)
    outcome = tier.prepare_store(["n"], "r", 0)
    assert outcome is not None and outcome.evicted == ["a0"]  # LRU again, as vLLM's
    tier = _favoured_a0_behind_x(float("inf"))
    tier.prepare_load(["a0"], "ra", 0)
    tier.complete_load(["a0"])
    outcome = tier.prepare_store(["n"], "r", 0)
    assert outcome is not None and outcome.evicted == ["a0"]  # loaded: the favour did its work


def test_without_directives_eviction_is_unchanged() -> None:
    tier = _filled(["a", "b", "c"])
    outcome = tier.prepare_store(["n"], "r", 0)
    assert outcome is not None and outcome.evicted == ["a"]


def test_unfavour_forgets_what_the_session_parked() -> None:
    tier = _filled(["a0", "x"])
    tier.park("a", ["a0"])
    tier.favour("a", 50, float("inf"))
    tier.unfavour("a")
    assert tier.parked_keys("a") == []
    outcome = tier.prepare_store(["n"], "r", 0)
    assert outcome is not None and outcome.evicted == ["x"]  # a0 is most recent since the park


@pytest.mark.parametrize("deadline", [None, 5.0])
def test_engine_offload_parks_and_demotes_and_prefetch_undoes_the_demotion(deadline) -> None:
    from sim.block_pool import LOW_CLASS, NORMAL_CLASS
    from sim.engine import Engine, EngineRequest
    from sim.step_time import preset

    model = preset("llama3.1-8b-h100").with_host_tier(1.0)
    engine = Engine("w0", model, num_blocks=64, block_size=16)
    hashes = [f"h{i}".encode() for i in range(4)]
    engine.add_request(EngineRequest(request_id="s#0", session_id="s", hashes=hashes,
                                     prompt_tokens=64, output_tokens=2, priority=0.0,
                                     arrival=0.0), 0.0)
    now = 0.0
    for _ in range(20):  # run it to the end, then let the GPU→host copies land
        until = engine.start(now) if engine.idle else engine.busy_until
        if until is None:
            break
        now = until
        engine.complete()
    engine.start(now + 10.0)
    tier = engine.host_tier
    assert tier is not None and sum(key in tier for key in hashes) >= 3
    engine.offload("s")
    assert tier.parked_keys("s")
    assert engine.pool._class_of("s") == LOW_CLASS
    engine.prefetch("s", 60, deadline, now)
    assert engine.pool._class_of("s") == NORMAL_CLASS


def test_a_simulated_fleet_with_a_tier_tells_program_aware_and_reports_the_tier(monkeypatch) -> None:
    from sim import runs
    from sim.feeds import ClosedLoop
    from sim.workloads import SwebenchWorkload

    built = []
    real_make_policy = runs.make_policy

    def recording_make_policy(config=None, name=None):
        policy = real_make_policy(config, name=name)
        built.append(policy)
        return policy

    monkeypatch.setattr(runs, "make_policy", recording_make_policy)
    results = runs.run_policies(
        ["program_aware", "least_loaded"],
        lambda: ClosedLoop(SwebenchWorkload(seed=3).make_program, concurrency=4, ramp_s=2.0),
        workers=2, preset="llama3.1-8b-h100", duration_s=30.0, show_progress=False,
        kv_offload_gib=1.0)
    program_aware, least_loaded = built
    assert program_aware.config.retention.host_tier and program_aware.config.dormant_quantile == 0.25
    assert least_loaded.name == "least_loaded"
    for result in results:
        row = result.summary()
        # every engine had a tier: its counts are reported, and 1 GiB fills and gives up blocks
        assert isinstance(row["host_loaded_tokens"], int) and row["host_evicted_blocks"] > 0
    untiered = runs.run_policies(
        ["program_aware"],
        lambda: ClosedLoop(SwebenchWorkload(seed=3).make_program, concurrency=4, ramp_s=2.0),
        workers=2, preset="llama3.1-8b-h100", duration_s=30.0, show_progress=False)
    assert not built[-1].config.retention.host_tier
    assert "host_loaded_tokens" not in untiered[0].summary()


def _learn_short_and_long_tool_calls(d: Driver) -> float:
    """Ten 2 s tool calls and ten 20 s ones: a call past 2 s is predicted to end at 20 s."""
    now = _learn_tool_times(d, 2.0, count=10, worker_sid="short")
    return now + _learn_tool_times(d, 20.0, count=10, worker_sid="long")


def test_an_offloaded_dormant_program_is_prefetched_when_its_tool_call_is_predicted_to_end() -> None:
    d = Driver(make(dormant_quantile=0.25, dormant_min_s=0.0, **_tier()))
    start = _learn_short_and_long_tool_calls(d)
    d.acting("a", 600, start)
    assert of(d.p.tick(start + 3.0), Offload) == [Offload("a", "w0")]  # dormant past 2 s
    assert of(d.p.tick(start + 10.0), Prefetch) == []
    assert of(d.p.tick(start + 20.0), Prefetch) == [Prefetch("a", "w0", 50, None, None)]
    assert of(d.p.tick(start + 30.0), Prefetch) == []  # once


def test_no_predicted_prefetch_once_the_call_came_or_without_the_key() -> None:
    d = Driver(make(dormant_quantile=0.25, dormant_min_s=0.0, **_tier()))
    start = _learn_short_and_long_tool_calls(d)
    d.acting("a", 600, start)
    d.p.tick(start + 3.0)
    assert isinstance(d.arrive("a", 650, start + 5.0), Admit)
    assert of(d.p.tick(start + 20.0), Prefetch) == []
    off = Driver(make(dormant_quantile=0.25, dormant_min_s=0.0, **_tier(prefetch_predicted=False)))
    start = _learn_short_and_long_tool_calls(off)
    off.acting("a", 600, start)
    assert of(off.p.tick(start + 3.0), Offload) == [Offload("a", "w0")]
    assert of(off.p.tick(start + 20.0), Prefetch) == []


def _four_acting(d: Driver) -> None:
    for sid, ctx in [("d", 360), ("b", 200), ("c", 300), ("a", 100)]:
        d.acting(sid, ctx)  # 960 of w0's 1000 tokens: past the 0.95 threshold


def test_with_the_tier_a_worker_whose_programs_all_fit_under_the_overcommit_pauses_none() -> None:
    d = Driver(make(**_tier(overcommit=2.0)))
    _four_acting(d)
    assert of(d.p.tick(1.0), Pause) == []
    assert isinstance(d.arrive("e", 300, 2.0), Admit)  # a new program fits under 2.0 too
    without = Driver(make())
    _four_acting(without)
    assert sessions(without.p.tick(1.0), Pause) == ["a", "b"]
    assert not isinstance(without.arrive("e", 300, 2.0), Admit)


def test_once_the_programs_outgrow_the_overcommit_the_pause_threshold_rules() -> None:
    d = Driver(make(**_tier(overcommit=1.2)))
    _four_acting(d)
    assert of(d.p.tick(1.0), Pause) == []
    assert not isinstance(d.arrive("e", 300, 2.0), Admit)  # 1260 > 1.2 × 1000: no room for it
    assert isinstance(d.arrive("c", 600, 3.0), Admit)  # c's context grows: 1260 on w0
    actions = d.p.tick(4.0)
    assert sessions(actions, Pause) == ["a", "b", "d"]  # smallest first, down to 0.80 of the pool


def test_a_worker_that_had_to_pause_keeps_the_pause_threshold_while_its_paused_programs_wait() -> None:
    d = Driver(make(**_tier(overcommit=1.2)))
    _four_acting(d)
    d.arrive("c", 600, 1.0)  # 1260 on w0: past the overcommit
    assert sessions(d.p.tick(2.0), Pause) == ["a", "b", "d"]
    # 600 active: a 400-token newcomer would fit under 1.2, but w0's paused programs still wait
    assert not isinstance(d.arrive("e", 400, 3.0), Admit)


def _one_reasoning_one_acting(d: Driver) -> None:
    """``a`` with a call in flight on w0, ``b`` in a tool call on w1 with a 600-token context."""
    assert d.reasoning("a", 100).worker == "w0"
    assert d.acting("b", 600) == "w1"


def test_with_the_tier_a_worker_that_runs_all_takes_new_programs_by_fewest_calls_in_flight() -> None:
    d = Driver(make({"w0": 1000, "w1": 1000}, **_tier(overcommit=2.0)))
    _one_reasoning_one_acting(d)
    decision = d.arrive("c", 50, 1.0)
    assert isinstance(decision, Admit) and decision.worker == "w1"  # no call in flight there


def test_without_the_tier_new_programs_go_by_prefix_credit_less_load() -> None:
    d = Driver(make({"w0": 1000, "w1": 1000}))
    _one_reasoning_one_acting(d)
    decision = d.arrive("c", 50, 1.0)
    assert isinstance(decision, Admit) and decision.worker == "w0"  # U 0.1 against 0.6
