"""vllm_router behaves as vllm-router's docs/program_scheduling.md and its implementation say
(scheduler/policies/vllm_router/ cites each rule): one test per rule, on real policy objects."""

from __future__ import annotations

import pytest

import sim.runs
from scheduler.actions import Admit, Hold, Mark, Pause, Release, Resume
from scheduler.calls import CallHints, CallRequest, Usage
from scheduler.config import ConfigError, VllmRouterConfig
from scheduler.config_reading import make_policy_config, parse_policy_config
from scheduler.coordinates import SessionId
from scheduler.policies import make_policy
from scheduler.policies.vllm_router.binding import HashRing
from scheduler.policies.vllm_router.progress_ttl import (
    RankFactors,
    cache_miss_impact_s,
    decode_throughput,
    fitted_acting_ttl_s,
)
from scheduler.policies.vllm_router.state import PauseReason
from sim.runs import preset_policy_costs, run_policies, workload_feed
from sim.step_time import preset, vllm_router_cost_terms
from tests.unit.test_baselines import of, sessions


def make(workers: dict[str, int], **keys):
    policy = make_policy(make_policy_config({"name": "vllm_router", **keys}))
    for worker, capacity in workers.items():
        policy.add_worker(worker, capacity)
    return policy


class Shell:
    """Drives the policy as the shells do: a tick after every completion (the source's
    ``complete`` runs its periodic decisions)."""

    def __init__(self, policy) -> None:
        self.p = policy
        self.calls: dict[str, int] = {}

    def call(self, sid: str, prompt: int, now: float, **kw) -> Admit | Hold:
        self.calls[sid] = self.calls.get(sid, 0) + 1
        return self.p.on_arrival(CallRequest(f"{sid}#{self.calls[sid]}", SessionId(sid), prompt, **kw), now)

    def done(self, rid: str, now: float, prompt: int, completion: int = 0, cached: int = 0) -> list:
        return self.p.on_complete(rid, Usage(prompt, completion, cached), now) + self.p.tick(now)

    def run(self, sid: str, prompt: int, now: float, completion: int = 0, **kw) -> list:
        """One call of ``sid`` admitted at once and finished at ``now``."""
        decision = self.call(sid, prompt, now, **kw)
        assert isinstance(decision, Admit), decision
        return self.done(decision.request_id, now, prompt, completion)


def bound(worker: str, workers: list[str], prefix: str, skip: int = 0) -> str:
    """A session id the consistent-hash ring binds to ``worker``."""
    ring, found = HashRing(160), []
    for i in range(1000):
        if ring.pick(f"{prefix}{i}", workers) == worker:
            found.append(f"{prefix}{i}")
    return found[skip]


# -- binding ---------------------------------------------------------------------------------


def test_binding_is_a_consistent_hash_stable_for_the_session() -> None:
    workers = {f"w{i}": 100_000 for i in range(4)}
    shell = Shell(make(workers))
    first = {f"s{i}": shell.call(f"s{i}", 100, 0.0).worker for i in range(40)}
    assert len(set(first.values())) == 4  # spread over every worker
    for sid in first:  # the later calls of a session, after its pause, go to its worker
        shell.done(f"{sid}#1", 1.0, 100)
        assert shell.call(sid, 120, 2.0).worker == first[sid]
    # a fresh policy binds the same; a worker leaving moves only the sessions it held
    ring = HashRing(160)
    assert {sid: ring.pick(sid, workers) for sid in first} == first
    moved = {sid for sid in first if ring.pick(sid, ["w0", "w1", "w2"]) != first[sid]}
    assert moved == {sid for sid, worker in first.items() if worker == "w3"}


# -- the request pool ------------------------------------------------------------------------


