"""The baselines behave as their sources document (architecture.md §4; sources in each policy's
docstring): VERL's least-loaded router, Dynamo's KV router, SkyRL's sticky least-loaded,
ThunderAgent as published, Continuum's TTL pinning (CacheTTL's τ* in test_continuum.py), and
plain round robin."""

from __future__ import annotations

import pytest

from scheduler.actions import Admit, Demote, Hold, Mark, Pause, Release, Resume, Retain
from scheduler.calls import CallRequest, Usage
from scheduler.config import POLICY_NAMES, ConfigError, ProgramAwareConfig, ThunderAgentConfig
from scheduler.config_reading import make_policy_config, parse_policy_config
from scheduler.coordinates import SessionId, mint_chain
from scheduler.kv_events import BlockStored, EventBatch
from scheduler.policies import POLICIES, make_policy


def make(name: str, workers: dict[str, int | None] | None = None, **keys):
    """Policy ``name`` with ``keys`` of its own section (and no growth reserve)."""
    policy = make_policy(make_policy_config({"name": name, "growth_reserve_tokens": 0, **keys}))
    for worker, cap in (workers if workers is not None else {"w0": 10_000}).items():
        policy.add_worker(worker, cap)
    return policy


class Driver:
    def __init__(self, policy) -> None:
        self.p = policy
        self._n: dict[str, int] = {}

    def arrive(self, sid: str, prompt: int = 10, now: float = 0.0, **kw) -> Admit | Hold:
        self._n[sid] = self._n.get(sid, 0) + 1
        return self.p.on_arrival(CallRequest(f"{sid}#{self._n[sid]}", SessionId(sid), prompt, **kw), now)

    def finish(self, rid: str, context: int = 10, now: float = 0.0) -> list:
        return self.p.on_complete(rid, Usage(prompt_tokens=context, completion_tokens=0), now)

    def acting(self, sid: str, context: int, now: float = 0.0) -> str:
        decision = self.arrive(sid, 1, now)
        assert isinstance(decision, Admit), decision
        self.finish(decision.request_id, context, now)
        return decision.worker

    def reasoning(self, sid: str, tokens: int, now: float = 0.0) -> Admit:
        self.acting(sid, 1, now)
        decision = self.arrive(sid, tokens, now)
        assert isinstance(decision, Admit), decision
        return decision


def of(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def sessions(actions: list, kind: type) -> list[str]:
    return [a.session_id for a in of(actions, kind)]


def stored(hashes: list[int], session: str, block_size: int = 16) -> EventBatch:
    event = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                        block_size=block_size, lora_id=None, medium=None, lora_name=None,
                        session_id=session)
    return EventBatch(ts=0.0, events=[event])


THREE = {"w0": 10_000, "w1": 10_000, "w2": 10_000}


def test_every_configured_policy_name_builds() -> None:
    assert set(POLICIES) == set(POLICY_NAMES)
    for name in POLICY_NAMES:
        policy = make(name)
        assert policy.name == name
        assert policy.tick(0.0) == []


# -- round robin -----------------------------------------------------------------------------


def test_round_robin_cycles_through_workers_ignoring_sessions() -> None:
    d = Driver(make("round_robin", THREE))
    workers = [d.arrive(sid).worker for sid in ["a", "a", "b", "a", "c", "b"]]
    assert workers == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_round_robin_skips_unhealthy_workers() -> None:
    d = Driver(make("round_robin", THREE))
    d.p.set_worker_health("w1", False, 0.0)
    assert [d.arrive(f"s{i}").worker for i in range(4)] == ["w0", "w2", "w0", "w2"]


def test_routers_hold_only_without_a_healthy_worker_and_admit_on_tick() -> None:
    d = Driver(make("round_robin", {"w0": 100}))
    d.arrive("a", 5_000)  # far over capacity: routers have no admission control
    d.p.set_worker_health("w0", False, 1.0)
    held = d.arrive("a", 10, now=2.0)
    assert isinstance(held, Hold)
    assert d.p.tick(3.0) == []
    d.p.set_worker_health("w0", True, 4.0)
    assert d.p.tick(5.0) == [Admit("a#2", "a", "w0", 2.0)]


