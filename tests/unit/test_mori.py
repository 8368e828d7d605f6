"""MORI (scheduler/policies/mori.py), one test per rule that defines it: the idleness of Eq. 1
and its window (§4.2), demotion of the idlest to the host tier or the waiting queue
(§4.3.1), promotion in the paper's order with the KV brought back (§4.1, §4.3.1), the
boundary following the tiers' capacities, admission control at each tier, and the policy
without a host tier. Each worker's GPU pool below is 1,000 tokens; a program of 300 tokens
takes 400 of it (ThunderAgent's 100 a program), so two fit and a third overflows."""

from __future__ import annotations

import pytest

from scheduler.actions import Admit, Demote, Hold, Mark, Offload, Pause, Prefetch, Resume
from scheduler.config_reading import make_policy_config
from scheduler.policies import make_policy
from tests.unit.test_baselines import Driver, make, sessions

POOL = 1_000
ONE_PROGRAM = 400  # 300 tokens of context + 100


def mori(workers: dict[str, int] | None = None, **keys) -> Driver:
    return Driver(make("mori", workers if workers is not None else {"w0": POOL}, **keys))


def call(d: Driver, sid: str, start: float, reasoning_s: float, context: int = 300) -> list:
    """A call of ``sid`` arriving at ``start`` and answered ``reasoning_s`` later; its program
    then holds ``context`` tokens and is in its next tool call."""
    decision = d.arrive(sid, 1, now=start)
    assert isinstance(decision, Admit), decision
    return d.finish(decision.request_id, context, now=start + reasoning_s)


def in_tool_calls(d: Driver, reasoning: dict[str, float], at: float = 0.0) -> None:
    """Programs whose first calls all arrive at ``at`` and are answered, each after its
    reasoning time, with 300 tokens of context: at a later time t a program's idleness is
    (t − at − r) / (t − at)."""
    admits = {sid: d.arrive(sid, 1, now=at) for sid in reasoning}
    assert all(isinstance(admit, Admit) for admit in admits.values()), admits
    for sid in sorted(reasoning, key=reasoning.__getitem__):
        d.finish(admits[sid].request_id, 300, now=at + reasoning[sid])


def tiers(d: Driver) -> dict[str, str]:
    return {sid: d.p.tier_of(sid) for sid in sorted(d.p.programs)}


# -- idleness (§4.2, Eq. 1) ------------------------------------------------------------------


def test_idleness_is_the_tool_call_share_of_the_recent_cycles() -> None:
    d = mori({"w0": 100_000})
    call(d, "idle", 0.0, 10.0)
    call(d, "idle", 110.0, 10.0)  # came back from a 100 s tool call, answered at 120 s
    t = 75.0
    for _ in range(5):  # rapid short tool calls: 10 s reasoning, 1 s tools
        call(d, "busy", t, 10.0)
        t += 11.0
    now = 130.0
    assert d.p.idleness(d.p.programs["busy"], now) == pytest.approx(5 / 55)
    assert d.p.idleness(d.p.programs["idle"], now) == pytest.approx(110 / 130)


def test_a_running_tool_call_raises_idleness_as_it_lasts() -> None:
    d = mori({"w0": 100_000})
    call(d, "a", 0.0, 10.0)
    program = d.p.programs["a"]
    assert [round(d.p.idleness(program, t), 3) for t in (10.0, 20.0, 40.0, 100.0)] == [0.0, 0.5, 0.75, 0.9]


def test_the_window_keeps_only_the_last_k_cycles() -> None:
    d = mori({"w0": 100_000}, idleness_window=3)
    call(d, "a", 0.0, 10.0)
    t = 1010.0  # a 1,000 s tool call, then short ones
    for _ in range(3):
        call(d, "a", t, 10.0)
        t += 11.0
    # the last two closed cycles (10 s + 1 s each) and the open one (10 s + 1 s so far)
    assert d.p.idleness(d.p.programs["a"], t) == pytest.approx(3 / 33)


def test_time_held_by_the_scheduler_is_neither_reasoning_nor_acting() -> None:
    d = mori(host_tier_tokens=POOL)
    in_tool_calls(d, {"a": 9.0, "b": 8.0, "c": 1.0})
    d.p.tick(10.0)  # c (ι 0.9) goes to the host tier
    assert isinstance(d.arrive("c", 1, now=20.0), Hold)  # its tool call lasted 19 s
    program = d.p.programs["c"]
    assert d.p.idleness(program, 20.0) == d.p.idleness(program, 500.0) == pytest.approx(19 / 20)


