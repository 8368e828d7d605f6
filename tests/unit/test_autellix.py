"""The autellix baseline (scheduler/policies/autellix.py) behaves as Autellix's paper
describes (arXiv 2502.13965): PLAS priorities from the program's finished calls, discretised
into queues, anti-starvation by the program's wait/service ratio, and Algorithm 2's load
balancer (short calls to the least-used engine, long ones to their program's engine)."""

from __future__ import annotations

import pytest

from scheduler.actions import Admit, Hold, Release, engine_priority
from scheduler.calls import CallRequest, Usage
from scheduler.config import AutellixConfig
from scheduler.coordinates import SessionId
from scheduler.policies import make_policy
from scheduler.policies.autellix import QUEUE_TIER_S, AutellixPolicy, call_service_s, queue_bounds
from sim.engine import Engine, EngineRequest
from sim.step_time import preset

SHORT = 1_000   # ≤ 2048 prompt tokens: balanced across engines
LONG = 8_000    # > 2048: pinned to the program's engine
DEFAULTS = AutellixConfig()


def make(workers: tuple[str, ...] = ("w0", "w1", "w2"), **keys) -> AutellixPolicy:
    policy = make_policy(AutellixConfig(**keys))
    for worker in workers:
        policy.add_worker(worker, 100_000)
    assert isinstance(policy, AutellixPolicy)
    return policy


class Driver:
    def __init__(self, policy: AutellixPolicy) -> None:
        self.p = policy
        self._calls: dict[str, int] = {}

    def arrive(self, sid: str, prompt: int = SHORT, now: float = 0.0, final: bool = False) -> Admit | Hold:
        self._calls[sid] = self._calls.get(sid, 0) + 1
        request = CallRequest(f"{sid}#{self._calls[sid]}", SessionId(sid), prompt, final=final)
        return self.p.on_arrival(request, now)

    def finish(self, admit: Admit, output: int, now: float = 0.0, prompt: int = SHORT,
               cached: int = SHORT) -> list:
        return self.p.on_complete(admit.request_id, Usage(prompt, output, cached), now)

    def served(self, sid: str, output: int, at: float = 0.0, took_s: float = 0.0) -> None:
        """One call of ``sid`` that arrives at ``at``, produces ``output`` tokens and
        completes ``took_s`` later (its prompt fully cached: only decode counts)."""
        admit = self.arrive(sid, now=at)
        assert isinstance(admit, Admit)
        self.finish(admit, output, now=at + took_s)


def level(admit: Admit, arrived_at: float) -> float:
    """The PLAS queue an admission's priority puts it in (its offset past the arrival)."""
    return (admit.priority - arrived_at) / QUEUE_TIER_S


# -- PLAS priorities -------------------------------------------------------------------------


def test_queue_bounds_are_geometric_and_service_counts_decode_and_computed_prefill() -> None:
    assert queue_bounds(DEFAULTS) == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
    assert queue_bounds(AutellixConfig(queues=1)) == ()
    # 100 output tokens at 20 ms plus 10k computed prompt tokens at 36 µs
    assert call_service_s(Usage(12_000, 100, 2_000), DEFAULTS) == pytest.approx(2.0 + 0.36)
    # a fully cached prompt costs nothing
    assert call_service_s(Usage(12_000, 0, 12_000), DEFAULTS) == 0.0


def test_priority_orders_programs_by_attained_service() -> None:
    d = Driver(make())
    # service: none, 0.2 s, 2 s, 20 s, 100 s (outputs at 20 ms per token)
    for sid, output in [("b", 10), ("c", 100), ("d", 1_000), ("e", 5_000)]:
        d.served(sid, output, took_s=output * 0.02)  # no waiting: latency = service
    priorities = {sid: d.arrive(sid, now=200.0).priority for sid in "abcde"}
    assert priorities == {"a": 200.0, "b": 200.0, "c": 200.0 + 2 * QUEUE_TIER_S,
                          "d": 200.0 + 5 * QUEUE_TIER_S, "e": 200.0 + 7 * QUEUE_TIER_S}


