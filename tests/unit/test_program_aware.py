"""The program-aware policy, rule by rule (architecture.md §3).

Most tests run with ``buffer_per_program=0`` and ``growth_reserve_tokens=0`` on workers of
1,000 tokens, so a program of ``n`` tokens moves ``U`` by exactly ``n/1000`` and every
threshold crossing can be read off the numbers in the test. They pin the v1 thresholds
(0.95 / 0.80 / 0.10) and switch the v2 rules (``max_wait_s``, dormancy) off, so each rule is
seen alone; the v2 rules have their own tests at the end, which switch them on.
"""

from __future__ import annotations

import pytest

from scheduler.actions import Admit, Demote, Hold, Mark, Pause, Release, Resume, Retain
from scheduler.calls import CallHints, CallRequest, Usage
from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import SessionId, mint_chain
from scheduler.kv_events import BlockStored, EventBatch
from scheduler.policies import make_policy
from scheduler.policies.base import NEVER_RAN, UnknownCall
from scheduler.policies.program_aware import ProgramAwarePolicy
from scheduler.programs import IllegalTransition, Lifecycle, Phase

CAP = 1000


def make(workers: dict[str, int | None] | None = None, **overrides) -> ProgramAwarePolicy:
    settings = {"buffer_per_program": 0, "growth_reserve_tokens": 0, "pause_threshold": 0.95,
                "pause_target": 0.80, "resume_hysteresis": 0.10, "max_wait_s": None,
                "dormant_quantile": None}
    settings.update(overrides)
    policy = make_policy(ProgramAwareConfig(**settings))
    assert isinstance(policy, ProgramAwarePolicy)
    for name, cap in (workers if workers is not None else {"w0": CAP}).items():
        policy.add_worker(name, cap)
    return policy


class Driver:
    """Feeds one policy calls with readable request ids: ``<session>#<n>``."""

    def __init__(self, policy: ProgramAwarePolicy) -> None:
        self.p = policy
        self._n: dict[str, int] = {}

    def arrive(self, sid: str, prompt: int, now: float = 0.0, **kw) -> Admit | Hold:
        self._n[sid] = self._n.get(sid, 0) + 1
        request = CallRequest(f"{sid}#{self._n[sid]}", SessionId(sid), prompt, **kw)
        return self.p.on_arrival(request, now)

    def finish(self, rid: str, context: int, now: float = 0.0) -> list:
        return self.p.on_complete(rid, Usage(prompt_tokens=context, completion_tokens=0), now)

    def acting(self, sid: str, context: int, now: float = 0.0, **kw) -> str:
        """A program that ran one call and now holds ``context`` tokens between calls."""
        decision = self.arrive(sid, 1, now, **kw)
        assert isinstance(decision, Admit), decision
        self.finish(decision.request_id, context, now)
        return decision.worker

    def reasoning(self, sid: str, tokens: int, now: float = 0.0, **kw) -> Admit:
        """A placed program with one call in flight that may occupy ``tokens``."""
        self.acting(sid, 1, now, **kw)
        decision = self.arrive(sid, tokens, now)
        assert isinstance(decision, Admit), decision
        return decision

    def u(self, worker: str = "w0") -> float:
        return self.p.ledger.utilization(worker)


def of(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def sessions(actions: list, kind: type) -> list[str]:
    return [a.session_id for a in of(actions, kind)]


def lifecycle(policy, sid: str) -> Lifecycle:
    return policy.programs[SessionId(sid)].lifecycle


# -- pause ---------------------------------------------------------------------------------


def test_pause_pass_pauses_smallest_acting_first_until_target() -> None:
    d = Driver(make())
    for sid, ctx in [("d", 360), ("b", 200), ("c", 300), ("a", 100)]:
        d.acting(sid, ctx)
    assert d.u() == pytest.approx(0.96)
    actions = d.p.tick(1.0)
    # 0.96 → 0.86 (still above 0.80) → 0.66: stop there.
    assert sessions(actions, Pause) == ["a", "b"]
    assert sessions(actions, Demote) == ["a", "b"]
    assert of(actions, Mark) == []
    assert lifecycle(d.p, "a") is lifecycle(d.p, "b") is Lifecycle.PAUSED
    assert lifecycle(d.p, "c") is lifecycle(d.p, "d") is Lifecycle.ACTIVE
    assert d.u() == pytest.approx(0.66)


def test_no_pause_below_pause_threshold() -> None:
    d = Driver(make())
    for sid, ctx in [("a", 100), ("b", 200), ("c", 300), ("d", 340)]:
        d.acting(sid, ctx)
    assert d.u() == pytest.approx(0.94)
    actions = d.p.tick(1.0)
    assert of(actions, Pause) == [] and of(actions, Mark) == []


def test_pause_threshold_and_target_are_configurable() -> None:
    d = Driver(make(pause_threshold=0.5, pause_target=0.3))
    d.acting("a", 100)
    d.acting("b", 150)
    d.acting("c", 260)
    actions = d.p.tick(1.0)  # 0.51 → 0.41 → 0.26
    assert sessions(actions, Pause) == ["a", "b"]


def test_marks_reasoning_smallest_first_once_acting_is_exhausted() -> None:
    d = Driver(make())
    d.acting("z-acting", 60)
    for sid, tokens in [("r300", 300), ("r200", 200), ("r400", 400)]:
        d.reasoning(sid, tokens)
    assert d.u() == pytest.approx(0.96)  # a call's demand replaces its 1-token context
    actions = [a for a in d.p.tick(1.0) if isinstance(a, (Pause, Mark))]
    # pausing the ACTING one leaves 0.90; marking r200 counts it as gone: 0.70 ≤ 0.80.
    assert actions == [Pause("z-acting", "w0"), Mark("r200", "w0")]
    assert d.p.programs["r200"].marked
    assert d.p.programs["r200"].phase is Phase.REASONING  # still running: nothing aborted
    assert d.p.projected_utilization("w0") == pytest.approx(0.70)


def test_marking_counts_marked_tokens_as_gone_and_stops_when_enough() -> None:
    d = Driver(make())
    for sid, tokens in [("big", 720), ("r150", 150), ("r100", 100)]:
        d.reasoning(sid, tokens)
    assert d.u() == pytest.approx(0.97)
    actions = d.p.tick(1.0)
    # 0.97 → 0.87 → 0.72: two marks are enough, the big one keeps running unmarked.
    assert of(actions, Mark) == [Mark("r100", "w0"), Mark("r150", "w0")]
    assert not d.p.programs["big"].marked
    assert d.u() == pytest.approx(0.97)  # nothing left the worker yet


def test_second_tick_does_not_mark_more_while_marked_calls_run() -> None:
    d = Driver(make())
    for sid, tokens in [("r200", 200), ("r300", 300), ("r470", 470)]:
        d.reasoning(sid, tokens)
    assert d.u() >= d.p.config.pause_threshold
    first = d.p.tick(1.0)
    assert of(first, Mark) == [Mark("r200", "w0")]
    for t in (2.0, 3.0, 10.0):
        later = d.p.tick(t)
        assert of(later, Mark) == [] and of(later, Pause) == []
    assert [s for s, p in d.p.programs.items() if p.marked] == ["r200"]


def test_marked_program_pauses_when_its_last_call_completes() -> None:
    d = Driver(make())
    first = d.reasoning("m", 200)
    second = d.arrive("m", 200)  # a second, concurrent call of the same program
    assert isinstance(second, Admit)
    d.reasoning("r300", 300)
    d.reasoning("r470", 470)
    assert of(d.p.tick(1.0), Mark) == [Mark("m", "w0")]

    assert d.finish(first.request_id, 250, now=2.0) == []  # one call still runs
    assert lifecycle(d.p, "m") is Lifecycle.ACTIVE and d.p.programs["m"].marked

    actions = d.finish(second.request_id, 260, now=3.0)
    assert actions == [Pause("m", "w0"), Demote("m", "w0")]
    program = d.p.programs["m"]
    assert program.lifecycle is Lifecycle.PAUSED and not program.marked
    assert program.context_tokens == 260  # the response was used, not thrown away
    assert d.p._resume.lot.since("m") == 3.0  # the force-resume clock counts from the pause


def test_marked_program_whose_call_is_aborted_pauses_too() -> None:
    d = Driver(make())
    call = d.reasoning("m", 200)
    d.reasoning("r300", 300)
    d.reasoning("r470", 470)
    d.p.tick(1.0)
    assert d.p.programs["m"].marked
    actions = d.p.on_abort(call.request_id, 2.0)
    assert sessions(actions, Pause) == ["m"]


def test_pause_pass_leaves_underloaded_workers_alone() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}))
    d.acting("a", 960)  # w0 (ties go to the first worker)
    d.acting("b", 100)  # w1: lower U wins
    assert d.p.programs["b"].home_worker == "w1"
    actions = d.p.tick(1.0)
    assert sessions(actions, Pause) == ["a"]