def test_router_admits_held_call_after_a_later_call_of_the_same_session() -> None:
    d = Driver(make("least_loaded", {"w0": 100}))
    d.p.set_worker_health("w0", False, 0.0)
    assert isinstance(d.arrive("a", now=1.0), Hold)
    d.p.set_worker_health("w0", True, 2.0)
    later = d.arrive("a", now=3.0)  # arrives before the next tick, goes straight through
    assert isinstance(later, Admit)
    assert d.p.tick(4.0) == [Admit("a#1", "a", "w0", 1.0)]
    assert set(d.p.programs["a"].in_flight) == {"a#1", "a#2"}


# -- least_loaded (VERL) ---------------------------------------------------------------------


def test_least_loaded_picks_fewest_in_flight_first_on_ties() -> None:
    d = Driver(make("least_loaded", THREE))
    a, b, c = (d.arrive(s) for s in "abc")
    assert [a.worker, b.worker, c.worker] == ["w0", "w1", "w2"]
    d.arrive("d")  # all at one: the first worker
    d.finish(b.request_id)
    assert d.arrive("e").worker == "w1"  # w1 is the only one with nothing in flight


def test_least_loaded_counts_calls_not_tokens() -> None:
    d = Driver(make("least_loaded", {"w0": 10_000, "w1": 10_000}))
    d.arrive("big", 9_000)                 # w0: one huge call
    d.arrive("s1", 10)                     # w1
    d.arrive("s2", 10)                     # tie 1:1 → w0
    assert d.arrive("s3", 10).worker == "w1"


def test_least_loaded_is_sticky_by_session() -> None:
    d = Driver(make("least_loaded", {"w0": 10_000, "w1": 10_000}))
    assert d.arrive("a").worker == "w0"
    assert d.arrive("b").worker == "w1"
    assert d.arrive("c").worker == "w0"  # w0: 2 in flight, w1: 1
    assert d.arrive("a").worker == "w0"  # back to its worker, not the least loaded


def _lru_scenario(size: int) -> str:
    d = Driver(make("least_loaded", {"w0": 10_000, "w1": 10_000},
                    sticky_lru_size=size))
    assert d.arrive("a").worker == "w0"
    assert d.arrive("b").worker == "w1"
    assert d.arrive("c").worker == "w0"  # w0: 2 in flight, w1: 1
    return d.arrive("a").worker


def test_least_loaded_lru_eviction_makes_a_session_repick() -> None:
    assert _lru_scenario(10_000) == "w0"  # remembered: back to w0
    assert _lru_scenario(2) == "w1"       # "a" fell out of the LRU: least loaded now


def test_least_loaded_lru_refreshes_on_use() -> None:
    d = Driver(make("least_loaded", {"w0": 10_000, "w1": 10_000},
                    sticky_lru_size=2))
    d.arrive("a")       # w0
    d.arrive("b")       # w1
    d.arrive("a")       # w0 again; "a" is now the most recent, "b" the oldest
    d.arrive("c")       # evicts "b"
    assert d.arrive("a").worker == "w0"


def test_least_loaded_leaves_an_unhealthy_sticky_worker() -> None:
    d = Driver(make("least_loaded", {"w0": 10_000, "w1": 10_000}))
    first = d.arrive("a")
    d.finish(first.request_id)
    d.p.set_worker_health(first.worker, False, 1.0)
    assert d.arrive("a", now=2.0).worker != first.worker


# -- kv_aware (Dynamo KV router) -------------------------------------------------------------


def test_kv_aware_routes_to_resident_prefix() -> None:
    d = Driver(make("kv_aware", {"w0": 10_000, "w1": 10_000}))
    d.p.observe_kv("w1", stored([1, 2, 3, 4], "someone"))
    decision = d.arrive("a", 64, block_hashes=(1, 2, 3, 4))
    assert decision.worker == "w1"


