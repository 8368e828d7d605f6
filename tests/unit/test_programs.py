"""The program state machine (architecture.md §2 "Programs"): legal and illegal transitions."""

from __future__ import annotations

import pytest

from scheduler.calls import CallRequest, Usage
from scheduler.coordinates import SessionId, mint_chain
from scheduler.programs import IllegalTransition, Lifecycle, Phase, Program

S = SessionId("sess-1")
RESERVE = 512


def call(rid: str, prompt: int = 1000, **kw) -> CallRequest:
    return CallRequest(request_id=rid, session_id=S, prompt_tokens=prompt, **kw)


def new(now: float = 0.0) -> Program:
    return Program(S, created_at=now)


def active(worker: str = "w0", now: float = 1.0) -> Program:
    p = new()
    p.place(worker, now)
    return p


def reasoning(rid: str = "r1", prompt: int = 1000, now: float = 2.0) -> Program:
    p = active()
    p.begin_call(call(rid, prompt), RESERVE, now)
    return p


def acting(now: float = 3.0) -> Program:
    p = reasoning()
    p.end_call("r1", Usage(1000, 200), now)
    return p


def paused(now: float = 4.0) -> Program:
    p = acting()
    p.pause()
    return p


# -- the initial state ---------------------------------------------------------------------


def test_new_program_is_pending_acting_unmarked_without_home():
    p = Program(S, created_at=5.0, parent_session_id=SessionId("parent"))
    assert p.lifecycle is Lifecycle.PENDING and p.pending
    assert not p.active and not p.paused
    assert p.phase is Phase.ACTING
    assert p.marked is False
    assert p.home_worker is None
    assert p.context_tokens == 0 and p.steps == 0
    assert p.in_flight == {} and p.waiting == []
    assert p.parent_session_id == "parent"
    assert p.last_activity == 5.0
    assert p.demand_tokens() == 0


# -- legal transitions ---------------------------------------------------------------------


def test_place_makes_a_pending_program_active_on_its_home_worker():
    p = new()
    p.place("w3", 7.0)
    assert p.lifecycle is Lifecycle.ACTIVE and p.active
    assert p.home_worker == "w3"
    assert p.last_activity == 7.0


def test_begin_call_makes_an_active_program_reasoning_and_records_demand():
    p = active()
    p.begin_call(call("r1", prompt=1000), RESERVE, 2.0)
    assert p.phase is Phase.REASONING
    assert p.in_flight == {"r1": 1000 + RESERVE}
    assert p.acting_since is None
    assert p.last_activity == 2.0


def test_begin_call_records_the_requests_chain():
    chain = mint_chain("m", None, None, [{"role": "user", "content": "hi"}])
    p = active()
    p.begin_call(call("r1", chain=chain, chain_tokens=(10, 25)), RESERVE, 2.0)
    assert p.chain == chain
    assert p.chain_tokens == (10, 25)
    # a call without a chain keeps the last one seen
    p.begin_call(call("r2"), RESERVE, 2.5)
    assert p.chain == chain


def test_end_call_with_usage_sets_context_increments_steps_and_starts_acting():
    p = reasoning()
    p.end_call("r1", Usage(prompt_tokens=1000, completion_tokens=234, cached_tokens=900), 9.0)
    assert p.phase is Phase.ACTING
    assert p.context_tokens == 1234
    assert p.steps == 1
    assert p.in_flight == {}
    assert p.acting_since == 9.0
    assert p.last_activity == 9.0


def test_abort_leaves_context_and_steps_untouched():
    p = acting()
    assert (p.context_tokens, p.steps) == (1200, 1)
    p.begin_call(call("r2", prompt=5000), RESERVE, 4.0)
    p.end_call("r2", None, 5.0)
    assert p.context_tokens == 1200
    assert p.steps == 1
    assert p.phase is Phase.ACTING
    assert p.acting_since == 5.0


def test_several_calls_in_flight_keep_reasoning_until_the_last_ends():
    p = active()
    p.begin_call(call("a", 100), RESERVE, 1.0)
    p.begin_call(call("b", 300), RESERVE, 1.5)
    p.begin_call(call("c", 200), RESERVE, 1.6)
    assert set(p.in_flight) == {"a", "b", "c"}
    p.end_call("b", Usage(300, 50), 2.0)
    assert p.phase is Phase.REASONING and p.acting_since is None
    assert p.steps == 1 and p.context_tokens == 350
    p.end_call("a", None, 2.5)
    assert p.phase is Phase.REASONING and p.acting_since is None
    assert p.steps == 1
    p.end_call("c", Usage(200, 10), 3.0)
    assert p.phase is Phase.ACTING
    assert p.acting_since == 3.0
    assert p.steps == 2
    assert p.context_tokens == 210  # the latest usage, not a running max


