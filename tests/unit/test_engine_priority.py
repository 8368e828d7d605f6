"""The one definition of what an engine's request carries for an admission's priority
(scheduler/actions.py ``engine_priority``): milliseconds from dispatch to the moment the call
counts as having arrived, as both shells send it (architecture.md §3)."""

from __future__ import annotations

import pytest

from scheduler.actions import Admit, engine_priority
from scheduler.calls import CallRequest
from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import SessionId
from scheduler.policies import make_policy


@pytest.mark.parametrize(("priority", "dispatched_at", "expected"), [
    (100.0, 100.0, 0),             # admitted on arrival: vLLM's default
    (95.0, 100.0, -5_000),         # held 5 s: ahead of calls that arrive now
    (94.0, 100.0, -6_000),         # held 5 s and resumed with a 1 s boost
    (102.0, 100.0, 2_000),         # a soft-band call, 2 s later
    (100.0004, 100.0, 0),          # under half a millisecond rounds to the arrival
    (100.0006, 100.0, 1),
    (1e6 + 250.0, 250.0, 10**9),   # one autellix queue: 10^6 s
])
def test_engine_priority_is_milliseconds_from_dispatch(priority, dispatched_at, expected) -> None:
    value = engine_priority(priority, dispatched_at)
    assert value == expected and isinstance(value, int)


def test_order_between_calls_is_the_order_of_their_priorities_wherever_dispatched() -> None:
    # A call held since t=10 and dispatched at t=40 goes ahead of one that arrived at t=40;
    # one that arrived at t=40 in a soft band (2 s later) goes after both.
    held = engine_priority(10.0, 40.0)
    fresh = engine_priority(40.0, 40.0)
    soft = engine_priority(42.0, 40.0)
    assert held < fresh < soft


def _program_aware():
    policy = make_policy(ProgramAwareConfig(buffer_per_program=0,
                                      growth_reserve_tokens=0, max_wait_s=None,
                                      dormant_quantile=None))
    policy.add_worker("w0", 1000)
    return policy


def test_a_plain_admission_gets_zero_whatever_the_clock_reads() -> None:
    for now in (0.0, 12.345, 1.7e6):
        policy = _program_aware()
        decision = policy.on_arrival(CallRequest("a#1", SessionId("a"), 10), now)
        assert isinstance(decision, Admit)
        assert engine_priority(decision.priority, now) == 0