def test_kv_aware_partial_prefix_counts_only_resident_leading_blocks() -> None:
    d = Driver(make("kv_aware", {"w0": 10_000, "w1": 10_000}))
    d.p.observe_kv("w0", stored([1, 2], "x"))
    d.p.observe_kv("w1", stored([9, 2, 3, 4], "y"))  # blocks 2..4 but not the first
    assert d.arrive("a", 64, block_hashes=(1, 2, 3, 4)).worker == "w0"


def _kv_load_scenario(weight: float) -> str:
    d = Driver(make("kv_aware", {"w0": 10_000, "w1": 10_000},
                    kv_overlap_score_weight=weight))
    d.p.observe_kv("w1", stored([1, 2, 3, 4], "someone"))
    d.p.set_worker_health("w0", False, 0.0)
    d.arrive("busy", 100)  # 100 tokens of work in flight on w1
    d.p.set_worker_health("w0", True, 0.0)
    # cost(w0) = weight·64 + 64; cost(w1) = weight·0 + (100 + 64)
    return d.arrive("a", 64, block_hashes=(1, 2, 3, 4)).worker


def test_kv_aware_load_can_outweigh_the_prefix() -> None:
    assert _kv_load_scenario(1.0) == "w0"  # 128 < 164
    assert _kv_load_scenario(2.0) == "w1"  # 192 > 164


def test_kv_aware_load_is_released_on_completion() -> None:
    d = Driver(make("kv_aware", {"w0": 10_000, "w1": 10_000}))
    busy = d.arrive("busy", 500)
    assert busy.worker == "w0"
    d.finish(busy.request_id, 600)
    assert d.arrive("b", 100).worker == "w0"  # equal cost again: the emptier index, then name


def test_kv_aware_tie_breaks_to_fewer_resident_blocks() -> None:
    d = Driver(make("kv_aware", {"w0": 10_000, "w1": 10_000}))
    d.p.observe_kv("w0", stored([7, 8], "other"))
    assert d.arrive("a", 64, block_hashes=(1, 2, 3, 4)).worker == "w1"


def test_kv_aware_never_holds_or_pauses() -> None:
    d = Driver(make("kv_aware", {"w0": 100}))
    for i in range(5):
        assert isinstance(d.arrive(f"s{i}", 5_000), Admit)
    assert d.p.tick(10.0) == []


# -- sticky_least_loaded (SkyRL) -------------------------------------------------------------


def _active_sessions(policy) -> dict[str, int]:
    counts = {w: 0 for w in policy.ledger.worker_names()}
    for program in policy.programs.values():
        if program.active:
            counts[program.home_worker] += 1
    return counts


def test_sticky_least_loaded_picks_fewest_active_sessions() -> None:
    d = Driver(make("sticky_least_loaded", THREE))
    for i in range(9):
        before = _active_sessions(d.p)
        worker = d.arrive(f"s{i}").worker
        assert before[worker] == min(before.values())
    assert _active_sessions(d.p) == {"w0": 3, "w1": 3, "w2": 3}


def test_sticky_least_loaded_balances_sessions_not_calls() -> None:
    d = Driver(make("sticky_least_loaded", {"w0": 10_000, "w1": 10_000}))
    d.p.set_worker_health("w1", False, 0.0)
    for _ in range(6):
        assert d.arrive("busy").worker == "w0"  # one session, six calls in flight
    d.p.set_worker_health("w1", True, 0.0)
    d.p.set_worker_health("w0", False, 0.0)  # "busy" runs: it stays on w0
    d.acting("idle1", 10)
    d.acting("idle2", 10)                    # w1: two sessions, nothing in flight
    d.p.set_worker_health("w0", True, 0.0)
    assert _active_sessions(d.p) == {"w0": 1, "w1": 2}
    assert d.arrive("new").worker == "w0"