def test_mark_an_active_reasoning_program_then_pause_it_at_the_tool_boundary():
    p = reasoning()
    p.mark()
    assert p.marked
    # marking does not stop the program: it may even start another call
    p.begin_call(call("r2"), RESERVE, 2.1)
    p.end_call("r1", Usage(1000, 10), 2.5)
    p.end_call("r2", Usage(1000, 20), 3.0)
    assert p.phase is Phase.ACTING and p.marked
    p.pause()
    assert p.lifecycle is Lifecycle.PAUSED and p.paused
    assert p.marked is False


def test_pause_an_active_acting_program():
    p = acting()
    p.pause()
    assert p.paused
    assert p.home_worker == "w0"  # its KV may still be there
    assert p.context_tokens == 1200


def test_resume_a_paused_program_onto_a_worker_makes_it_home():
    p = paused()
    p.resume("w2", 20.0)
    assert p.active
    assert p.home_worker == "w2"
    assert p.last_activity == 20.0
    p.begin_call(call("r2"), RESERVE, 21.0)
    assert p.phase is Phase.REASONING


def test_resume_a_pending_program_places_it():
    p = new()
    p.resume("w1", 3.0)
    assert p.active and p.home_worker == "w1"


def test_hold_while_pending_then_take_waiting_after_placing_in_arrival_order():
    p = new()
    p.hold("r1", 1.0)
    p.hold("r2", 2.0)
    assert p.waiting == ["r1", "r2"]
    assert p.last_activity == 2.0
    p.place("w0", 3.0)
    assert p.take_waiting() == ["r1", "r2"]
    assert p.waiting == []
    assert p.take_waiting() == []


def test_hold_while_paused_then_take_waiting_after_resume():
    p = paused()
    p.hold("r9", 5.0)
    p.resume("w0", 6.0)
    assert p.take_waiting() == ["r9"]


def test_drop_waiting_removes_only_that_call():
    p = new()
    for rid in ("r1", "r2", "r3"):
        p.hold(rid, 1.0)
    p.drop_waiting("r2")
    assert p.waiting == ["r1", "r3"]


def test_pause_resume_cycles_can_repeat():
    p = acting()
    for i in range(3):
        p.pause()
        p.resume(f"w{i}", 10.5 + i)
        p.begin_call(call(f"x{i}"), RESERVE, 10.6 + i)
        p.end_call(f"x{i}", Usage(100 + i, 1), 10.7 + i)
    assert p.active and p.home_worker == "w2" and p.steps == 4


# -- illegal transitions -------------------------------------------------------------------


def test_place_twice_raises():
    p = active()
    with pytest.raises(IllegalTransition):
        p.place("w1", 2.0)
    assert p.home_worker == "w0"


def test_place_a_paused_program_raises():
    with pytest.raises(IllegalTransition):
        paused().place("w1", 5.0)


@pytest.mark.parametrize("make", [new, paused], ids=["PENDING", "PAUSED"])
def test_begin_call_while_not_active_raises(make):
    p = make()
    before = dict(p.in_flight)
    with pytest.raises(IllegalTransition):
        p.begin_call(call("r5"), RESERVE, 5.0)
    assert p.in_flight == before


def test_begin_call_with_an_id_already_in_flight_raises():
    p = reasoning("r1")
    with pytest.raises(IllegalTransition):
        p.begin_call(call("r1"), RESERVE, 3.0)


def test_pause_while_reasoning_raises_so_nothing_in_flight_is_aborted():
    p = reasoning()
    with pytest.raises(IllegalTransition):
        p.pause()
    assert p.active and p.in_flight


@pytest.mark.parametrize("make", [new, paused], ids=["PENDING", "PAUSED"])
def test_pause_while_not_active_raises(make):
    with pytest.raises(IllegalTransition):
        make().pause()


def test_mark_while_acting_raises():
    p = acting()
    with pytest.raises(IllegalTransition):
        p.mark()
    assert not p.marked