def test_programs_in_the_same_queue_tie_and_the_engine_serves_them_in_arrival_order() -> None:
    d = Driver(make(("w0",)))
    d.served("x", 150, took_s=3.0)  # 3 s: Q_3 = [2, 4)
    d.served("y", 180, took_s=3.6)  # 3.6 s: Q_3 too
    first, second = d.arrive("y", now=10.0), d.arrive("x", now=10.5)
    assert level(first, 10.0) == level(second, 10.5) == 2.0
    # as an engine sees them (relative to dispatch) they tie, and the engine breaks the tie
    # by admission order: FCFS within a queue
    assert engine_priority(first.priority, 10.0) == engine_priority(second.priority, 10.5)
    engine = Engine("w0", preset("llama3.1-8b-h100"), block_size=64)
    for admit, at in ((first, 10.0), (second, 10.5)):
        engine.add_request(EngineRequest(admit.request_id, admit.session_id, [], 64, 1,
                                         priority=engine_priority(admit.priority, at),
                                         arrival=at), at)
    assert [entry[2].request_id for entry in sorted(engine.waiting)] == [first.request_id,
                                                                        second.request_id]


def test_queues_stay_strict_tiers_and_fcfs_inside_once_relative_to_dispatch() -> None:
    """What an engine sees (milliseconds relative to dispatch): a call held 400 s still goes
    after every call of a better queue, and before the calls of its own queue that arrived
    after it."""
    d = Driver(make(("w0",)))
    d.served("q3", 150, at=0.0, took_s=3.0)   # 3 s: Q_3 (index 2)
    d.served("q2", 75, at=0.0, took_s=1.5)    # 1.5 s: Q_2 (index 1)
    d.served("q3b", 160, at=0.0, took_s=3.2)  # Q_3 too
    d.p.set_worker_health("w0", False, 10.0)
    assert isinstance(d.arrive("q3", now=10.0), Hold)
    d.p.set_worker_health("w0", True, 410.0)
    (held,) = d.p.tick(410.0)
    fresh = {sid: d.arrive(sid, now=410.0) for sid in ("q3b", "q2", "new")}
    seen = {"held q3": engine_priority(held.priority, 410.0),
            **{sid: engine_priority(admit.priority, 410.0) for sid, admit in fresh.items()}}
    assert seen == {"new": 0, "q2": 10**9, "held q3": 2 * 10**9 - 400_000, "q3b": 2 * 10**9}
    assert sorted(seen, key=seen.__getitem__) == ["new", "q2", "held q3", "q3b"]


def test_only_finished_calls_count_and_an_abort_adds_nothing() -> None:
    d = Driver(make())
    running = d.arrive("a")
    assert d.p.queue_index(SessionId("a")) == 0  # a call in flight is not attained service
    d.p.on_abort(running.request_id, 5.0)
    assert d.arrive("a", now=6.0).priority == 6.0  # Q_1
    assert SessionId("a") not in d.p.process_table  # short calls pin nothing, nothing served


def test_re_prefilled_prompt_tokens_are_service() -> None:
    d = Driver(make())
    admit = d.arrive("a", LONG)
    d.finish(admit, 10, now=1.0, prompt=40_000, cached=0)  # 0.2 s decode + 1.44 s prefill
    assert d.p.process_table[SessionId("a")].service_s == pytest.approx(1.64)
    assert level(d.arrive("a", LONG, now=2.0), 2.0) == 1.0


def test_anti_starvation_promotes_a_program_that_waited_beta_times_its_service() -> None:
    d = Driver(make())
    d.served("patient", 100, took_s=20.0)  # 2 s of service, 18 s waiting: 9 ≥ β = 8
    d.served("served", 100, took_s=10.0)   # 2 s of service, 8 s waiting: 4 < 8
    assert d.p.process_table[SessionId("patient")].wait_s == pytest.approx(18.0)
    assert level(d.arrive("patient", now=30.0), 30.0) == 0.0
    assert level(d.arrive("served", now=30.0), 30.0) == 2.0
    # β is a knob: with β = 10 the patient program stays in its queue
    d = Driver(make(starvation_ratio=10.0))
    d.served("patient", 100, took_s=20.0)
    assert level(d.arrive("patient", now=30.0), 30.0) == 2.0