def test_sticky_least_loaded_is_sticky() -> None:
    d = Driver(make("sticky_least_loaded", {"w0": 10_000, "w1": 10_000}))
    home = d.acting("a", 100)
    other = "w1" if home == "w0" else "w0"
    d.arrive("b")  # goes to `other`
    d.p.release(SessionId("b"), 1.0, "finished")
    assert _active_sessions(d.p)[other] == 0
    for t in range(3):
        assert d.arrive("a", now=2.0 + t).worker == home  # though `other` is empty


def _tie_choices(worker_order: list[str]) -> list[str]:
    policy = make("sticky_least_loaded", {n: 10_000 for n in worker_order})
    chosen = []
    for i in range(24):
        sid = SessionId(f"session-{i}")
        chosen.append(policy.on_arrival(CallRequest(f"r{i}", sid, 10), 0.0).worker)
        policy.release(sid, 0.0, "done")  # every worker tied again for the next one
    return chosen


def test_sticky_least_loaded_tie_break_is_deterministic_rendezvous() -> None:
    names = [f"w{i}" for i in range(4)]
    chosen = _tie_choices(names)
    assert _tie_choices(names) == chosen                  # repeatable
    assert _tie_choices(names[::-1]) == chosen            # not "the first worker listed"
    assert _tie_choices(names[1:] + names[:1]) == chosen
    assert len(set(chosen)) > 1                           # spread by the hash
    # rendezvous: removing a worker moves only the sessions that had chosen it
    without_w2 = _tie_choices([n for n in names if n != "w2"])
    for before, after in zip(chosen, without_w2):
        if before != "w2":
            assert after == before


def test_sticky_least_loaded_releases_idle_sessions() -> None:
    d = Driver(make("sticky_least_loaded", {"w0": 10_000}, idle_release_s=30.0))
    call = d.arrive("a", now=0.0)
    d.finish(call.request_id, now=10.0)
    assert d.p.tick(39.9) == []
    assert d.p.tick(40.0) == [Release("a", "w0", "idle")]
    assert "a" not in d.p.programs


def test_sticky_least_loaded_moves_sessions_off_an_unhealthy_worker() -> None:
    d = Driver(make("sticky_least_loaded", {"w0": 10_000, "w1": 10_000}))
    home = d.acting("a", 100)
    d.p.set_worker_health(home, False, 1.0)
    assert d.arrive("a", now=2.0).worker != home


# -- thunderagent (as published) -------------------------------------------------------------


def test_thunderagent_uses_the_published_constants() -> None:
    policy = make("thunderagent")
    assert policy.tick_interval_s == 5.0
    assert policy.ledger.weights.buffer_per_program == 100
    assert make("thunderagent", scheduler_interval_s=2.5).tick_interval_s == 2.5
    # the published thresholds are not settable: program_aware's keys are refused by name
    for key, value in (("pause_threshold", 0.5), ("retention", {"enabled": True}), ("max_wait_s", 5.0)):
        with pytest.raises(ConfigError, match=f"policy: {key}: a key of program_aware; thunderagent"):
            parse_policy_config({"name": "thunderagent", key: value})


def test_thunderagent_reconfigure_takes_tick_and_refuses_another_kind() -> None:
    policy = make("thunderagent")
    policy.reconfigure(ThunderAgentConfig(scheduler_interval_s=10.0))
    assert policy.tick_interval_s == 10.0
    with pytest.raises(ValueError, match="cannot switch policy"):
        policy.reconfigure(ProgramAwareConfig())


def test_thunderagent_pauses_only_over_capacity() -> None:
    d = Driver(make("thunderagent"))
    d.acting("a", 3000)
    d.acting("b", 3000)
    d.acting("c", 3700)  # 9,700 + 3×100 = 10,000: at capacity, not over
    assert d.p.ledger.utilization("w0") == pytest.approx(1.0)
    assert d.p.tick(5.0) == []
    grow = d.arrive("c", 10, now=6.0)
    d.finish(grow.request_id, 3800, now=7.0)  # 10,100: over
    actions = d.p.tick(10.0)
    assert sessions(actions, Pause) == ["a"]  # smallest (ties by name), then under again