# -- resume --------------------------------------------------------------------------------


def _full_w0_with_paused(d: Driver, sid: str, size: int, now: float = 1.0) -> None:
    """w0 ends at U = 0.80 with a REASONING program; ``sid`` (``size`` tokens) is paused."""
    d.reasoning("busy", 960 - size)
    d.acting(sid, size)
    assert sessions(d.p.tick(now), Pause) == [sid]
    assert d.u() == pytest.approx((960 - size) / CAP)


def test_resume_serves_waiting_before_new_even_when_new_is_smaller() -> None:
    d = Driver(make())
    _full_w0_with_paused(d, "w", 160)
    assert isinstance(d.arrive("w", 160, now=2.0), Hold)  # paused: its call waits
    held = d.arrive("n", 100, now=3.0)
    assert isinstance(held, Hold) and "waiting" in held.reason
    d.p.add_worker("w1", 200)  # room for one at 0.85: 170 tokens
    actions = d.p.tick(4.0)
    assert of(actions, Resume) == [Resume("w", "w1", False)]
    assert [a.session_id for a in of(actions, Admit)] == ["w"]
    assert lifecycle(d.p, "n") is Lifecycle.PENDING


def test_resume_serves_new_before_idle_paused() -> None:
    d = Driver(make())
    _full_w0_with_paused(d, "idle", 160)
    held = d.arrive("new", 160, now=2.0)  # 0.96 > 0.95 on w0: no room
    assert isinstance(held, Hold)
    d.p.add_worker("w1", 200)
    actions = d.p.tick(3.0)
    # Same size, and "idle" < "new" by name: only the group puts the new program first.
    assert [a.session_id for a in of(actions, Admit)] == ["new"]
    assert of(actions, Resume) == []
    assert lifecycle(d.p, "idle") is Lifecycle.PAUSED


def _two_new_held(d: Driver, small_at: float, big_at: float) -> None:
    d.reasoning("busy", 900)
    assert isinstance(d.arrive("big", 150, now=big_at), Hold)
    assert isinstance(d.arrive("small", 100, now=small_at), Hold)


def test_resume_takes_smallest_first_within_a_group() -> None:
    d = Driver(make(resume_aging_halflife_s=1e6))
    _two_new_held(d, small_at=1.0, big_at=0.0)
    d.p.add_worker("w1", 200)
    actions = d.p.tick(2.0)
    assert [a.session_id for a in of(actions, Admit)] == ["small"]
    assert lifecycle(d.p, "big") is Lifecycle.PENDING


def test_resume_aging_lets_a_long_waiting_large_program_overtake() -> None:
    d = Driver(make(resume_aging_halflife_s=60.0))
    _two_new_held(d, small_at=200.0, big_at=0.0)
    d.p.add_worker("w1", 200)
    actions = d.p.tick(201.0)
    # 150 tokens after 201 s of waiting weigh ~15; 100 tokens after 1 s weigh ~99.
    assert [a.session_id for a in of(actions, Admit)] == ["big"]


def test_resume_prefers_home_worker_even_if_another_fits_tighter() -> None:
    d = Driver(make())
    _full_w0_with_paused(d, "p", 160)
    d.p.add_worker("w1", CAP)
    d.acting("q", 500)  # lands on w1 (U 0 < 0.80)
    assert d.p.programs["q"].home_worker == "w1"
    d.finish("busy#2", 800, now=2.0)
    d.p.release(SessionId("busy"), 2.0, "operator")
    assert d.u("w0") == 0.0
    actions = d.p.tick(3.0)
    assert of(actions, Resume) == [Resume("p", "w0", False)]


def test_resume_best_fit_when_home_has_no_room() -> None:
    d = Driver(make())
    _full_w0_with_paused(d, "p", 160)
    d.p.add_worker("w1", CAP)
    d.p.add_worker("w2", CAP)
    d.acting("q1", 500)
    d.acting("q2", 200)
    assert d.p.programs["q1"].home_worker == "w1" and d.p.programs["q2"].home_worker == "w2"
    actions = d.p.tick(2.0)
    # w0 would reach 0.96; w1 → 0.66 and w2 → 0.36 both fit: least headroom left is w1.
    assert of(actions, Resume) == [Resume("p", "w1", False)]