def test_a_program_never_answered_has_the_unobserved_idleness() -> None:
    d = mori(unobserved_idleness=0.25)
    d.arrive("a", 1, now=0.0)
    assert d.p.idleness(d.p.programs["a"], 50.0) == 0.25


# -- demotion (§4.3.1) -------------------------------------------------------------------------


def test_overflow_offloads_the_idlest_acting_program_and_the_busiest_stay() -> None:
    d = mori(host_tier_tokens=POOL)
    in_tool_calls(d, {"a": 10.0, "b": 5.0, "c": 1.0})  # at 12 s: ι 0.17, 0.58, 0.92
    assert d.p.tick(12.0) == [Pause("c", "w0"), Offload("c", "w0")]
    assert tiers(d) == {"a": "gpu", "b": "gpu", "c": "host"}


def test_demotion_goes_to_waiting_once_the_host_tier_is_full() -> None:
    d = mori(host_tier_tokens=ONE_PROGRAM)
    in_tool_calls(d, {"a": 10.0, "b": 3.0, "c": 2.0, "d": 1.0})
    assert d.p.tick(12.0) == [Pause("d", "w0"), Offload("d", "w0"), Pause("c", "w0"), Demote("c", "w0")]
    assert tiers(d) == {"a": "gpu", "b": "gpu", "c": "waiting", "d": "host"}


def test_reasoning_programs_are_demoted_lazily_after_the_acting_ones() -> None:
    d = mori(host_tier_tokens=2 * POOL)
    for sid in ("a", "r1", "r2"):
        call(d, sid, 0.0, 1.0, context=10)
    r2 = d.arrive("r2", 500, now=3.0)    # after a 2 s tool call
    r1 = d.arrive("r1", 500, now=100.0)  # after a 99 s one
    assert isinstance(r1, Admit) and isinstance(r2, Admit)
    # a (in its tool call) goes first, though no idler than r1; 200 tokens are still over:
    # only the idler reasoning program is marked, and it moves when its call ends
    assert d.p.tick(100.0) == [Pause("a", "w0"), Offload("a", "w0"), Mark("r1", "w0")]
    assert d.finish(r1.request_id, 600, now=101.0) == [Pause("r1", "w0"), Offload("r1", "w0")]
    assert tiers(d) == {"a": "host", "r1": "host", "r2": "gpu"}


def test_a_smaller_host_tier_sends_its_idlest_programs_to_waiting() -> None:
    d = mori(host_tier_tokens=2 * ONE_PROGRAM)
    in_tool_calls(d, {"a": 10.0, "b": 9.0, "c": 2.0, "d": 1.0})
    d.p.tick(12.0)
    assert tiers(d) == {"a": "gpu", "b": "gpu", "c": "host", "d": "host"}
    d.p.reconfigure(make_policy_config({"name": "mori", "growth_reserve_tokens": 0,
                                        "host_tier_tokens": ONE_PROGRAM}))
    d.p.tick(13.0)
    assert tiers(d) == {"a": "gpu", "b": "gpu", "c": "host", "d": "waiting"}


# -- promotion (§4.1, §4.3.1) -------------------------------------------------------------------


def test_an_offloaded_programs_call_waits_and_is_promoted_home_with_a_prefetch() -> None:
    d = mori(host_tier_tokens=POOL)
    in_tool_calls(d, {"a": 10.0, "b": 5.0, "c": 1.0})
    d.p.tick(12.0)  # c offloaded on w0
    d.p.add_worker("w1", 10 * POOL)
    assert isinstance(d.arrive("c", 1, now=20.0), Hold)
    # w0 has 200 tokens left, c needs 400; w1 has room but not c's KV, and a and b are busier
    assert d.p.tick(25.0) == []
    d.p.release("b", 30.0, "operator")
    assert d.p.tick(35.0) == [Resume("c", "w0"), Prefetch("c", "w0", 50),
                              Admit("c#2", "c", "w0", 20.0, resumed=True)]
    assert tiers(d) == {"a": "gpu", "c": "gpu"}


def test_promotion_takes_the_host_tier_then_waiting_then_new_the_least_idle_first() -> None:
    d = mori(host_tier_tokens=2 * ONE_PROGRAM)
    in_tool_calls(d, {"x": 10.0, "y": 9.0, "w": 3.0, "h1": 2.0, "h2": 1.0})
    d.p.tick(12.0)
    assert tiers(d) == {"h1": "host", "h2": "host", "w": "waiting", "x": "gpu", "y": "gpu"}
    for sid, at in (("h2", 20.0), ("h1", 20.0), ("w", 20.0)):  # ι 0.95, 0.90, 0.85
        assert isinstance(d.arrive(sid, 1, now=at), Hold)
    assert isinstance(d.arrive("n", 600, now=20.0), Hold)  # new: queued behind them
    d.p.release("x", 21.0, "operator")  # room for one
    assert sessions(d.p.tick(22.0), Admit) == ["h1"]
    d.p.release("y", 23.0, "operator")
    assert sessions(d.p.tick(24.0), Admit) == ["h2"]
    d.p.release("h1", 25.0, "operator")
    d.p.release("h2", 25.0, "operator")
    assert sessions(d.p.tick(26.0), Admit) == ["w"]  # n (700 tokens) no longer fits beside it