def test_thunderagent_does_not_pause_in_program_aware_band() -> None:
    d = Driver(make("thunderagent"))
    d.acting("a", 4000)
    d.acting("b", 5400)  # U = 0.96: program_aware would pause, ThunderAgent does not
    assert d.p.tick(5.0) == []


def test_thunderagent_pauses_smallest_acting_until_not_over() -> None:
    d = Driver(make("thunderagent"))
    d.reasoning("r", 3900)
    for sid, ctx in [("a4000", 4000), ("a1000", 1000), ("a2000", 2000)]:
        d.acting(sid, ctx)
    # 10,900 + 4×100 = 11,300: pausing a1000 frees 1,100, a2000 another 2,100.
    actions = d.p.tick(5.0)
    assert sessions(actions, Pause) == ["a1000", "a2000"]
    assert of(actions, Mark) == []
    assert of(actions, Demote) == []


def test_thunderagent_marks_every_reasoning_program_once_acting_runs_out() -> None:
    d = Driver(make("thunderagent"))
    d.acting("a500", 500)
    for sid, tokens in [("r4000", 4000), ("r3000a", 3000), ("r3000b", 3000)]:
        d.reasoning(sid, tokens)
    # 10,500 + 400 = 10,900 → pause a500 (−600) → still 300 over: mark them all.
    actions = d.p.tick(5.0)
    assert sessions(actions, Pause) == ["a500"]
    assert sorted(sessions(actions, Mark)) == ["r3000a", "r3000b", "r4000"]
    assert d.p.tick(10.0) == []  # nothing left to mark


def test_thunderagent_resumes_worst_fit_largest_first() -> None:
    d = Driver(make("thunderagent", {"w0": 10_000, "w1": 10_000}))
    d.p.set_worker_health("w0", False, 0.0)
    d.reasoning("w1-load", 1900)  # w1: 1,900 + 100 → 8,000 remaining
    d.p.set_worker_health("w0", True, 0.0)
    d.p.set_worker_health("w1", False, 0.0)  # in flight: stays on w1
    d.reasoning("r", 7000)
    d.acting("small", 1000)
    d.acting("big", 3000)
    actions = d.p.tick(5.0)  # 11,000 + 300 over 10,000: both pause; 2,900 left on w0
    assert sessions(actions, Pause) == ["small", "big"]
    d.p.set_worker_health("w1", True, 6.0)
    actions = d.p.tick(10.0)
    # largest first onto the most remaining (w1: 8,000), then again the most remaining
    # (w1: 4,900 > w0: 2,900) — best fit or home-first would put "small" back on w0.
    assert of(actions, Resume) == [Resume("big", "w1", False), Resume("small", "w1", False)]


def test_thunderagent_new_program_queues_behind_any_queued_program() -> None:
    d = Driver(make("thunderagent"))
    d.reasoning("r", 9500)
    d.acting("p", 1000)
    assert sessions(d.p.tick(5.0), Pause) == ["p"]  # p is queued, with no call waiting
    d.p.add_worker("w1", 10_000)
    held = d.arrive("n", 100, now=6.0)  # w1 is empty, but the queue is not
    assert isinstance(held, Hold)
    actions = d.p.tick(10.0)
    assert {a.session_id for a in of(actions, Admit)} == {"n"}
    assert sessions(actions, Resume) == ["p"]


def test_thunderagent_new_program_goes_to_fewest_active_tokens() -> None:
    d = Driver(make("thunderagent", THREE))
    d.acting("a", 3000)  # w0
    d.acting("b", 1000)  # w1 (w0 has more tokens; w1 and w2 tie → first)
    assert d.p.programs["b"].home_worker == "w1"
    assert d.arrive("c", 100).worker == "w2"