@pytest.mark.parametrize(("other_load", "hysteresis", "resumed"), [
    (700, 0.10, False),  # 0.70 + 0.16 = 0.86 > 0.95 − 0.10
    (680, 0.10, True),   # 0.84 ≤ 0.85
    (700, 0.0, True),    # 0.86 ≤ 0.95 − 0.0
])
def test_resume_never_above_threshold_minus_hysteresis(other_load, hysteresis, resumed) -> None:
    d = Driver(make(resume_hysteresis=hysteresis))
    _full_w0_with_paused(d, "p", 160)
    d.p.add_worker("w1", CAP)
    d.acting("q", other_load)
    actions = d.p.tick(2.0)
    assert bool(of(actions, Resume)) is resumed
    limit = d.p.config.pause_threshold - hysteresis
    assert d.u("w1") <= limit + 1e-9


def test_forced_resume_after_force_resume_after_s_even_without_room() -> None:
    d = Driver(make(force_resume_after_s=100.0, resume_priority_boost_s=0.0))
    _full_w0_with_paused(d, "p", 160, now=10.0)
    assert isinstance(d.arrive("p", 160, now=20.0), Hold)
    assert of(d.p.tick(109.9), Resume) == []
    actions = d.p.tick(110.0)
    assert of(actions, Resume) == [Resume("p", "w0", True)]
    assert [(a.request_id, a.resumed) for a in of(actions, Admit)] == [("p#2", True)]
    assert d.u() > d.p.config.pause_threshold - d.p.config.resume_hysteresis  # no room needed
    assert d.p.stats.forced_resumes == 1


@pytest.mark.parametrize(("lead", "priority"), [(0.0, 27.0), (5.0, 22.0), (None, 17.0)])
def test_resumed_calls_jump_the_queue_by_the_boost_and_at_most_the_lead(lead, priority) -> None:
    # held from 20 s to 30 s: it counts as arrived no earlier than 30 − lead (None: at 20),
    # then 3 s ahead of that
    d = Driver(make(resume_priority_boost_s=3.0, held_call_lead_s=lead))
    _full_w0_with_paused(d, "p", 160)
    assert isinstance(d.arrive("p", 100, now=20.0), Hold)
    d.p.add_worker("w1", CAP)
    actions = d.p.tick(30.0)
    assert of(actions, Admit) == [Admit("p#2", "p", "w1", priority, resumed=True)]


def test_new_program_held_while_others_wait_then_admitted_by_a_tick() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}))
    d.p.set_worker_health("w1", False, 0.0)
    _full_w0_with_paused(d, "p", 160)
    assert isinstance(d.arrive("p", 160, now=2.0), Hold)
    d.p.set_worker_health("w1", True, 3.0)
    held = d.arrive("n", 50, now=4.0)  # w1 is empty, but p waits for room
    assert isinstance(held, Hold) and held.reason == "queued behind waiting programs"
    actions = d.p.tick(5.0)
    admitted = {a.session_id: a for a in of(actions, Admit)}
    assert set(admitted) == {"p", "n"}
    # held from 4 s, let go at 5 s: it counts as arriving when let go (held_call_lead_s 0)
    assert admitted["n"].priority == 5.0 and not admitted["n"].resumed
    assert lifecycle(d.p, "n") is Lifecycle.ACTIVE


def test_new_program_admitted_on_arrival_when_nobody_waits() -> None:
    d = Driver(make())
    decision = d.arrive("n", 50, now=4.0)
    assert decision == Admit("n#1", "n", "w0", 4.0)


# -- soft band -------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "delay"), [
    ("soft_band_delay_s", 2.0, 2.0), ("soft_band_delay_s", 0.5, 0.5),
    # the deprecated signed key is read as its magnitude
    ("soft_band_penalty", -2.0, 2.0), ("soft_band_penalty", -0.5, 0.5),
])
def test_soft_band_admissions_go_later_by_the_delay(key, value, delay) -> None:
    if key == "soft_band_penalty":
        with pytest.warns(FutureWarning, match="soft_band_penalty is deprecated"):
            policy = make(**{key: value})
    else:
        policy = make(**{key: value})
    d = Driver(policy)
    d.acting("a", 850)
    d.p.tick(1.0)
    assert d.p.in_soft_band("w0")
    decision = d.arrive("a", 10, now=50.0)
    assert isinstance(decision, Admit)
    assert decision.priority == 50.0 + delay


@pytest.mark.parametrize(("tokens", "in_band"), [(790, False), (800, True), (949, True), (960, False)])
def test_soft_band_is_target_inclusive_to_threshold_exclusive(tokens, in_band) -> None:
    d = Driver(make())
    d.reasoning("a", tokens)  # REASONING: at 0.96 it is marked, not paused, and stays
    d.p.tick(1.0)
    assert d.p.in_soft_band("w0") is in_band
    decision = d.arrive("a", 10, now=50.0)
    assert decision.priority == (52.0 if in_band else 50.0)


def _soft_band_routing(delay: float) -> str:
    d = Driver(make({"w0": CAP, "w1": CAP}, soft_band_delay_s=delay))
    d.acting("x", 820)
    d.acting("y", 790)
    assert d.p.programs["x"].home_worker == "w0" and d.p.programs["y"].home_worker == "w1"
    d.p.tick(1.0)
    # n's whole 96-token prompt is resident on w0: a credit of 0.096 of capacity there,
    # which outweighs w0's 0.03 higher load; nothing is resident on w1.
    hashes = [11, 12, 13, 14, 15, 16]
    stored = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                         block_size=16, lora_id=None, medium=None, lora_name=None,
                         session_id="someone-else")
    d.p.observe_kv("w0", EventBatch(ts=1.0, events=[stored]))
    decision = d.arrive("n", 96, now=2.0, block_hashes=tuple(hashes))
    assert isinstance(decision, Admit)
    return decision.worker


def test_new_program_routing_avoids_soft_band_worker() -> None:
    assert _soft_band_routing(0.0) == "w0"  # prefix credit wins without the delay
    assert _soft_band_routing(2.0) == "w1"


def test_new_program_routing_weighs_prefix_credit_in_tokens_against_load() -> None:
    # A 48-token shared prefix resident on the busier worker saves 0.048 of its capacity:
    # not enough to outweigh a 0.2 difference in load, so the program goes to the idler one.
    d = Driver(make({"w0": CAP, "w1": CAP}))
    d.acting("busy", 200)
    assert d.p.programs["busy"].home_worker == "w0"
    stored = BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=[],
                         block_size=16, lora_id=None, medium=None, lora_name=None,
                         session_id="other")
    d.p.observe_kv("w0", EventBatch(ts=0.0, events=[stored]))
    assert d.arrive("n", 48, block_hashes=(1, 2, 3)).worker == "w1"