def test_admission_holds_a_call_while_its_workers_tokens_are_taken_and_admits_it_when_room_returns() -> None:
    shell = Shell(make({"w0": 1_000}))
    assert isinstance(shell.call("a", 500, 0.0), Admit)  # 500 + the 100-token decode buffer
    assert isinstance(shell.call("b", 500, 0.1), Hold)  # 600 + 600 > 1,000
    actions = shell.done("a#1", 1.0, 500)  # TTL 0 before the window fills: a pauses
    assert of(actions, Pause) == [Pause("a", "w0")]
    assert of(actions, Admit) == [Admit("b#1", "b", "w0", 0.1)]


def test_admission_holds_a_call_while_its_worker_runs_the_most_programs() -> None:
    shell = Shell(make({"w0": 1_000_000}, max_active_programs_per_target=2))
    assert isinstance(shell.call("a", 10, 0.0), Admit) and isinstance(shell.call("b", 10, 0.0), Admit)
    assert isinstance(shell.call("c", 10, 0.1), Hold)
    assert of(shell.done("a#1", 1.0, 10), Admit) == [Admit("c#1", "c", "w0", 0.1)]


def test_the_growth_reserve_holds_a_call_that_fits_only_without_it_unless_batch_gain_covers_it() -> None:
    def scene(batch_gain: bool):
        shell = Shell(make({"w0": 6_000}, stats_window_size=2, enable_batch_gain_admission=batch_gain))
        # the window: two calls, the second 2,000 tokens longer (growth), 1,000 tokens out each
        shell.run("warm", 3_000, 0.0, completion=1_000)
        decision = shell.call("warm", 5_000, 1.0, final=True)
        shell.done(decision.request_id, 2.0, 5_000, completion=1_000)
        assert isinstance(shell.call("a", 1_000, 3.0), Admit)
        # 1,100 + 1,100 fit, not with the reserve: 2,000 · (1 target round + a's 1 left)
        return shell.call("b", 1_000, 3.1)

    assert isinstance(scene(batch_gain=False), Hold)
    # one more sequence gains ~10 s of decode against a 0.24 s cold prefill of b's 1,000 tokens
    assert isinstance(scene(batch_gain=True), Admit)


# -- Progress-TTL ----------------------------------------------------------------------------


def test_the_acting_ttl_is_zero_until_the_interval_window_is_full_and_capped() -> None:
    config = VllmRouterConfig()
    factors = RankFactors()
    for _ in range(99):
        factors.push_interval(5.0, config.stats_window_size)
    assert fitted_acting_ttl_s(config, factors, 1_000.0) == 0.0
    factors.push_interval(5.0, config.stats_window_size)
    # every tool call ends in 5 s and a miss costs 1,000 s: the longest TTL, at the cap
    assert fitted_acting_ttl_s(config, factors, 1_000.0) == pytest.approx(10.0)
    assert fitted_acting_ttl_s(VllmRouterConfig(max_acting_ttl_seconds=20.0), factors, 1_000.0) == \
        pytest.approx(20.0)
    # a miss cheaper than the wait is not worth keeping
    assert fitted_acting_ttl_s(config, factors, 1.0) == 0.0


def test_before_the_window_fills_a_program_is_paused_as_its_call_ends() -> None:
    shell = Shell(make({"w0": 100_000}))
    actions = shell.run("a", 100, 1.0)
    assert of(actions, Pause) == [Pause("a", "w0")]
    assert shell.p.ledger.load_tokens("w0") == 0  # its tokens given back


def test_an_acting_program_keeps_its_capacity_for_its_ttl_then_is_paused() -> None:
    shell = Shell(make({"w0": 100_000}, stats_window_size=3))
    t = 0.0
    for _ in range(4):  # three 1-second tool calls fill w0's interval window
        decision = shell.call("warm", 100, t)
        shell.done(decision.request_id, t + 0.5, 100)
        t += 1.5
    decision = shell.call("a", 20_000, t)
    actions = shell.done(decision.request_id, t + 1.0, 20_000)
    assert not of(actions, Pause)
    ttl = shell.p._facts["a"].ttl_deadline - (t + 1.0)
    # the intervals all last 1 s and a miss of 20,000 tokens costs ~5.5 s: kept that long
    assert ttl == pytest.approx(cache_miss_impact_s(shell.p.config, 20_000))
    kept = shell.p.ledger.load_tokens("w0")
    assert kept == 20_100
    assert shell.p.tick(t + 1.0 + ttl - 0.01) == [] and shell.p.ledger.load_tokens("w0") == kept
    assert shell.p.tick(t + 1.0 + ttl) == [Pause("a", "w0")]
    assert shell.p.ledger.load_tokens("w0") == 0


