"""sim/tuning.py without a search: the space, the objective and its constraint, the choice of
the best, the held-back split of a trace, and the file written."""

from __future__ import annotations

import itertools
import math

import pytest

from scheduler.config import ProgramAwareConfig

from scheduler.config_reading import parse_policy_yaml
from sim.programs import CallSpec, ProgramSpec
from sim.simulation import SimResult
from sim.tuning import (
    PROGRAM_AWARE_SPACE,
    HeldBackCheck,
    Measurement,
    TrialRecord,
    WorkloadScenario,
    best_record,
    default_p99_limit_s,
    default_params,
    held_back_split,
    measure,
    objective,
    p99_excess_s,
    policy_config,
    policy_keys,
    policy_yaml,
    round_sizes,
    search_space,
)

# -- the search space ---------------------------------------------------------------------------


def test_the_defaults_are_a_point_of_the_grid_and_give_the_default_section():
    params = default_params("program_aware")
    assert set(params) == {dim.key for dim in PROGRAM_AWARE_SPACE}
    assert all(dim.contains(params[dim.key]) for dim in PROGRAM_AWARE_SPACE)
    assert policy_config(policy_keys("program_aware", params)) == ProgramAwareConfig()


def test_every_corner_of_the_space_is_a_valid_section():
    # the extremes of the keys that constrain each other: threshold, gap, hysteresis
    dims = {dim.key: dim for dim in PROGRAM_AWARE_SPACE}
    base = default_params("program_aware")
    for threshold, gap, hysteresis in itertools.product(
            *[(dims[key].low, dims[key].high) for key in
              ("pause_threshold", "pause_target_gap", "resume_hysteresis")]):
        keys = policy_keys("program_aware", {**base, "pause_threshold": threshold,
                                             "pause_target_gap": gap,
                                             "resume_hysteresis": hysteresis})
        config = policy_config(keys)
        assert config.pause_target == pytest.approx(threshold - gap)


def test_sampled_values_are_snapped_to_the_grid_as_written():
    params = {**default_params("program_aware"), "pause_threshold": 0.9500000000000001,
              "buffer_per_program": 150.0, "max_wait_s": 85.00000000001}
    keys = policy_keys("program_aware", params)
    assert keys["pause_threshold"] == 0.95 and keys["pause_target"] == 0.93
    assert keys["buffer_per_program"] == 150 and isinstance(keys["buffer_per_program"], int)
    assert keys["max_wait_s"] == 85.0


def test_a_policy_without_a_search_space_is_refused():
    with pytest.raises(ValueError, match="no search space for policy 'kv_aware'"):
        search_space("kv_aware")


def test_trial_zero_runs_alone_then_rounds_of_the_batch():
    assert round_sizes(40, 8) == [1, 8, 8, 8, 8, 7]
    assert round_sizes(1, 8) == [1]
    assert round_sizes(4, 2) == [1, 2, 1]
    assert sum(round_sizes(17, 5)) == 17


# -- the objective and the constraint -------------------------------------------------------------


def sim_result(output_tokens: int, duration_s: float, latencies: list[float]) -> SimResult:
    return SimResult(policy="program_aware", duration_s=duration_s, output_tokens=output_tokens,
                     calls_completed=len(latencies), prompt_tokens=100, cached_tokens=50,
                     reprefill_tokens=0, preemptions=0, call_latencies_s=latencies,
                     programs_completed=0, program_times_s=[], pauses=0, resumes=0, marks=0,
                     forced_resumes=0)


def test_the_objective_is_output_tokens_per_second():
    assert objective(sim_result(9_000, 30.0, [1.0, 2.0])) == pytest.approx(300.0)


def test_the_constraint_is_the_p99_over_the_limit():
    assert p99_excess_s(20.0, 25.0) == pytest.approx(-5.0)
    assert p99_excess_s(30.0, 25.0) == pytest.approx(5.0)
    assert p99_excess_s(25.0, 25.0) == 0.0  # at the limit: feasible
    assert p99_excess_s(math.nan, 25.0) == math.inf  # no completed call: infeasible


def test_the_default_limit_is_the_defaults_p99_with_slack():
    assert default_p99_limit_s(24.0, 1.25) == pytest.approx(30.0)
    with pytest.raises(ValueError, match="slack must be ≥ 1"):
        default_p99_limit_s(24.0, 0.9)


def record(number: int, tok_s: float, excess: float) -> TrialRecord:
    return TrialRecord(number=number, params={}, keys={"name": "program_aware"},
                       measurement=Measurement(tok_s, 20.0, 0.9, {}), p99_excess_s=excess)


def test_the_best_is_the_fastest_feasible_trial_and_the_earlier_one_wins_a_tie():
    records = [record(0, 100.0, -1.0), record(1, 120.0, 3.0), record(2, 110.0, 0.0),
               record(3, 110.0, -2.0)]
    assert best_record(records).number == 2  # trial 1 is faster but over the limit
    assert best_record([record(0, 100.0, -1.0), record(1, 100.0, -5.0)]).number == 0
    assert best_record([record(0, 100.0, 1.0)]) is None