def test_thunderagent_emits_no_retention_directives() -> None:
    d = Driver(make("thunderagent", {"w0": 10_000, "w1": 10_000}, idle_release_s=100.0))
    d.p.set_worker_health("w1", False, 0.0)
    d.reasoning("r", 9000)
    d.acting("p", 1000)
    actions = d.p.tick(5.0)
    d.p.set_worker_health("w1", True, 6.0)
    actions += d.p.tick(10.0) + d.p.tick(200.0)
    assert of(actions, Pause) and of(actions, Resume)
    assert of(actions, Retain) == [] and of(actions, Demote) == []


def test_thunderagent_forced_resume_to_origin_after_timeout() -> None:
    d = Driver(make("thunderagent", force_resume_after_s=1800.0, idle_release_s=10_000.0))
    d.reasoning("r", 9500)
    d.acting("p", 1000)
    d.p.tick(5.0)
    assert d.p.tick(1804.0) == []
    assert of(d.p.tick(1805.0), Resume) == [Resume("p", "w0", True)]


# -- continuum -------------------------------------------------------------------------------


def test_continuum_never_holds_while_a_worker_is_healthy() -> None:
    d = Driver(make("continuum", {"w0": 1_000}))
    for i in range(10):
        assert isinstance(d.arrive(f"s{i}", 5_000, now=float(i)), Admit)
    actions = d.p.tick(20.0)
    assert of(actions, Pause) == [] and of(actions, Mark) == []


def test_continuum_retains_after_each_response_with_cold_start_ttl() -> None:
    d = Driver(make("continuum", ttl_s=3.0, pin_priority=77))
    chain = mint_chain("m", None, None, ["hello"])
    call = d.arrive("a", 100, now=0.0, chain=chain)
    actions = d.finish(call.request_id, 150, now=1.0)
    assert actions == [Retain("a", "w0", 77, 3.0, chain.head)]
    second = d.arrive("a", 160, now=2.0)
    assert d.finish(second.request_id, 200, now=3.0) == [Retain("a", "w0", 77, 3.0, chain.head)]


def test_continuum_default_cold_start_is_two_seconds() -> None:
    d = Driver(make("continuum"))
    call = d.arrive("a")
    assert [r.ttl_s for r in d.finish(call.request_id)] == [2.0]


def test_continuum_orders_calls_by_program_arrival() -> None:
    d = Driver(make("continuum"))
    first = d.arrive("old", now=5.0)
    d.finish(first.request_id, now=6.0)
    newcomer = d.arrive("new", now=50.0)
    later_turn = d.arrive("old", now=100.0)
    assert newcomer.priority == 50.0
    assert later_turn.priority == 5.0  # FCFS by the program's first arrival


def test_continuum_is_sticky() -> None:
    d = Driver(make("continuum", {"w0": 10_000, "w1": 10_000}))
    home = d.acting("a", 10)
    d.arrive("b")
    d.arrive("c")
    assert d.arrive("a", now=5.0).worker == home


@pytest.mark.parametrize("name", sorted(POLICY_NAMES))
def test_a_drained_worker_can_be_removed_and_calls_go_to_the_rest(name):
    policy = make_policy(make_policy_config({"name": name}))
    for worker in ("w0", "w1"):
        policy.add_worker(worker, 1_000_000)
    first = policy.on_arrival(CallRequest("r1", "s1", prompt_tokens=100), 0.0)
    assert isinstance(first, Admit)
    gone = first.worker
    with pytest.raises(ValueError, match="in flight"):
        policy.remove_worker(gone, 0.5)
    policy.on_complete("r1", Usage(100, 10), 1.0)
    policy.remove_worker(gone, 2.0)
    assert gone not in policy.healthy_workers() and gone not in policy.index.workers()
    later = policy.on_arrival(CallRequest("r2", "s1", prompt_tokens=120), 3.0)
    assert isinstance(later, Admit) and later.worker != gone