def test_new_program_routing_prefers_resident_prefix() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}))
    stored = BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=[],
                         block_size=16, lora_id=None, medium=None, lora_name=None,
                         session_id="other")
    d.p.observe_kv("w1", EventBatch(ts=0.0, events=[stored]))
    assert d.arrive("n", 48, block_hashes=(1, 2, 3)).worker == "w1"


# -- release ---------------------------------------------------------------------------------


def test_idle_program_released_after_idle_release_s() -> None:
    d = Driver(make(idle_release_s=100.0))
    decision = d.arrive("a", 10, now=0.0)
    d.finish(decision.request_id, 100, now=5.0)
    assert of(d.p.tick(104.9), Release) == []
    actions = d.p.tick(105.0)
    assert of(actions, Release) == [Release("a", "w0", "idle")]
    assert "a" not in d.p.programs
    assert d.u() == 0.0


def test_activity_postpones_idle_release() -> None:
    d = Driver(make(idle_release_s=100.0))
    first = d.arrive("a", 10, now=0.0)
    d.finish(first.request_id, 100, now=5.0)
    second = d.arrive("a", 10, now=50.0)
    d.finish(second.request_id, 100, now=60.0)
    assert of(d.p.tick(105.0), Release) == []
    assert of(d.p.tick(160.0), Release) == [Release("a", "w0", "idle")]


def test_paused_program_released_when_idle() -> None:
    d = Driver(make(idle_release_s=100.0))
    _full_w0_with_paused(d, "p", 160)
    actions = d.p.tick(100.0)
    assert Release("p", "w0", "idle") in actions
    assert "p" not in d.p.programs


def test_final_call_releases_the_program() -> None:
    d = Driver(make())
    d.acting("a", 100)
    decision = d.arrive("a", 120, now=1.0, final=True)
    actions = d.finish(decision.request_id, 150, now=2.0)
    assert actions == [Release("a", "w0", "final")]
    assert "a" not in d.p.programs and d.u() == 0.0


# -- retention -------------------------------------------------------------------------------


def _retention_policy(**retention) -> Driver:
    settings = {"active_priority": 70, "ttl_s": 100.0, "refresh_fraction": 0.25}
    settings.update(retention)
    return Driver(make(retention=settings))


def test_retain_on_placement_with_configured_priority_and_ttl() -> None:
    d = _retention_policy()
    chain = mint_chain("m", None, None, [{"role": "user", "content": "hi"}])
    d.arrive("a", 10, now=0.0, chain=chain)
    actions = d.p.tick(0.5)
    assert of(actions, Retain) == [Retain("a", "w0", 70, 100.0, chain.head)]
    assert of(d.p.tick(1.0), Retain) == []  # not re-sent every tick


def test_retain_refreshed_before_ttl_runs_out() -> None:
    d = _retention_policy()
    d.acting("a", 100, now=0.0)
    assert len(of(d.p.tick(0.0), Retain)) == 1
    # refresh_fraction 0.25: re-sent once less than 25 s of the 100 s TTL is left.
    assert of(d.p.tick(74.9), Retain) == []
    refreshed = of(d.p.tick(75.0), Retain)
    assert refreshed == [Retain("a", "w0", 70, 100.0, None)]
    assert of(d.p.tick(149.9), Retain) == []
    assert len(of(d.p.tick(150.0), Retain)) == 1


def test_demote_on_pause_and_retain_on_resume() -> None:
    d = _retention_policy()
    _full_w0_with_paused(d, "p", 160)
    d.p.add_worker("w1", CAP)
    actions = d.p.tick(2.0)
    assert of(actions, Resume) == [Resume("p", "w1", False)]
    assert of(actions, Retain) == [Retain("p", "w1", 70, 100.0, None)]


def test_paused_program_gets_demote_and_its_retain_is_not_refreshed() -> None:
    d = _retention_policy()
    d.reasoning("busy", 800, now=0.0)
    d.acting("p", 100, now=0.0)
    assert sessions(d.p.tick(0.0), Retain) == ["busy", "p"]
    grow = d.arrive("p", 10, now=1.0)
    d.finish(grow.request_id, 160, now=1.0)  # U = 0.96
    actions = d.p.tick(2.0)
    assert [a for a in actions if isinstance(a, (Pause, Demote))] == [Pause("p", "w0"), Demote("p", "w0")]
    assert sessions(d.p.tick(80.0), Retain) == ["busy"]  # busy refreshed at 75 s, p not


def test_release_on_release() -> None:
    d = _retention_policy()
    d.acting("a", 100)
    assert d.p.release(SessionId("a"), 1.0, "operator") == [Release("a", "w0", "operator")]


def test_no_retention_directives_when_disabled() -> None:
    d = _retention_policy(enabled=False)
    _full_w0_with_paused(d, "p", 160)
    d.p.add_worker("w1", CAP)
    actions = d.p.tick(2.0) + d.p.tick(100.0) + d.p.tick(300.0)
    assert of(actions, Resume)  # the scenario did pause and resume
    assert of(actions, Retain) == [] and of(actions, Demote) == []


# -- placement rules -------------------------------------------------------------------------


def test_sub_agent_goes_to_parent_worker() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}))
    d.acting("x", 300)       # w0
    d.acting("parent", 500)  # w1, now the more loaded one
    assert d.p.programs["parent"].home_worker == "w1"
    child = d.arrive("child", 50, now=1.0, parent_session_id=SessionId("parent"))
    assert child.worker == "w1"
    orphan = d.arrive("orphan", 50, now=1.0)
    assert orphan.worker == "w0"


def test_sub_agent_resumed_next_to_parent_when_its_home_is_full() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP, "w2": CAP}))
    d.p.set_worker_health("w0", False, 0.0)
    d.p.set_worker_health("w1", False, 0.0)
    d.acting("parent", 100)                  # w2, the only healthy worker
    pfill = d.reasoning("p-fill", 860)       # w2 at 0.96: no room for the child there
    d.p.set_worker_health("w0", True, 0.0)
    child = d.reasoning("child", 1, parent_session_id=SessionId("parent"))
    assert child.worker == "w0"
    d.finish(child.request_id, 160)
    d.reasoning("c-fill", 800)               # w0 at 0.96
    d.p.on_abort(pfill.request_id, 0.5)
    d.p.release(SessionId("p-fill"), 0.5, "operator")  # w2 back to 0.10
    d.p.set_worker_health("w1", True, 0.5)
    d.acting("w1-load", 400)                 # w1 at 0.40
    assert sessions(d.p.tick(1.0), Pause) == ["child"]
    actions = d.p.tick(2.0)
    # home w0 would reach 0.96; best fit would be w1 (0.56); the parent's w2 comes first.
    assert of(actions, Resume) == [Resume("child", "w2", False)]