def test_a_call_within_the_ttl_goes_straight_to_the_worker_even_when_it_is_full() -> None:
    shell = Shell(make({"w0": 1_000}))
    hints = CallHints(retention_ttl_s=30.0)  # the client's kv_retention_ttl_seconds
    shell.run("a", 500, 0.0, hints=hints)
    assert isinstance(shell.call("b", 300, 1.0), Admit)  # 600 + 400 fit
    assert shell.call("a", 900, 2.0) == Admit("a#2", "a", "w0", 2.0)  # ACTIVE: no admission


def test_a_failed_call_pauses_its_program() -> None:
    shell = Shell(make({"w0": 100_000}))
    shell.run("a", 100, 0.0, hints=CallHints(retention_ttl_s=30.0))
    decision = shell.call("a", 150, 1.0)
    assert shell.p.on_abort(decision.request_id, 2.0) == [Pause("a", "w0")]
    assert shell.p._facts["a"].last_pause_reason is PauseReason.REQUEST_FAILED


def test_the_cost_models_give_the_docs_reference_estimates() -> None:
    config = VllmRouterConfig()
    # "about 13.93 seconds for a 50,000-token cold prefill", times (2 − alpha) for the impact
    assert cache_miss_impact_s(config, 50_000) == pytest.approx(13.93 * 1.85, abs=0.01)
    assert cache_miss_impact_s(config, 0) == 0.0
    # "98.23 aggregate tokens/second for batch size 4 with 200,000 total context tokens"
    assert decode_throughput(config, 4, 200_000) == pytest.approx(98.23, abs=0.01)


# -- capacity repair -------------------------------------------------------------------------


def test_capacity_repair_marks_reasoning_programs_only_and_a_marked_one_pauses_when_its_call_ends() -> None:
    shell = Shell(make({"w0": 2_000}))
    shell.run("acting", 100, 0.0, completion=400, hints=CallHints(retention_ttl_s=60.0))  # holds 600
    assert isinstance(shell.call("r1", 500, 1.0), Admit) and isinstance(shell.call("r2", 500, 1.0), Admit)
    # 1,800 held + 400 tokens (the mean output) to come for each reasoning program > 2,000
    actions = shell.p.tick(1.5)
    assert actions == [Mark("r1", "w0")]  # one is enough: 2,600 − (600 + 400) ≤ 2,000
    assert shell.p.programs["acting"].active
    assert shell.p.tick(2.0) == []  # its relief is counted until it lands
    assert of(shell.done("r1#1", 3.0, 500, completion=400), Pause) == [Pause("r1", "w0")]


# -- resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize("order, first", [("mru", "q"), ("fcfs", "p")])
def test_resume_order_on_the_previous_worker_is_most_recently_used_first(order, first) -> None:
    shell = Shell(make({"w0": 1_000}, resume_order=order))
    shell.run("p", 500, 1.0)  # p's last call ended first
    shell.run("q", 500, 2.0)
    assert isinstance(shell.call("b", 500, 2.5), Admit)
    assert isinstance(shell.call("p", 500, 3.0), Hold)  # queued first
    assert isinstance(shell.call("q", 500, 3.5), Hold)
    actions = shell.done("b#1", 4.0, 500)
    assert sessions(actions, Admit) == [first]
    assert of(actions, Resume) == [Resume(first, "w0")]


def test_resume_goes_to_the_previous_worker_first() -> None:
    shell = Shell(make({"w0": 10_000, "w1": 10_000}))
    sid = bound("w0", ["w0", "w1"], "p")
    shell.run(sid, 500, 0.0)
    for i in range(3):  # the previous worker is now the fuller one
        shell.call(bound("w0", ["w0", "w1"], "x", i), 1_000, 0.5)
    assert shell.call(sid, 600, 1.0).worker == "w0"