# -- the load balancer (Algorithm 2) --------------------------------------------------------


def test_short_calls_go_to_the_least_used_engine_whatever_their_program() -> None:
    d = Driver(make())
    workers = [d.arrive("a", SHORT).worker for _ in range(4)]
    assert workers == ["w0", "w1", "w2", "w0"]  # fewest in flight, first on ties


def test_long_calls_stay_on_their_programs_engine_even_when_it_is_busier() -> None:
    d = Driver(make())
    first = d.arrive("a", LONG)      # pins a to the least used: w0
    assert first.worker == "w0"
    d.arrive("b", SHORT)             # w1
    d.arrive("c", SHORT)             # w2
    d.arrive("d", SHORT)             # w0 (two in flight now)
    assert d.arrive("a", LONG).worker == "w0"  # locality beats the lighter w1, w2
    assert d.p.process_table[SessionId("a")].pinned_worker == "w0"
    # a short call of the same program is balanced, not pinned
    assert d.arrive("a", SHORT).worker == "w1"
    # the threshold is inclusive: 2048 tokens is still short
    assert d.arrive("e", 2_048).worker == "w2"


def test_a_pinned_program_moves_when_its_engine_fails() -> None:
    d = Driver(make())
    assert d.arrive("a", LONG).worker == "w0"
    d.p.set_worker_health("w0", False, 1.0)
    moved = d.arrive("a", LONG, now=2.0)
    assert moved.worker == "w1"
    d.p.set_worker_health("w0", True, 3.0)
    assert d.arrive("a", LONG, now=4.0).worker == "w1"  # stays where it now lives


def test_held_calls_are_admitted_on_tick_with_their_plas_priority() -> None:
    d = Driver(make(("w0",)))
    d.served("a", 500, took_s=10.0)  # 10 s of service: Q_5
    d.p.set_worker_health("w0", False, 11.0)
    assert isinstance(d.arrive("a", LONG, now=12.0), Hold)
    d.p.set_worker_health("w0", True, 13.0)
    (admit,) = d.p.tick(14.0)
    assert isinstance(admit, Admit) and admit.worker == "w0"
    # Q_5 from the call's arrival: held 2 s, it goes 2 s ahead of Q_5 calls admitted now
    assert admit.priority == 12.0 + 4 * QUEUE_TIER_S
    assert engine_priority(admit.priority, 14.0) == 4 * 10**9 - 2_000


# -- the process table's lifetime, determinism -----------------------------------------------


def test_final_call_and_idleness_remove_the_program_from_the_process_table() -> None:
    d = Driver(make())
    last = d.arrive("a", LONG, final=True)
    actions = d.finish(last, 100, now=1.0)
    assert Release(SessionId("a"), "w0", "final") in actions
    assert SessionId("a") not in d.p.process_table
    d.served("b", 100, at=2.0, took_s=1.0)
    idle = d.p.config.idle_release_s
    assert d.p.tick(3.0 + idle - 1.0) == []
    assert d.p.tick(3.0 + idle) == [Release(SessionId("b"), "w0", "idle")]
    assert SessionId("b") not in d.p.process_table
    assert level(d.arrive("b", now=3.0 + idle), 3.0 + idle) == 0.0  # a fresh start


def test_reconfigure_takes_new_queue_bounds() -> None:
    d = Driver(make())
    d.served("a", 100, took_s=2.0)  # 2 s
    assert level(d.arrive("a", now=3.0), 3.0) == 2.0
    d.p.reconfigure(AutellixConfig(first_queue_s=4.0))
    assert level(d.arrive("a", now=4.0), 4.0) == 0.0


def test_same_observations_give_the_same_decisions() -> None:
    def run() -> list:
        d = Driver(make())
        log: list = []
        for step in range(40):
            sid = f"s{step % 7}"
            decision = d.arrive(sid, LONG if step % 3 else SHORT, now=float(step))
            log.append(decision)
            if step % 2 and isinstance(decision, Admit):
                log.append(d.finish(decision, 50 + 37 * step, now=step + 0.5 + step % 5))
        return log

    assert run() == run()