def test_worker_with_unknown_capacity_takes_no_new_programs() -> None:
    d = Driver(make({"w0": None}))
    held = d.arrive("n", 10, now=0.0)
    assert isinstance(held, Hold)
    assert of(d.p.tick(1.0), Admit) == []
    d.p.set_capacity("w0", CAP)
    actions = d.p.tick(2.0)
    assert [a.request_id for a in of(actions, Admit)] == ["n#1"]


def test_unknown_capacity_worker_is_skipped_for_a_known_one() -> None:
    d = Driver(make({"w0": None, "w1": CAP}))
    assert d.arrive("n", 10).worker == "w1"


def test_unhealthy_worker_idle_programs_are_rehomed() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}))
    d.acting("idle", 100)
    assert d.p.programs["idle"].home_worker == "w0"
    d.p.set_worker_health("w0", False, 1.0)
    idle = d.p.programs["idle"]
    assert idle.home_worker is None and idle.lifecycle is Lifecycle.PENDING
    assert "idle" not in d.p.ledger.worker("w0").programs
    assert d.u("w0") == 0.0
    decision = d.arrive("idle", 50, now=2.0)
    assert isinstance(decision, Admit) and decision.worker == "w1"
    assert d.p.programs["idle"].home_worker == "w1"


def test_in_flight_program_is_not_rehomed_by_a_failure() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}))
    call = d.reasoning("r", 100)
    assert call.worker == "w0"
    d.p.set_worker_health("w0", False, 1.0)
    assert d.p.programs["r"].home_worker == "w0"
    assert d.p.programs["r"].lifecycle is Lifecycle.ACTIVE


def test_no_new_program_on_unhealthy_worker() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}))
    d.acting("x", 500)  # w0 more loaded: a new program would go to w1
    d.p.set_worker_health("w1", False, 0.0)
    assert d.arrive("n", 10).worker == "w0"


# -- aborts and guards -----------------------------------------------------------------------


def test_abort_of_held_call_drops_it_and_a_program_that_never_ran_goes_with_it() -> None:
    d = Driver(make({"w0": None}, idle_release_s=50.0))
    assert isinstance(d.arrive("n", 10, now=0.0), Hold)
    assert d.p.on_abort("n#1", 1.0) == [Release("n", None, NEVER_RAN)]
    assert "n#1" not in d.p.calls
    assert "n" not in d.p.programs  # nothing of it ran: not kept until idle_release_s
    d.p.set_capacity("w0", CAP)
    assert of(d.p.tick(2.0), Admit) == []


def test_an_aborted_call_of_a_program_that_ran_keeps_it_until_it_is_idle() -> None:
    d = Driver(make(idle_release_s=50.0))
    d.acting("n", 100, now=0.0)
    again = d.arrive("n", 120, now=2.0)
    assert isinstance(again, Admit)  # active: goes home
    assert of(d.p.on_abort(again.request_id, 3.0), Release) == []
    assert "n" in d.p.programs
    d.p.tick(60.0)
    assert "n" not in d.p.programs


def test_an_aborted_first_call_releases_its_program_with_its_worker() -> None:
    d = Driver(make())
    first = d.arrive("n", 100, now=0.0)
    assert isinstance(first, Admit)
    assert d.p.on_abort(first.request_id, 1.0) == [Release("n", first.worker, NEVER_RAN)]
    assert "n" not in d.p.programs and d.u() == 0


def test_abort_of_in_flight_call_frees_its_demand() -> None:
    d = Driver(make())
    d.acting("a", 100)
    call = d.arrive("a", 300)
    assert d.u() == pytest.approx(0.30)
    d.p.on_abort(call.request_id, 1.0)
    assert d.p.programs["a"].phase is Phase.ACTING
    assert d.u() == pytest.approx(0.10)  # its context stays; the call's demand went


def test_completing_a_call_twice_raises_unknown_call() -> None:
    d = Driver(make())
    call = d.arrive("a", 10)
    d.finish(call.request_id, 20, now=1.0)
    with pytest.raises(UnknownCall):
        d.finish(call.request_id, 20, now=2.0)


def test_completing_or_aborting_unknown_or_held_calls_raises() -> None:
    d = Driver(make({"w0": None}))
    assert isinstance(d.arrive("n", 10), Hold)
    with pytest.raises(UnknownCall):
        d.finish("n#1", 10)  # held, never dispatched
    with pytest.raises(UnknownCall):
        d.p.on_abort("nope", 1.0)


def test_the_same_call_arriving_twice_is_rejected() -> None:
    d = Driver(make())
    request = CallRequest("r1", SessionId("a"), 10)
    d.p.on_arrival(request, 0.0)
    with pytest.raises(ValueError):
        d.p.on_arrival(request, 1.0)


def test_illegal_transitions_raise() -> None:
    d = Driver(make())
    d.reasoning("r", 100)
    program = d.p.programs["r"]
    with pytest.raises(IllegalTransition):
        program.pause()  # a REASONING program cannot be paused: nothing is aborted
    program.mark()
    with pytest.raises(IllegalTransition):
        program.mark()
    d.acting("a", 10)
    with pytest.raises(IllegalTransition):
        d.p.programs["a"].mark()  # only REASONING programs are marked


def test_completion_after_operator_release_is_ignored() -> None:
    d = Driver(make())
    old = d.arrive("a", 100)
    assert d.p.release(SessionId("a"), 1.0, "operator") == [Release("a", "w0", "operator")]
    assert d.u() == 0.0
    again = d.arrive("a", 200, now=2.0)  # the session starts over
    assert d.p.on_complete(old.request_id, Usage(100, 10), 3.0) == []
    program = d.p.programs["a"]
    assert list(program.in_flight) == [again.request_id]
    assert program.context_tokens == 0 and program.steps == 0
    stale = d.arrive("b", 5, now=3.0)
    d.p.release(SessionId("b"), 3.5, "operator")
    assert d.p.on_abort(stale.request_id, 4.0) == []
    with pytest.raises(UnknownCall):
        d.p.on_abort(stale.request_id, 5.0)


def test_final_call_while_another_call_runs() -> None:
    d = Driver(make())
    other = d.arrive("a", 100)
    final = d.arrive("a", 100, now=1.0, final=True)
    assert sessions(d.finish(final.request_id, 150, now=2.0), Release) == ["a"]
    assert d.finish(other.request_id, 150, now=3.0) == []