def test_mark_twice_raises():
    p = reasoning()
    p.mark()
    with pytest.raises(IllegalTransition):
        p.mark()


@pytest.mark.parametrize("make", [new, paused], ids=["PENDING", "PAUSED"])
def test_mark_while_not_active_raises(make):
    with pytest.raises(IllegalTransition):
        make().mark()


@pytest.mark.parametrize("make", [active, reasoning, acting], ids=["placed", "REASONING", "ACTING"])
def test_resume_while_active_raises(make):
    p = make()
    with pytest.raises(IllegalTransition):
        p.resume("w9", 9.0)
    assert p.home_worker == "w0"


@pytest.mark.parametrize("make", [active, reasoning, acting], ids=["placed", "REASONING", "ACTING"])
def test_hold_while_active_raises(make):
    p = make()
    with pytest.raises(IllegalTransition):
        p.hold("r7", 9.0)
    assert p.waiting == []


def test_hold_the_same_call_twice_raises():
    p = new()
    p.hold("r1", 1.0)
    with pytest.raises(IllegalTransition):
        p.hold("r1", 2.0)
    assert p.waiting == ["r1"]


@pytest.mark.parametrize("make", [new, paused], ids=["PENDING", "PAUSED"])
def test_take_waiting_while_not_active_raises_and_keeps_the_calls(make):
    p = make()
    p.hold("r1", 5.0)
    with pytest.raises(IllegalTransition):
        p.take_waiting()
    assert p.waiting == ["r1"]


def test_end_call_of_an_unknown_id_raises():
    p = reasoning("r1")
    with pytest.raises(IllegalTransition):
        p.end_call("nope", Usage(1, 1), 3.0)
    assert p.phase is Phase.REASONING and p.steps == 0


def test_end_call_twice_raises():
    p = acting()
    with pytest.raises(IllegalTransition):
        p.end_call("r1", Usage(1, 1), 4.0)
    assert p.steps == 1


def test_end_call_on_a_fresh_program_raises():
    with pytest.raises(IllegalTransition):
        new().end_call("r1", None, 1.0)


def test_drop_waiting_of_an_unknown_call_raises():
    p = new()
    p.hold("r1", 1.0)
    with pytest.raises(IllegalTransition):
        p.drop_waiting("r2")
    assert p.waiting == ["r1"]


def test_illegal_transition_is_a_runtime_error_naming_the_session():
    with pytest.raises(RuntimeError, match="sess-1"):
        new().pause()


# -- demand --------------------------------------------------------------------------------


def test_demand_is_the_context_while_acting():
    assert acting().demand_tokens() == 1200


def test_demand_while_reasoning_is_the_largest_of_context_and_each_calls_reserve():
    p = acting()  # context 1200
    p.begin_call(call("small", prompt=100), RESERVE, 4.0)
    assert p.demand_tokens() == 1200  # the context dominates 100 + 512
    p.begin_call(call("big", prompt=3000), RESERVE, 4.1)
    assert p.demand_tokens() == 3000 + RESERVE
    p.end_call("big", None, 4.2)
    assert p.demand_tokens() == 1200


def test_demand_uses_the_reserve_passed_at_dispatch():
    p = active()
    p.begin_call(call("r1", prompt=1000), 0, 1.0)
    assert p.demand_tokens() == 1000
    p.begin_call(call("r2", prompt=1000), 2048, 1.0)
    assert p.demand_tokens() == 3048


def test_waiting_demand_covers_the_biggest_held_prompt_plus_reserve():
    p = paused()  # context 1200
    assert p.waiting_demand_tokens(RESERVE, {}.__getitem__) == 1200
    p.hold("r2", 5.0)
    p.hold("r3", 5.0)
    assert p.waiting_demand_tokens(RESERVE, {"r2": 2000, "r3": 500}.__getitem__) == 2000 + RESERVE
    assert p.waiting_demand_tokens(RESERVE, {"r2": 10, "r3": 20}.__getitem__) == 1200


def test_waiting_demand_keeps_the_demand_of_calls_still_in_flight():
    # re-homed mid-call (its worker failed): the calls still running bring their demand
    p = active()
    p.begin_call(call("r1", prompt=3000), RESERVE, 1.0)
    p.unhome()
    assert p.pending and p.home_worker is None
    p.hold("r2", 2.0)
    assert p.waiting_demand_tokens(RESERVE, {"r2": 100}.__getitem__) == 3000 + RESERVE