def measurement(tok_s: float, p99: float) -> Measurement:
    return Measurement(tok_s, p99, 0.9, {})


def test_the_held_back_check_needs_more_throughput_within_the_limit():
    assert HeldBackCheck(measurement(100, 20), measurement(105, 24), 25.0).generalized
    assert not HeldBackCheck(measurement(100, 20), measurement(99, 20), 25.0).generalized
    assert not HeldBackCheck(measurement(100, 20), measurement(100, 20), 25.0).generalized
    assert not HeldBackCheck(measurement(100, 20), measurement(110, 26), 25.0).generalized
    assert HeldBackCheck(measurement(100, 20), measurement(105, 24), 25.0).gain == pytest.approx(0.05)


# -- the held-back split ----------------------------------------------------------------------------


def program(session: str, index: int, start: float, parent: str | None = None) -> ProgramSpec:
    calls = [CallSpec(prompt_tokens=64, output_tokens=4, at=start),
             CallSpec(prompt_tokens=128, output_tokens=4, think_s=1.0, at=start + 5.0)]
    return ProgramSpec(session_id=session, calls=calls, index=index, parent_session_id=parent,
                       start_at=start)


def test_the_last_conversations_by_start_time_are_held_back_and_both_parts_start_at_zero():
    # given out of order: the split orders by start time
    programs = [program(f"s{i}", i, start) for i, start in
                enumerate([40.0, 10.0, 0.0, 30.0, 20.0, 50.0, 60.0, 70.0, 80.0, 90.0])]
    tuning, held = held_back_split(programs, 0.3)
    assert [p.session_id for p in held] == ["s7", "s8", "s9"]
    assert {p.session_id for p in tuning} == {f"s{i}" for i in range(7)}
    assert [p.session_id for p in tuning] == ["s2", "s1", "s4", "s3", "s0", "s5", "s6"]
    assert min(p.start_at for p in tuning) == 0.0 and min(p.start_at for p in held) == 0.0
    # times keep their offsets within a part: s8 started 10 s after s7, its second call 5 s on
    s8 = next(p for p in held if p.session_id == "s8")
    assert s8.start_at == pytest.approx(10.0)
    assert [c.at for c in s8.calls] == [pytest.approx(10.0), pytest.approx(15.0)]


def test_a_sub_agent_stays_with_its_conversation():
    programs = [program("a", 0, 0.0), program("b", 1, 10.0), program("c", 2, 20.0),
                # a sub-agent of "a" that starts after "c": it goes where "a" goes
                program("a/sa0", 3, 25.0, parent="a")]
    tuning, held = held_back_split(programs, 0.34)
    assert [p.session_id for p in held] == ["c"]
    assert {p.session_id for p in tuning} == {"a", "a/sa0", "b"}


def test_at_least_one_conversation_is_held_back_and_never_all():
    programs = [program(f"s{i}", i, float(i)) for i in range(3)]
    assert len(held_back_split(programs, 0.01)[1]) == 1
    assert len(held_back_split(programs, 0.99)[0]) == 1


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_the_fraction_must_be_inside_zero_and_one(fraction):
    with pytest.raises(ValueError, match="held-back fraction"):
        held_back_split([program("a", 0, 0.0), program("b", 1, 1.0)], fraction)


def test_one_conversation_cannot_be_split():
    with pytest.raises(ValueError, match="at least 2 conversations"):
        held_back_split([program("a", 0, 0.0), program("a/sa0", 1, 1.0, parent="a")], 0.3)


# -- the file ---------------------------------------------------------------------------------------


def test_the_file_is_a_policy_file_with_its_comments():
    keys = policy_keys("program_aware", default_params("program_aware"))
    text = policy_yaml(keys, ["made by: sluice tune", "two\nlines"])
    assert text.startswith("# made by: sluice tune\n# two\n# lines\npolicy:\n  name: program_aware\n")
    assert parse_policy_yaml(text) == ProgramAwareConfig()


def test_a_scenario_is_measured_under_its_engines_scheduling_policy(monkeypatch):
    import sim.tuning

    given: list[str] = []
    run_policies = sim.tuning.run_policies

    def recorded(*args, scheduling_policy: str, **kwargs):
        given.append(scheduling_policy)
        return run_policies(*args, scheduling_policy=scheduling_policy, **kwargs)

    monkeypatch.setattr(sim.tuning, "run_policies", recorded)
    scenario = WorkloadScenario(label="tiny", workload="swebench", concurrency=2, seed=7,
                                workers=1, preset="llama3.1-8b-h100", duration_s=20.0,
                                scheduling_policy="fcfs")
    measure(scenario, policy_keys("program_aware", default_params("program_aware")))
    measure(scenario, None)  # the ceiling too
    assert given == ["fcfs", "fcfs"]
    assert WorkloadScenario(label="tiny", workload="swebench", concurrency=2, seed=7, workers=1,
                            preset="llama3.1-8b-h100", duration_s=20.0).scheduling_policy == "priority"