def test_rehomed_program_is_not_forced_by_its_age() -> None:
    """Force-resume counts from when a program was parked, not from when it was created."""
    d = Driver(make({"w0": CAP, "w1": CAP}, force_resume_after_s=100.0, idle_release_s=1000.0))
    first = d.arrive("old", 10, now=0.0)
    assert first.worker == "w0"
    d.finish(first.request_id, 100, now=500.0)
    d.reasoning("fill", 900, now=500.0)  # w1 nearly full
    assert d.p.programs["fill"].home_worker == "w1"
    d.p.set_worker_health("w0", False, 501.0)  # "old" loses its home
    held = d.arrive("old", 100, now=502.0)     # w1 would reach 1.0: no room
    assert isinstance(held, Hold)
    actions = d.p.tick(503.0)
    assert of(actions, Admit) == [], "a 3-second wait must not count as 503 s"
    forced = d.p.tick(601.0)
    assert [a.request_id for a in of(forced, Admit)] == ["old#2"]


def test_program_rehomed_mid_call_brings_its_running_calls_demand() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}))
    old = d.reasoning("r", 600)  # w0
    d.acting("x", 400)           # w1
    assert old.worker == "w0" and d.p.programs["x"].home_worker == "w1"
    d.p.set_worker_health("w0", False, 1.0)  # r's call still runs there
    # r's next call needs a new worker; its running call may still grow to 600 tokens,
    # and w1 would reach 0.4 + 0.6 = 1.0 with it: no room (0.45 if that were forgotten).
    assert isinstance(d.arrive("r", 50, now=2.0), Hold)
    assert of(d.p.tick(3.0), Admit) == []
    assert d.u("w1") == pytest.approx(0.40)
    d.p.on_abort(old.request_id, 4.0)  # the dead worker's call is given up
    actions = d.p.tick(5.0)
    assert [(a.request_id, a.worker) for a in of(actions, Admit)] == [("r#3", "w1")]
    assert d.u("w1") == pytest.approx(0.45)


def test_idle_release_is_not_lost_to_float_rounding() -> None:
    d = Driver(make(idle_release_s=0.7))
    call = d.arrive("a", 10, now=0.0)
    last = 0.15 + 0.2
    deadline = last + 0.7
    assert deadline - last < 0.7  # the float trap: due by one test, not by the other
    d.finish(call.request_id, 20, now=last)
    d.p.tick(deadline)
    d.p.tick(5.0)
    assert "a" not in d.p.programs, "the idle deadline was dropped and never came back"


def test_reconfigured_aging_half_life_reorders_the_resume_queue() -> None:
    from scheduler.config import PolicyConfig

    policy = make({"w0": CAP})
    before = policy._resume._queue
    policy.reconfigure(policy.config.model_copy(update={"resume_aging_halflife_s": 5.0}))
    assert policy._resume._queue is not before
    assert policy.config.resume_aging_halflife_s == 5.0
    assert isinstance(policy.config, PolicyConfig)


# -- v2: bounded waiting, dormancy, reservations ---------------------------------------------


def test_a_call_held_max_wait_s_goes_ahead_on_its_home_without_room() -> None:
    d = Driver(make(max_wait_s=30.0, resume_priority_boost_s=0.0))
    _full_w0_with_paused(d, "p", 160, now=10.0)
    assert isinstance(d.arrive("p", 160, now=20.0), Hold)
    assert of(d.p.tick(49.9), Resume) == []
    actions = d.p.tick(50.0)
    assert of(actions, Resume) == [Resume("p", "w0", True)]
    assert [a.request_id for a in of(actions, Admit)] == ["p#2"]
    assert d.p.stats.wait_limit_resumes == 1 and d.p.stats.forced_resumes == 1


def test_a_new_program_held_max_wait_s_goes_to_the_emptiest_worker() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}, max_wait_s=30.0))
    d.reasoning("a", 900)
    d.reasoning("b", 850)
    assert isinstance(d.arrive("n", 400, now=1.0), Hold)
    actions = d.p.tick(31.0)
    [admit] = of(actions, Admit)
    assert (admit.request_id, admit.worker) == ("n#1", "w1")  # 850 < 900 tokens there


def test_max_wait_s_keeps_trying_while_no_worker_takes_programs() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}, max_wait_s=30.0))
    d.reasoning("a", 900)
    d.reasoning("b", 900)
    assert isinstance(d.arrive("n", 400, now=1.0), Hold)
    d.p.set_worker_health("w0", False, 2.0)
    d.p.set_worker_health("w1", False, 2.0)
    assert of(d.p.tick(31.0), Admit) == []
    d.p.set_worker_health("w1", True, 32.0)
    assert [a.request_id for a in of(d.p.tick(32.0), Admit)] == ["n#1"]


def _overdue_crowd(cap: int | None) -> Driver:
    """Two full workers and five new programs held at 1–5 s: all overdue by 40 s."""
    d = Driver(make({"w0": CAP, "w1": CAP}, max_wait_s=30.0, max_forced_per_tick=cap))
    d.reasoning("a", 900)
    d.reasoning("b", 900)
    for n in range(1, 6):
        assert isinstance(d.arrive(f"n{n}", 100, now=float(n)), Hold)
    return d


def test_forced_resumes_per_tick_are_capped_and_go_earliest_deadline_first() -> None:
    d = _overdue_crowd(cap=2)
    admitted = [[a.request_id for a in of(d.p.tick(now), Admit)] for now in (40.0, 40.1, 40.2, 40.3)]
    assert admitted == [["n1#1", "n2#1"], ["n3#1", "n4#1"], ["n5#1"], []]
    assert d.p.stats.wait_limit_resumes == d.p.stats.forced_resumes == 5


def test_without_the_cap_every_overdue_call_goes_in_one_tick() -> None:
    d = _overdue_crowd(cap=None)
    assert [a.request_id for a in of(d.p.tick(40.0), Admit)] == [f"n{n}#1" for n in range(1, 6)]


def test_overdue_calls_and_force_resumes_share_the_ticks_budget() -> None:
    d = Driver(make(force_resume_after_s=100.0, max_wait_s=30.0, max_forced_per_tick=2,
                    resume_priority_boost_s=0.0))
    d.reasoning("busy", 800)
    for sid in ("p", "q"):
        d.acting(sid, 100)
    assert sessions(d.p.tick(1.0), Pause) == ["p", "q"]  # parked at 1 s: forced at 101 s
    assert isinstance(d.arrive("n", 200, now=80.0), Hold)  # overdue at 110 s
    first = d.p.tick(110.0)
    assert [a.request_id for a in of(first, Admit)] == ["n#1"]  # the overdue call first
    assert sessions(first, Resume) == ["p"]
    assert sessions(d.p.tick(110.1), Resume) == ["q"]  # the rest at the next tick