def cross_rank_scene(blocker_on_w1: int) -> Shell:
    """w0 full with two programs waiting; p (queued behind q) may move to w1."""
    shell = Shell(make({"w0": 2_000, "w1": 2_000}, stats_window_size=2, max_acting_ttl_seconds=0.0))
    workers = ["w0", "w1"]
    for worker in workers:  # each worker's call window: two calls
        warm = bound(worker, workers, f"warm-{worker}-")
        shell.run(warm, 100, 0.0)
        shell.done(shell.call(warm, 100, 0.1, final=True).request_id, 0.2, 100)
    p, q = bound("w0", workers, "p"), bound("w0", workers, "q")
    shell.run(p, 500, 1.0)  # both paused before; q's call ended last: it ranks first (MRU)
    shell.run(q, 500, 2.0)
    assert isinstance(shell.call(bound("w0", workers, "blocker"), 1_400, 3.0), Admit)  # 1,500 of 2,000
    if blocker_on_w1:
        assert isinstance(shell.call(bound("w1", workers, "blocker"), blocker_on_w1, 3.0), Admit)
    assert isinstance(shell.call(p, 500, 4.0), Hold) and isinstance(shell.call(q, 500, 4.0), Hold)
    shell.p.names = (p, q)
    return shell


def test_a_program_moves_to_another_worker_only_with_the_headroom() -> None:
    shell = cross_rank_scene(blocker_on_w1=500)  # w1 holds 600: 1,400 free
    p, q = shell.p.names
    # w1's 1,400 free ≥ w0's 500 free + 1.2 × p's 500: p moves (q, first on w0, stays for it)
    assert shell.p.tick(4.5) == []  # queued less than one scheduling interval
    assert of(shell.p.tick(5.0), Admit) == [Admit(f"{p}#2", p, "w1", 4.0, resumed=True)]
    assert shell.p.programs[q].paused
    shell = cross_rank_scene(blocker_on_w1=900)  # w1 holds 1,000: 1,000 free < 500 + 600
    assert of(shell.p.tick(5.0), Admit) == []  # though p's 600 would fit there


def test_a_program_is_forced_back_at_its_deadline_past_every_limit() -> None:
    shell = Shell(make({"w0": 1_000}))
    shell.run("p", 500, 0.0)
    assert isinstance(shell.call("b", 700, 1.0), Admit)
    assert isinstance(shell.call("p", 500, 2.0), Hold)
    # no window is full yet: the deadline is its cap, 300 s
    assert shell.p.tick(301.9) == []
    actions = shell.p.tick(302.0)
    assert of(actions, Admit) == [Admit("p#2", "p", "w0", 2.0, resumed=True)]
    assert of(actions, Resume) == [Resume("p", "w0", forced=True)]
    assert shell.p.ledger.load_tokens("w0") == 1_400  # over its 1,000


def test_a_clients_deadline_shortens_the_force_resume_wait() -> None:
    shell = Shell(make({"w0": 1_000}))
    shell.run("p", 500, 0.0)
    shell.call("b", 700, 1.0)
    shell.call("p", 500, 2.0, hints=CallHints(deadline_s=10.0))
    assert sessions(shell.p.tick(12.0), Admit) == ["p"]