def test_move_home_and_unhome_are_checked_transitions():
    p = active()
    p.move_home("w9")
    assert p.home_worker == "w9"
    p.unhome()
    assert p.pending and p.home_worker is None
    with pytest.raises(IllegalTransition):
        p.move_home("w1")  # a PENDING program is placed, not moved
    q = paused()
    q.unhome()
    assert q.paused and q.home_worker is None


# -- what a shell hands the core (calls.py) --------------------------------------------------


def test_usage_context_is_prompt_plus_completion_regardless_of_cache_hits():
    assert Usage(prompt_tokens=900, completion_tokens=100, cached_tokens=800).context_tokens == 1000


def test_call_request_rejects_a_negative_prompt():
    with pytest.raises(ValueError, match="prompt_tokens"):
        call("r1", prompt=-1)


def test_call_request_chain_tokens_need_a_chain_of_the_same_length():
    chain = mint_chain("m", None, None, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError):
        call("r1", chain_tokens=(10, 20))
    with pytest.raises(ValueError):
        call("r1", chain=chain, chain_tokens=(10,))
    assert call("r1", chain=chain, chain_tokens=(10, 20)).chain_tokens == (10, 20)
    assert call("r1", chain=chain).chain_tokens is None


# -- the prompt of a call that carries on from the last answered one --------------------------

SYSTEM = {"role": "system", "content": "s"}
TASK = {"role": "user", "content": "task"}
ANSWER = {"role": "assistant", "content": "done"}
TOOL = {"role": "tool", "content": "out"}


def estimated(rid: str, messages: list, tokens: tuple[int, ...], **kw) -> CallRequest:
    chain = mint_chain("m", None, None, messages)
    return call(rid, tokens[-1], chain=chain, chain_tokens=tokens, prompt_estimated=True, **kw)


def answered_once() -> Program:
    """A program whose first call (estimated 300 tokens) the engine counted as 280 + 40."""
    p = active()
    p.begin_call(estimated("r1", [SYSTEM, TASK], (0, 100, 300)), RESERVE, 2.0)
    p.end_call("r1", Usage(280, 40), 3.0)
    return p


def test_a_continuing_calls_prompt_is_the_exact_context_plus_the_estimate_of_what_it_adds():
    p = answered_once()
    later = estimated("r2", [SYSTEM, TASK, ANSWER, TOOL], (0, 100, 300, 350, 420))
    # 280 + 40 counted by the engine, then the tool message: 420 − 350 estimated
    assert p.refine_prompt(later) == 320 + 70


def test_the_shells_count_stands_when_it_is_exact_or_the_call_does_not_continue():
    p = answered_once()
    tokens = (0, 100, 300, 350, 420)
    exact = call("r2", 420, chain=mint_chain("m", None, None, [SYSTEM, TASK, ANSWER, TOOL]),
                 chain_tokens=tokens)
    assert p.refine_prompt(exact) == 420  # the simulator's: the engine's own count
    fork = estimated("r3", [SYSTEM, {"role": "user", "content": "other"}, ANSWER, TOOL], tokens)
    assert p.refine_prompt(fork) == 420
    again = estimated("r4", [SYSTEM, TASK], (0, 100, 300))  # nothing after the answer
    assert p.refine_prompt(again) == 300
    assert new().refine_prompt(estimated("r5", [SYSTEM, TASK], (0, 100, 300))) == 300


def test_while_a_call_is_in_flight_the_context_is_stale_and_the_count_stands():
    p = answered_once()
    p.begin_call(estimated("r2", [SYSTEM, TASK, ANSWER, TOOL], (0, 100, 300, 350, 420)), RESERVE, 4.0)
    parallel = estimated("r3", [SYSTEM, TASK, ANSWER, TOOL], (0, 100, 300, 350, 420))
    assert p.refine_prompt(parallel) == 420


def test_an_aborted_call_leaves_the_last_answered_call_as_the_reference():
    p = answered_once()
    retry = estimated("r2", [SYSTEM, TASK, ANSWER, TOOL], (0, 100, 300, 350, 420))
    p.begin_call(retry, RESERVE, 4.0)
    p.end_call("r2", None, 5.0)
    assert p.refine_prompt(estimated("r3", [SYSTEM, TASK, ANSWER, TOOL],
                                     (0, 100, 300, 350, 420))) == 390