def _learn_tool_times(d: Driver, seconds: float, count: int = 20, worker_sid: str = "warm") -> float:
    """Feed ``count`` tool calls of ``seconds`` each through a tiny program; returns the time."""
    now = 0.0
    decision = d.arrive(worker_sid, 1, now)
    for n in range(count):
        d.finish(decision.request_id, 1, now)
        now += seconds
        decision = d.arrive(worker_sid, 1, now, final=n == count - 1)
    d.finish(decision.request_id, 1, now)  # its last call: the program is released
    return now


def test_tool_time_cutoff_is_a_quantile_of_observed_tool_calls_with_a_floor() -> None:
    d = Driver(make(dormant_quantile=0.9, dormant_min_s=0.0))
    assert d.p.tool_time_cutoff() is None  # nothing observed yet
    _learn_tool_times(d, 3.0)
    assert d.p.tool_time_cutoff() == 3.0
    floored = Driver(make(dormant_quantile=0.9, dormant_min_s=10.0))
    _learn_tool_times(floored, 3.0)
    assert floored.p.tool_time_cutoff() == 10.0


def test_a_program_long_in_its_tool_call_stops_counting_but_keeps_its_kv_retained() -> None:
    d = Driver(make(dormant_quantile=0.5, dormant_min_s=0.0))
    now = _learn_tool_times(d, 2.0)
    d.acting("a", 600, now)
    before = d.u()
    d.p.tick(now + 1.9)
    assert not d.p.ledger.is_dormant("a")
    actions = d.p.tick(now + 2.0)
    assert of(actions, Demote) == []  # measured: demoting dormant KV costs hit rate
    assert d.p.ledger.is_dormant("a")
    assert d.u() == pytest.approx(before - 0.6)
    assert d.p.stats.dormant == 1
    # its next call goes home and it counts again
    decision = d.arrive("a", 650, now + 30.0)
    assert isinstance(decision, Admit) and decision.worker == "w0"
    assert not d.p.ledger.is_dormant("a")
    assert d.u() == pytest.approx(before - 0.6 + 0.65)


def test_a_dormant_program_returning_to_a_full_worker_goes_home_and_the_pause_pass_makes_room() -> None:
    d = Driver(make(dormant_quantile=0.5, dormant_min_s=0.0))
    now = _learn_tool_times(d, 2.0)
    d.acting("a", 600, now)
    d.p.tick(now + 2.0)
    d.acting("b", 350, now + 29.0)  # took part of the room a's KV held
    decision = d.arrive("a", 650, now + 30.0)
    assert isinstance(decision, Admit) and decision.worker == "w0"
    assert d.u() > d.p.config.pause_threshold
    actions = d.p.tick(now + 30.0)
    assert sessions(actions, Pause) == ["b"]  # the ACTING program goes; a is reasoning


def test_a_program_no_worker_can_resume_gets_a_reserved_worker_nothing_else_is_placed_on() -> None:
    d = Driver(make({"w0": CAP, "w1": CAP}))
    d.p.set_worker_health("w1", False, 0.0)
    d.acting("big", 900)  # more than the resume limit (0.85) of any worker
    d.reasoning("x", 50)
    d.p._pause_program(d.p.programs["big"], 1.0)
    d.acting("small", 100, now=1.0)
    d.p._pause_program(d.p.programs["small"], 1.0)
    for sid, tokens in (("big", 900), ("small", 100)):
        assert isinstance(d.arrive(sid, tokens, now=2.0), Hold)
    d.p.set_worker_health("w1", True, 2.0)
    actions = d.p.tick(3.0)
    assert d.p._placement.reservations.held() == {"w0": "big"}
    # the small program resumes on the other worker although its home has room
    assert of(actions, Resume) == [Resume("small", "w1", False)]
    # once nothing on the reserved worker is reasoning, the big program runs there
    d.finish("x#2", 50, 5.0)
    actions = d.p.tick(5.0)
    assert of(actions, Resume) == [Resume("big", "w0", True)]
    assert d.p._placement.reservations.held() == {}


def test_the_learnt_dormancy_cutoff_is_reported_as_an_adaptive_setting() -> None:
    d = Driver(make(dormant_quantile=0.5, dormant_min_s=0.0))
    assert "dormancy_cutoff_s" not in d.p.adaptive_settings()
    _learn_tool_times(d, 4.0)
    assert d.p.adaptive_settings()["dormancy_cutoff_s"] == 4.0


def _deep_overload(**keys) -> Driver:
    """w0 (1,000 tokens) runs 950; n1 (1,000) is held at t=1 with the fleet at 1.95 pools,
    n2 (1,050) at t=1 with it at 3.0 pools."""
    d = Driver(make(max_wait_s=30.0, resume_priority_boost_s=0.0, **{"max_wait_stretch": 4.0, **keys}))
    d.reasoning("a", 950)
    assert isinstance(d.arrive("n1", 1000, now=1.0), Hold)
    assert isinstance(d.arrive("n2", 1050, now=1.0), Hold)
    return d


def test_under_deep_overload_a_held_call_waits_max_wait_s_stretched_by_the_oversubscription() -> None:
    d = _deep_overload(wait_stretch_from=1.5)
    assert d.p._resume.oversubscription() == pytest.approx(3.0)
    assert d.p.adaptive_settings()["wait_stretch"] == pytest.approx(2.0)
    # held at 1.95 pools: 30 s × 1.3; at 3.0 pools: 30 s × 2
    assert of(d.p.tick(39.9), Admit) == []
    assert [a.request_id for a in of(d.p.tick(40.0), Admit)] == ["n1#1"]
    assert of(d.p.tick(60.9), Admit) == []
    assert [a.request_id for a in of(d.p.tick(61.0), Admit)] == ["n2#1"]


def test_the_stretch_is_capped_and_can_be_switched_off() -> None:
    capped = _deep_overload(wait_stretch_from=1.5, max_wait_stretch=1.5)
    assert [a.request_id for a in of(capped.p.tick(40.0), Admit)] == ["n1#1"]  # 1.3 < the cap
    assert of(capped.p.tick(45.9), Admit) == []
    assert [a.request_id for a in of(capped.p.tick(46.0), Admit)] == ["n2#1"]  # 30 s × 1.5
    off = _deep_overload(wait_stretch_from=None)
    assert off.p.adaptive_settings()["wait_stretch"] == 1.0
    assert of(off.p.tick(30.9), Admit) == []
    assert sorted(a.request_id for a in of(off.p.tick(31.0), Admit)) == ["n1#1", "n2#1"]


