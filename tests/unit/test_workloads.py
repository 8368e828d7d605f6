"""Synthetic workloads (sim/workloads.py): determinism, documented bounds, RL batches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.programs import ProgramSpec
from sim.workloads import (
    BurstWorkload,
    DEFAULT_MAX_CONTEXT_TOKENS,
    LogNormal,
    RlRolloutWorkload,
    RlSweWorkload,
    SwebenchWorkload,
    open_loop_arrivals,
)


def _calls(spec: ProgramSpec) -> list[tuple]:
    return [(c.prompt_tokens, c.output_tokens, c.think_s, c.at, c.hashes) for c in spec.calls]


def _same(a: ProgramSpec, b: ProgramSpec) -> bool:
    return (a.session_id, a.index, a.family, a.shared_prefix_tokens, a.group, a.start_at,
            _calls(a)) == (b.session_id, b.index, b.family, b.shared_prefix_tokens, b.group,
                           b.start_at, _calls(b))


def _assert_stream_contract(spec: ProgramSpec, max_context: int) -> None:
    """Token-stream programs: each prompt extends the previous prompt + output."""
    assert spec.calls
    for k, call in enumerate(spec.calls):
        assert call.hashes is None and call.at is None
        assert call.prompt_tokens > 0 and call.output_tokens > 0 and call.think_s >= 0
        assert call.prompt_tokens + call.output_tokens <= max_context
        if k:
            before = spec.calls[k - 1]
            assert call.prompt_tokens >= before.prompt_tokens + before.output_tokens
    assert spec.calls[0].think_s == 0.0


# -- SWE-bench-style agents ---------------------------------------------------------------


def test_swebench_is_deterministic_per_seed_and_index_and_independent_of_call_order():
    a = SwebenchWorkload(seed=11)
    b = SwebenchWorkload(seed=11)
    forward = a.programs(12)
    backward = [b.make_program(i) for i in reversed(range(12))][::-1]
    assert all(_same(x, y) for x, y in zip(forward, backward))
    # a window starting elsewhere gives the same programs for the same indices
    assert all(_same(x, y) for x, y in zip(a.programs(4, start_index=8), forward[8:]))
    assert [p.index for p in a.programs(3, start_index=5)] == [5, 6, 7]


def test_swebench_differs_across_seeds_and_indices():
    w = SwebenchWorkload(seed=1)
    assert not _same(w.make_program(0), w.make_program(1))
    assert _calls(w.make_program(0)) != _calls(SwebenchWorkload(seed=2).make_program(0))
    assert w.make_program(0).session_id != SwebenchWorkload(seed=2).make_program(0).session_id


def test_swebench_turns_stay_in_20_to_80_and_contexts_within_the_default_max():
    w = SwebenchWorkload(seed=3)
    programs = w.programs(400)
    turns = np.array([len(p.calls) for p in programs])
    assert turns.min() >= 20 and turns.max() <= 80
    # a long tail: the median sits well above the floor, some reach the cap region
    assert 25 <= np.median(turns) <= 45
    assert (turns >= 60).mean() > 0.02
    for p in programs:
        _assert_stream_contract(p, DEFAULT_MAX_CONTEXT_TOKENS)
    final = np.array([p.calls[-1].prompt_tokens + p.calls[-1].output_tokens for p in programs])
    # total contexts land in the descriptive 20k–50k band (median), with a tail
    assert 20_000 <= np.median(final) <= 50_000


def test_swebench_shares_one_prefix_family_across_sessions():
    w = SwebenchWorkload(seed=5, shared_prefix_tokens=4096, family=7)
    programs = w.programs(5)
    assert {p.family for p in programs} == {7}
    assert {p.shared_prefix_tokens for p in programs} == {4096}
    for p in programs:
        assert p.calls[0].prompt_tokens > 4096  # the prefix plus the unique task text
    # the prefix blocks hash the same in every program, the rest do not
    h0 = programs[0].call_hashes(0, 16)
    h1 = programs[1].call_hashes(0, 16)
    assert h0[: 4096 // 16] == h1[: 4096 // 16]
    assert h0[4096 // 16] != h1[4096 // 16]


def test_swebench_ends_early_when_the_next_turn_would_exceed_the_context_limit():
    limit = 24_000
    w = SwebenchWorkload(seed=9, max_context_tokens=limit)
    programs = w.programs(60)
    unlimited = SwebenchWorkload(seed=9).programs(60)
    cut = 0
    for p, full in zip(programs, unlimited):
        _assert_stream_contract(p, limit)
        # the limited program is a prefix of the unlimited one
        assert _calls(p) == _calls(full)[: len(p.calls)]
        if len(p.calls) < len(full.calls):
            cut += 1
            nxt = full.calls[len(p.calls)]
            assert nxt.prompt_tokens + nxt.output_tokens > limit
    assert cut > 0


def test_swebench_tool_latencies_are_long_tailed_with_test_runs():
    programs = SwebenchWorkload(seed=4).programs(200)
    think = np.array([c.think_s for p in programs for c in p.calls[1:]])
    assert 0.05 <= think.min() and think.max() <= 1800.0
    assert 0.5 <= np.median(think) <= 4.0  # shell commands: ~1–3 s
    assert (think > 30).mean() > 0.05  # test runs and slow commands


def test_swebench_without_test_runs_caps_latency_at_the_tool_bound():
    w = SwebenchWorkload(seed=4, test_run_probability=0.0)
    think = [c.think_s for p in w.programs(50) for c in p.calls[1:]]
    assert max(think) <= 120.0


def test_swebench_rejects_bad_parameters():
    with pytest.raises(ValueError):
        SwebenchWorkload(seed=-1)
    with pytest.raises(ValueError):
        SwebenchWorkload(seed=0, min_turns=30, max_turns=20)
    with pytest.raises(ValueError):
        SwebenchWorkload(seed=0, max_context_tokens=10_000)  # the first prompt may not fit
    with pytest.raises(ValueError):
        SwebenchWorkload(seed=0).make_program(-1)
    with pytest.raises(ValueError):
        LogNormal(0, 1, 0, 1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), index=st.integers(0, 10**9),
       limit=st.integers(20_000, 140_000))
def test_swebench_contract_holds_for_any_seed_and_index(seed, index, limit):
    spec = SwebenchWorkload(seed, max_context_tokens=limit).make_program(index)
    _assert_stream_contract(spec, limit)
    assert len(spec.calls) <= 80
    assert spec.index == index


# -- RL rollouts ---------------------------------------------------------------------------


def test_rl_batch_has_p_times_g_programs_with_the_batch_as_group():
    w = RlRolloutWorkload(seed=1, prompts_per_batch=3, samples_per_prompt=4)
    for b in range(3):
        batch = w.batch(b)
        assert len(batch) == 12
        assert {p.group for p in batch} == {b}
        assert [p.index for p in batch] == list(range(12 * b, 12 * (b + 1)))
    assert w.batch_size == 12


def test_rl_samples_of_a_prompt_share_its_family_and_prompt_blocks():
    w = RlRolloutWorkload(seed=2, prompts_per_batch=3, samples_per_prompt=4)
    batch = w.batch(1)
    by_family: dict[int, list[ProgramSpec]] = {}
    for p in batch:
        by_family.setdefault(p.family, []).append(p)
    assert sorted(by_family) == [3, 4, 5]  # prompt ids b·P + p
    for fam, samples in by_family.items():
        assert len(samples) == 4
        prompt = samples[0].calls[0].prompt_tokens
        for s in samples:
            assert s.shared_prefix_tokens == prompt
            assert s.calls[0].prompt_tokens == prompt
        blocks = prompt // 16
        assert len({tuple(s.call_hashes(0, 16)[:blocks]) for s in samples}) == 1
    # different prompts do not share their first block
    firsts = {by_family[f][0].call_hashes(0, 16)[0] for f in by_family}
    assert len(firsts) == 3


def test_rl_family_base_offsets_prompt_ids():
    w = RlRolloutWorkload(seed=2, prompts_per_batch=2, samples_per_prompt=2, family_base=100)
    assert sorted({p.family for p in w.batch(0)}) == [100, 101]


def test_rl_is_deterministic_and_order_independent():
    a = RlRolloutWorkload(seed=8, prompts_per_batch=2, samples_per_prompt=3)
    b = RlRolloutWorkload(seed=8, prompts_per_batch=2, samples_per_prompt=3)
    x = a.batch(2)
    y = [b.make_program(i) for i in reversed(range(12, 18))][::-1]
    assert all(_same(p, q) for p, q in zip(x, y))
    assert all(_same(p, q) for p, q in zip(a.programs(6, start_index=12), x))


def test_rl_trajectories_are_multi_turn_long_tailed_and_within_limits():
    w = RlRolloutWorkload(seed=5, prompts_per_batch=8, samples_per_prompt=8,
                          max_context_tokens=32_768)
    programs = w.programs(640)
    turns = np.array([len(p.calls) for p in programs])
    assert turns.min() >= 1 and turns.max() <= 16
    assert (turns > 1).mean() > 0.8
    outputs = np.array([c.output_tokens for p in programs for c in p.calls])
    assert np.percentile(outputs, 99) > 5 * np.median(outputs)  # a long tail
    for p in programs:
        _assert_stream_contract(p, 32_768)


def test_rl_locate_maps_indices_to_batch_prompt_sample():
    w = RlRolloutWorkload(seed=0, prompts_per_batch=3, samples_per_prompt=4)
    assert w.locate(0) == (0, 0, 0)
    assert w.locate(5) == (0, 1, 1)
    assert w.locate(12 + 11) == (1, 2, 3)
    assert w.make_program(23).session_id == "rl-0-b1-p2-g3"


def test_rl_rejects_bad_parameters():
    with pytest.raises(ValueError):
        RlRolloutWorkload(seed=0, prompts_per_batch=0, samples_per_prompt=4)
    with pytest.raises(ValueError):
        RlRolloutWorkload(seed=0, prompts_per_batch=2, samples_per_prompt=0)
    with pytest.raises(ValueError):
        RlRolloutWorkload(seed=0, prompts_per_batch=2, samples_per_prompt=2).batch(-1)


# -- agentic RL over SWE-style episodes (rl_swe) --------------------------------------------


def _mid_trajectory_tokens(programs: list[ProgramSpec]) -> int:
    """Sum of live contexts with every program at its middle turn (the sizing measure)."""
    return sum(p.calls[len(p.calls) // 2].prompt_tokens + p.calls[len(p.calls) // 2].output_tokens
               for p in programs)


def test_rl_swe_batch_is_tasks_times_samples_sharing_only_the_task_prompt():
    w = RlSweWorkload(seed=3, prompts_per_batch=4, samples_per_prompt=8)
    batch = w.batch(1)
    assert len(batch) == 32 and {p.group for p in batch} == {1}
    assert [p.index for p in batch] == list(range(32, 64))
    by_family: dict[int, list[ProgramSpec]] = {}
    for p in batch:
        by_family.setdefault(p.family, []).append(p)
    assert sorted(by_family) == [4, 5, 6, 7]  # task ids b·P + p
    for samples in by_family.values():
        assert len(samples) == 8
        prompt = samples[0].calls[0].prompt_tokens
        assert prompt > 6144  # the system prompt plus the task
        assert {s.shared_prefix_tokens for s in samples} == {prompt}
        assert {s.calls[0].prompt_tokens for s in samples} == {prompt}
        blocks = prompt // 64
        assert len({tuple(s.call_hashes(0, 64)[:blocks]) for s in samples}) == 1
        # each sample is its own episode
        assert len({tuple(_calls(s)[1:]) for s in samples}) == 8
    assert w.make_program(63).session_id == "rlswe-3-b1-p3-g7"


def test_rl_swe_is_deterministic_order_independent_and_seeded():
    a = RlSweWorkload(seed=8, prompts_per_batch=2, samples_per_prompt=3)
    b = RlSweWorkload(seed=8, prompts_per_batch=2, samples_per_prompt=3)
    x = a.batch(2)
    y = [b.make_program(i) for i in reversed(range(12, 18))][::-1]
    assert all(_same(p, q) for p, q in zip(x, y))
    assert all(_same(p, q) for p, q in zip(a.programs(6, start_index=12), x))
    other = RlSweWorkload(seed=9, prompts_per_batch=2, samples_per_prompt=3).batch(2)
    assert [_calls(p) for p in other] != [_calls(p) for p in x]


def test_rl_swe_episodes_land_in_the_documented_ranges():
    programs = RlSweWorkload(seed=7, prompts_per_batch=64, samples_per_prompt=8).batch(0)
    turns = np.array([len(p.calls) for p in programs])
    assert turns.min() >= 7 and turns.max() <= 14
    assert 10 <= np.median(turns) <= 12
    assert 0.15 <= (turns == 14).mean() <= 0.40
    for p in programs:
        _assert_stream_contract(p, DEFAULT_MAX_CONTEXT_TOKENS)
    final = np.array([p.calls[-1].prompt_tokens + p.calls[-1].output_tokens for p in programs])
    assert 15_000 <= np.median(final) <= 25_000
    think = np.array([c.think_s for p in programs for c in p.calls[1:]])
    assert think.max() <= 60.0  # tools cut at 30 s, test runs at 60 s
    assert 0.5 <= np.median(think) <= 4.0
    assert (think > 10.0).mean() > 0.05  # test runs
    # the longest episode's tool time stays short enough for batches of minutes
    assert max(sum(c.think_s for c in p.calls) for p in programs) < 300.0


@pytest.mark.parametrize("seed", [7, 11])
def test_rl_swe_batch_of_512_oversubscribes_eight_h100_workers_about_twice(seed):
    from sim.runs import workload_feed
    from sim.step_time import preset

    feed = workload_feed("rl_swe", 512, seed)
    batch = feed.initial()
    assert len(batch) == 512 and len({p.family for p in batch}) == 64
    assert {p.group for p in batch} == {0}
    fleet = 8 * preset("llama3.1-8b-h100").kv_capacity_tokens
    assert 1.9 <= _mid_trajectory_tokens(batch) / fleet <= 2.3  # documented: CC 512 ≈ 2.1×


def test_rl_swe_takes_episode_overrides_and_rejects_bad_parameters():
    w = RlSweWorkload(seed=1, prompts_per_batch=2, samples_per_prompt=2, min_turns=5, max_turns=5,
                      test_run_probability=0.0)
    assert {len(p.calls) for p in w.batch(0)} == {5}
    assert max(c.think_s for p in w.batch(0) for c in p.calls) <= 30.0
    with pytest.raises(ValueError):
        RlSweWorkload(seed=0, prompts_per_batch=0, samples_per_prompt=8)
    with pytest.raises(ValueError):
        RlSweWorkload(seed=-1, prompts_per_batch=1, samples_per_prompt=8)
    with pytest.raises(ValueError):
        RlSweWorkload(seed=0, prompts_per_batch=1, samples_per_prompt=8, min_turns=9, max_turns=8)
    with pytest.raises(TypeError):
        RlSweWorkload(seed=0, prompts_per_batch=1, samples_per_prompt=8, turns=9)


def test_rl_swe_runs_in_the_simulator_batch_after_batch():
    from scheduler.policies import make_policy
    from sim.runs import workload_feed
    from sim.simulation import Simulation
    from sim.step_time import preset

    result = Simulation(make_policy(name="least_loaded"), workload_feed("rl_swe", 16, 5), workers=2,
                        model=preset("llama3.1-8b-h100"), duration_s=1200.0, block_size=64).run()
    assert len(result.batch_makespans_s) >= 2
    assert result.programs_completed >= 32
    summary = result.summary()
    assert summary["batches"] == len(result.batch_makespans_s)
    assert summary["p50_makespan_s"] > 0


# -- open-loop arrivals --------------------------------------------------------------------


def test_open_loop_arrivals_are_a_poisson_process_in_the_window():
    arrivals = open_loop_arrivals(rate_per_s=5.0, duration_s=2000.0, seed=3)
    assert arrivals == sorted(arrivals)
    assert all(0 <= t < 2000.0 for t in arrivals)
    assert abs(len(arrivals) - 10_000) < 4 * 100  # mean 10,000, sd 100
    gaps = np.diff(arrivals)
    assert abs(gaps.mean() - 0.2) < 0.01
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: CV = 1
    assert open_loop_arrivals(5.0, 2000.0, 3) == arrivals
    assert open_loop_arrivals(5.0, 2000.0, 4) != arrivals


def test_open_loop_arrivals_edge_cases():
    assert open_loop_arrivals(1.0, 0.0, 0) == []
    with pytest.raises(ValueError):
        open_loop_arrivals(0.0, 10.0, 0)
    with pytest.raises(ValueError):
        open_loop_arrivals(1.0, -1.0, 0)


# -- burst ----------------------------------------------------------------------------------


def test_burst_starts_every_program_at_once_with_first_contexts_spanning_ten_times():
    programs = BurstWorkload(seed=7).programs(512)
    assert len(programs) == 512 and {p.start_at for p in programs} == {0.0}
    firsts = sorted(p.calls[0].prompt_tokens for p in programs)
    assert firsts[0] == 4096 and firsts[-1] == 40960
    # evenly spread in log space: each tenth by size holds its tenth of the range
    tenth = len(firsts) // 10
    assert firsts[tenth] < 4096 * 10 ** 0.15 and firsts[-tenth] > 4096 * 10 ** 0.85
    assert len({p.session_id for p in programs}) == 512
    for p in programs:  # each an episode growing from its first context
        prompts = [c.prompt_tokens for c in p.calls]
        assert prompts == sorted(prompts) and len(p.calls) >= 1
        assert p.shared_prefix_tokens == 2048


def test_burst_sizes_do_not_follow_arrival_order_and_are_seeded():
    first = [p.calls[0].prompt_tokens for p in BurstWorkload(seed=7).programs(100)]
    assert first != sorted(first) and first != sorted(first, reverse=True)
    assert first == [p.calls[0].prompt_tokens for p in BurstWorkload(seed=7).programs(100)]
    assert first != [p.calls[0].prompt_tokens for p in BurstWorkload(seed=8).programs(100)]


def test_burst_rejects_bad_parameters():
    with pytest.raises(ValueError, match="span"):
        BurstWorkload(seed=1, span=0.5)
    with pytest.raises(ValueError, match="shared_prefix_tokens"):
        BurstWorkload(seed=1, smallest_context_tokens=1024, shared_prefix_tokens=2048)
    with pytest.raises(ValueError, match="n must be"):
        BurstWorkload(seed=1).programs(0)