def test_a_program_that_ran_its_segment_yields_to_a_waiter_and_ranks_behind_once() -> None:
    shell = Shell(make({"w0": 1_000}, max_segment_rounds=2))
    keep = CallHints(retention_ttl_s=60.0)
    shell.run("z", 300, 0.0)  # paused; its call ended before a's
    shell.run("a", 100, 1.0, hints=keep)  # a's first round; it stays, holding 200
    assert isinstance(shell.call("w", 800, 1.5), Hold)  # 200 + 900 > 1,000
    decision = shell.call("a", 200, 2.0, hints=keep)
    actions = shell.done(decision.request_id, 2.5, 200, cached=100)  # a cache-continuous second round
    assert of(actions, Pause) == [Pause("a", "w0")]
    assert shell.p._facts["a"].last_pause_reason is PauseReason.SEGMENT_YIELD
    assert sessions(actions, Admit) == ["w"]
    # a (its call ended last) would go before z in MRU order, but it yielded: z goes first
    assert isinstance(shell.call("a", 600, 3.0), Hold) and isinstance(shell.call("z", 600, 3.0), Hold)
    assert sessions(shell.done("w#1", 4.0, 800), Admit) == ["z"]


# -- timeouts --------------------------------------------------------------------------------


def test_an_idle_paused_program_is_released_after_its_retention() -> None:
    shell = Shell(make({"w0": 1_000}))
    shell.run("a", 100, 1.0)
    assert shell.p.tick(1_800.9) == []
    assert shell.p.tick(1_801.0) == [Release("a", "w0", "paused retention")]
    assert not shell.p.has_program("a")


def test_a_call_waiting_past_the_queue_timeout_fails_its_program() -> None:
    shell = Shell(make({"w0": 1_000}, force_resume_timeout_seconds=900.0))
    shell.run("p", 500, 0.0)
    shell.call("b", 700, 1.0)
    assert isinstance(shell.call("p", 500, 2.0), Hold)
    assert shell.p.tick(601.9) == []
    assert shell.p.tick(602.0) == [Release("p", "w0", "queue timeout")]
    assert "p#2" not in shell.p.calls


# -- configuration and the simulator's costs --------------------------------------------------


def test_the_section_keeps_the_docs_defaults_and_its_recommendation() -> None:
    config = VllmRouterConfig()
    assert (config.hash_virtual_nodes, config.max_active_programs_per_target, config.stats_window_size,
            config.max_segment_rounds, config.decode_buffer_tokens) == (160, 64, 100, 14, 100)
    assert (config.max_acting_ttl_seconds, config.force_resume_timeout_seconds, config.queue_timeout_seconds,
            config.paused_retention_ttl_seconds, config.cross_rank_headroom_ratio) == (10.0, 300.0, 600.0,
                                                                                       1800.0, 1.2)
    assert config.global_queue and config.resume_order == "mru" and config.tick_interval_s == 1.0
    with pytest.raises(ConfigError, match="low_watermark_ratio"):
        parse_policy_config({"name": "vllm_router", "low_watermark_ratio": 1.0, "high_watermark_ratio": 0.9})


def test_the_h100_preset_gives_vllm_router_its_derived_coefficients(monkeypatch) -> None:
    made: list = []
    make_policy_ = sim.runs.make_policy
    monkeypatch.setattr(sim.runs, "make_policy", lambda config: made.append(config) or make_policy_(config))
    model = preset("llama3.1-8b-h100")
    costs = preset_policy_costs(model, None)
    assert costs == vllm_router_cost_terms(model)
    run_policies(["vllm_router", "autellix"], lambda: workload_feed("swebench", 2, 7), workers=1,
                 preset="llama3.1-8b-h100", duration_s=5, show_progress=False, policy_costs=costs)
    router, autellix = made
    assert router.prefill_intercept_seconds == pytest.approx(model.base_s + model.seq_s)
    assert router.prefill_linear_seconds_per_1k_tokens == pytest.approx(
        1000 * (model.prefill_token_s + model.context_token_s))
    assert router.prefill_quadratic_seconds_per_1k_tokens_squared == 0.0  # the preset has no attention term
    assert (router.decode_fixed_step_seconds, router.decode_batch_step_seconds_per_request,
            router.decode_context_step_seconds_per_token) == (model.base_s, model.seq_s, model.context_token_s)
    assert router.decode_throughput_alpha == 0.15  # not calibrated: the doc's
    assert (autellix.decode_token_s, autellix.prefill_token_s) == (0.02, 3.6e-5)  # as it was