def test_a_clients_deadline_is_not_stretched() -> None:
    d = _deep_overload(wait_stretch_from=1.5)
    assert isinstance(d.arrive("n3", 10, now=1.0, hints=CallHints(deadline_s=5.0)), Hold)
    assert of(d.p.tick(5.9), Admit) == []
    assert [a.request_id for a in of(d.p.tick(6.0), Admit)] == ["n3#1"]


def test_an_overdue_call_goes_at_the_first_tick_after_a_worker_comes_back() -> None:
    d = Driver(make({"w0": CAP}, max_wait_s=30.0, tick_interval_s=5.0))
    d.reasoning("a", 900)
    assert isinstance(d.arrive("n", 400, now=1.0), Hold)
    d.p.set_worker_health("w0", False, 2.0)
    assert of(d.p.tick(31.0), Admit) == []  # overdue, but no worker takes programs
    d.p.set_worker_health("w0", True, 31.5)
    # the next tick comes sooner than tick_interval_s: the call must not wait for a retry slot
    assert [a.request_id for a in of(d.p.tick(32.0), Admit)] == ["n#1"]


# -- the client's hints (scheduler.calls.CallHints) ------------------------------------------


def test_a_clients_deadline_shortens_max_wait_s() -> None:
    d = Driver(make(max_wait_s=30.0, resume_priority_boost_s=0.0))
    _full_w0_with_paused(d, "p", 160, now=10.0)
    assert isinstance(d.arrive("p", 160, now=20.0, hints=CallHints(deadline_s=5.0)), Hold)
    assert of(d.p.tick(24.9), Resume) == []
    assert of(d.p.tick(25.0), Resume) == [Resume("p", "w0", True)]


def test_a_clients_deadline_bounds_a_wait_that_max_wait_s_leaves_unbounded() -> None:
    d = Driver(make(max_wait_s=None, resume_priority_boost_s=0.0))
    _full_w0_with_paused(d, "p", 160, now=10.0)
    assert isinstance(d.arrive("p", 160, now=20.0, hints=CallHints(deadline_s=100.0)), Hold)
    assert of(d.p.tick(119.0), Resume) == []
    assert of(d.p.tick(120.0), Resume) == [Resume("p", "w0", True)]


def test_expected_output_length_replaces_the_growth_reserve_in_a_calls_demand() -> None:
    d = Driver(make(growth_reserve_tokens=200))
    d.arrive("a", 100)
    assert d.u() == pytest.approx(0.30)
    d.arrive("b", 100, hints=CallHints(expected_output_tokens=20))
    assert d.u() == pytest.approx(0.30 + 0.12)


def test_among_programs_waiting_for_room_the_clients_higher_priority_resumes_first() -> None:
    d = Driver(make(resume_priority_boost_s=0.0))
    d.acting("big", 900)
    assert isinstance(d.arrive("low", 100, now=1.0), Hold)  # smaller: first without priorities
    assert isinstance(d.arrive("high", 150, now=2.0, hints=CallHints(priority=5)), Hold)
    d.finish(d.arrive("big", 900, now=3.0).request_id, 650, now=4.0)  # room for one of them
    admitted = of(d.p.tick(5.0), Admit)
    assert [a.session_id for a in admitted] == ["high"]


def test_a_clients_retention_ttl_is_its_programs_dormancy_cutoff_for_that_tool_call() -> None:
    d = Driver(make(dormant_quantile=None))
    d.acting("a", 600, now=0.0, hints=CallHints(retention_ttl_s=4.0))
    d.p.tick(3.9)
    assert not d.p.ledger.is_dormant("a")
    d.p.tick(4.0)
    assert d.p.ledger.is_dormant("a")


# -- groups (CallRequest.group_id) ------------------------------------------------------------


def test_a_new_program_joins_a_sibling_of_its_group_that_shares_its_prompt() -> None:
    chain = mint_chain("m", None, None, [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}])
    tokens = (0, 150, 300)
    group = SessionId("task-1")
    for grouped in (False, True):
        d = Driver(make({"w0": CAP, "w1": CAP}))
        d.reasoning("other", 100)  # on w0
        sibling = d.arrive("s1", 300, chain=chain, chain_tokens=tokens,
                           group_id=group if grouped else None)
        assert sibling.worker == "w1"  # the emptier one
        assert (d.u("w0"), d.u("w1")) == (pytest.approx(0.10), pytest.approx(0.30))
        sample = d.arrive("s2", 300, chain=chain, chain_tokens=tokens,
                          group_id=group if grouped else None)
        # without the group it goes by load; with it, the 300 prompt tokens it shares with
        # s1 count as resident on w1: credit 0.30 − U 0.30 beats 0 − 0.10
        assert sample.worker == ("w1" if grouped else "w0"), grouped
    assert d.p.groups == {group: {"s1", "s2"}}
    d.p.release(SessionId("s1"), 1.0, "test")
    d.p.release(SessionId("s2"), 1.0, "test")
    assert d.p.groups == {}


def test_an_estimated_prompt_is_refined_from_the_engines_count_of_the_answered_call() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    first = mint_chain("m", None, None, messages)
    later = mint_chain("m", None, None, [*messages, {"role": "assistant", "content": "a"},
                                         {"role": "tool", "content": "out"}])
    d = Driver(make())
    admit = d.arrive("a", 300, chain=first, chain_tokens=(0, 100, 300), prompt_estimated=True)
    d.p.on_complete(admit.request_id, Usage(prompt_tokens=280, completion_tokens=40), 1.0)
    d.arrive("a", 420, now=2.0, chain=later, chain_tokens=(0, 100, 300, 350, 420),
             prompt_estimated=True)
    # its demand: 320 counted by the engine + 70 estimated after the answer, not 420
    assert d.u() == pytest.approx(0.39)


def test_with_a_host_tier_a_worker_of_unknown_capacity_takes_nothing_and_breaks_no_tick():
    """A worker added before its /metrics is read has no capacity: it takes no program, and
    the tier's "runs all its programs" test does not compare against it."""
    d = Driver(make({"w0": CAP, "w1": None}, retention={"host_tier": True}))
    assert d.acting("a", 900) == "w0"
    actions = d.p.tick(1.0)
    assert of(actions, Pause) == [] and d.p.programs[SessionId("a")].home_worker == "w0"
    assert not d.p.in_soft_band("w1")