# -- the boundary and admission control at each tier -------------------------------------------


@pytest.mark.parametrize("pool, on_gpu", [(POOL, {"a", "b"}), (1_300, {"a", "b", "c"})])
def test_the_boundary_between_gpu_and_host_follows_the_gpu_pool(pool, on_gpu) -> None:
    d = mori({"w0": pool}, host_tier_tokens=2 * POOL)
    in_tool_calls(d, {"a": 10.0, "b": 9.0, "c": 2.0, "d": 1.0})  # ι 0.17, 0.25, 0.83, 0.92
    d.p.tick(12.0)
    assert {sid for sid, tier in tiers(d).items() if tier == "gpu"} == on_gpu
    assert {sid for sid, tier in tiers(d).items() if tier == "host"} == {"a", "b", "c", "d"} - on_gpu


def test_a_new_program_takes_the_place_of_an_idler_one_while_the_host_tier_has_room() -> None:
    d = mori(host_tier_tokens=POOL)
    in_tool_calls(d, {"a": 10.0, "b": 1.0})  # 200 tokens left; ι at 12 s: 0.17, 0.92
    assert isinstance(d.arrive("n", 250, now=12.0), Hold)  # it needs 350
    assert d.p.tick(12.0) == [Pause("b", "w0"), Offload("b", "w0"), Admit("n#1", "n", "w0", 12.0)]


def test_a_new_program_waits_while_both_tiers_are_full_and_runs_when_room_returns() -> None:
    d = mori(host_tier_tokens=ONE_PROGRAM)
    in_tool_calls(d, {"a": 10.0, "b": 3.0, "c": 1.0})
    d.p.tick(12.0)  # c fills the host tier
    assert isinstance(d.arrive("n", 250, now=13.0), Hold)
    assert d.p.tick(15.0) == []  # b is idle enough to give way, but the host tier is full
    d.p.release("c", 16.0, "operator")
    assert d.p.tick(20.0) == [Pause("b", "w0"), Offload("b", "w0"), Admit("n#1", "n", "w0", 13.0)]


# -- without a host tier, and the control loop ---------------------------------------------------


def test_without_a_host_tier_demotion_goes_to_waiting_and_nothing_gives_way() -> None:
    d = mori()
    in_tool_calls(d, {"a": 10.0, "b": 5.0, "c": 1.0})
    assert d.p.tick(12.0) == [Pause("c", "w0"), Demote("c", "w0")]
    assert isinstance(d.arrive("n", 250, now=13.0), Hold)
    assert isinstance(d.arrive("c", 1, now=14.0), Hold)
    assert d.p.tick(15.0) == []  # b is idle, but with nowhere to keep its KV it stays
    d.p.release("b", 17.0, "operator")
    assert d.p.tick(20.0) == [Resume("c", "w0"), Prefetch("c", "w0", 50),
                              Admit("c#2", "c", "w0", 14.0, resumed=True)]


def test_the_control_loop_runs_every_five_seconds_and_not_after_completions() -> None:
    policy = make("mori")
    assert (policy.tick_interval_s, policy.ticks_after_completion) == (5.0, False)


def test_the_simulator_gives_mori_the_host_tier_it_runs_with(monkeypatch) -> None:
    import sim.runs as runs
    from sim.step_time import model_of

    built = []
    monkeypatch.setattr(runs, "make_policy", lambda config: built.append(config) or make_policy(config))
    for gib, config in ((200.0, None), (0.0, None), (200.0, make_policy_config(
            {"name": "mori", "host_tier_tokens": 1_000}))):
        runs.run_policies(["mori"], lambda: runs.workload_feed("swebench", 1, 7), workers=1,
                          preset="llama3.1-8b-h100", duration_s=1.0, kv_offload_gib=gib,
                          policy_config=config, show_progress=False)
    tier = runs.host_tier_tokens(model_of("llama3.1-8b-h100").with_host_tier(200.0), 64)
    assert tier == 1_638_400  # 200 GiB of 128 KiB tokens, in whole 64-token chunks
    assert [config.host_tier_tokens for config in built] == [tier, 0, 1_000]
