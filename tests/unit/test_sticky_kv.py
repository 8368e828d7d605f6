"""``sticky_kv`` follows its sources rule by rule (scheduler/policies/sticky_kv.py): Dynamo's KV
cost for a new session, Dynamo's session affinity after, SGLang's cache-aware balance
thresholds as the valve, the binding dropped with a failed worker and with its program."""

from __future__ import annotations

from scheduler.actions import Admit, Release
from scheduler.calls import Usage
from scheduler.config import StickyKvConfig
from tests.unit.test_baselines import THREE, Driver, make, stored

TWO = {"w0": 10_000, "w1": 10_000}


def _loaded(thresholds: dict, home_calls: int, other_calls: int) -> str:
    """``other_calls`` calls in flight on w1, then session "a" bound to w0 and ``home_calls``
    calls in flight there (each from its own session, placed while only its worker was
    healthy); where does a's next call go?"""
    d = Driver(make("sticky_kv", TWO, **thresholds))

    def load(worker: str, calls: int, down: str) -> None:
        d.p.set_worker_health(down, False, 1.0)
        for i in range(calls):
            assert d.arrive(f"{worker}-{i}", 10, now=1.0).worker == worker
        d.p.set_worker_health(down, True, 1.0)

    load("w1", other_calls, down="w0")
    first = d.arrive("a", 10, now=1.0)
    assert first.worker == "w0"  # by KV cost: w1 is busy
    d.finish(first.request_id, 10, now=1.0)
    load("w0", home_calls, down="w1")
    return d.arrive("a", 20, now=2.0).worker


def test_defaults_are_dynamos_kv_weight_and_sglangs_balance_thresholds() -> None:
    config = StickyKvConfig()
    assert (config.kv_overlap_score_weight, config.balance_abs_threshold,
            config.balance_rel_threshold) == (1.0, 64, 1.5)


def test_session_affinity_keeps_a_session_on_its_worker_across_turns() -> None:
    d = Driver(make("sticky_kv", THREE))
    first = d.arrive("a", 100, now=0.0)
    d.finish(first.request_id, 150, now=1.0)
    busy = d.arrive("b", 5_000, now=1.0)  # ties go to w0: b's tokens now load a's worker
    assert busy.worker == first.worker == "w0"
    for turn in range(2, 6):
        call = d.arrive("a", 100 * turn, now=float(turn))
        # Dynamo's KV cost alone would leave w0 for an empty worker; the binding holds
        assert call.worker == "w0"
        d.finish(call.request_id, 100 * turn + 50, now=turn + 0.5)
    kv_aware = Driver(make("kv_aware", THREE))
    kv_aware.finish(kv_aware.arrive("a", 100).request_id, 150)
    kv_aware.arrive("b", 5_000)
    assert kv_aware.arrive("a", 200, now=2.0).worker != "w0"


def test_a_new_session_goes_by_kv_cost_overlap_credited_against_load() -> None:
    d = Driver(make("sticky_kv", TWO))
    d.p.observe_kv("w1", stored([1, 2, 3, 4], "someone"))
    assert d.arrive("cached", 64, block_hashes=(1, 2, 3, 4)).worker == "w1"  # the prefix
    # with 100 more tokens running on w1 its load outweighs the prefix:
    # cost(w0) = 1.0 · 64 + 64 = 128 < cost(w1) = 1.0 · 0 + (164 + 64) = 228
    d.p.set_worker_health("w0", False, 0.0)
    d.arrive("busy", 100)
    d.p.set_worker_health("w0", True, 0.0)
    assert d.arrive("new", 64, block_hashes=(1, 2, 3, 4)).worker == "w0"


def test_the_valve_moves_a_session_off_a_worker_over_both_thresholds() -> None:
    thresholds = {"balance_abs_threshold": 2, "balance_rel_threshold": 1.5}
    # 5 on its worker against 1: 5 − 1 > 2 and 5 > 1.5 · 1, so it goes to the least-loaded
    assert _loaded(thresholds, home_calls=5, other_calls=1) == "w1"


def test_the_valve_keeps_a_session_within_the_absolute_margin() -> None:
    thresholds = {"balance_abs_threshold": 2, "balance_rel_threshold": 1.5}
    assert _loaded(thresholds, home_calls=3, other_calls=1) == "w0"  # 3 − 1 = 2, not > 2


def test_the_valve_keeps_a_session_within_the_ratio() -> None:
    thresholds = {"balance_abs_threshold": 2, "balance_rel_threshold": 1.5}
    # 9 − 6 = 3 > 2, but 9 is not more than 1.5 · 6 = 9: both must hold (SGLang's "and")
    assert _loaded(thresholds, home_calls=9, other_calls=6) == "w0"
    assert _loaded(thresholds, home_calls=10, other_calls=6) == "w1"


def test_a_session_the_valve_moved_stays_on_its_new_worker() -> None:
    d = Driver(make("sticky_kv", TWO, balance_abs_threshold=0, balance_rel_threshold=1.0))
    first = d.arrive("a", 10, now=0.0)
    d.finish(first.request_id, now=1.0)
    d.p.set_worker_health("w1", False, 1.0)
    d.arrive("x", 10, now=1.0)  # w0: 1 call in flight, w1: none
    d.p.set_worker_health("w1", True, 1.0)
    moved = d.arrive("a", 20, now=2.0)
    assert moved.worker == "w1" and d.p.valve_moves == 1
    d.finish(moved.request_id, 30, now=3.0)
    d.finish("x#1", now=3.0)
    assert d.arrive("a", 40, now=4.0).worker == "w1"  # bound to w1 now, loads even


def test_a_failed_workers_sessions_move_and_rebind() -> None:
    d = Driver(make("sticky_kv", TWO))
    home = d.acting("a", 100)
    d.p.set_worker_health(home, False, 1.0)
    elsewhere = d.arrive("a", 120, now=2.0)
    assert isinstance(elsewhere, Admit) and elsewhere.worker != home
    d.finish(elsewhere.request_id, 150, now=3.0)
    d.p.set_worker_health(home, True, 4.0)
    assert d.arrive("a", 160, now=5.0).worker == elsewhere.worker  # bound to the new one


def test_the_binding_is_released_with_its_program_when_idle_or_final() -> None:
    d = Driver(make("sticky_kv", TWO, idle_release_s=30.0))
    first = d.arrive("a", 10, now=0.0)
    d.finish(first.request_id, now=10.0)
    assert d.p.tick(39.9) == []
    assert d.p.tick(40.0) == [Release("a", "w0", "idle")]
    assert d.p.program_count() == 0  # nothing of "a" is kept
    final = d.arrive("b", 10, now=50.0, final=True)
    assert d.p.on_complete(final.request_id, Usage(10, 1), 51.0) == [Release("b", final.worker, "final")]
    assert d.p.program_count() == 0


def test_a_released_session_is_placed_afresh_by_kv_cost() -> None:
    d = Driver(make("sticky_kv", TWO, idle_release_s=30.0))
    first = d.arrive("a", 10, now=0.0)
    d.finish(first.request_id, now=1.0)
    d.p.tick(40.0)  # released: no binding left
    d.p.observe_kv("w1", stored([5, 6], "someone"))
    assert d.arrive("a", 32, now=41.0, block_hashes=(5, 6)).worker == "w1"
