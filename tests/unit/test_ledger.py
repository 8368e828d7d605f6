"""The ledger (architecture.md §2): ``U_w`` per worker, kept in step with programs as they change.

``U_w = (Σ_{p active on w} weight(p)·demand(p) − shared_w + buffer·n_w) / capacity_w``
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.calls import CallRequest, Usage
from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import SessionId, mint_chain
from scheduler.kv_events import BlockStored
from scheduler.kv_index import KVIndex
from scheduler.ledger import UNKNOWN_CAPACITY_UTILIZATION, Ledger
from scheduler.programs import Phase, Program

CAP = 10_000
BUF = 100
RESERVE = 500


def make(weight: float = 0.5, buffer: int = BUF, workers=("w0", "w1"), cap=CAP):
    index = KVIndex()
    ledger = Ledger(ProgramAwareConfig(acting_token_weight=weight, buffer_per_program=buffer),
                    index)
    for w in workers:
        ledger.add_worker(w, cap)
    return ledger, index


def req(session: str, rid: str, prompt: int, chain=None, chain_tokens=None) -> CallRequest:
    return CallRequest(request_id=rid, session_id=SessionId(session), prompt_tokens=prompt,
                       chain=chain, chain_tokens=chain_tokens)


def reasoning(session: str, worker: str, prompt: int, rid: str = "r1", **kw) -> Program:
    p = Program(SessionId(session), created_at=0.0)
    p.place(worker, 0.0)
    p.begin_call(req(session, rid, prompt, **kw), RESERVE, 0.0)
    return p


def acting(session: str, worker: str, prompt: int, completion: int, **kw) -> Program:
    p = reasoning(session, worker, prompt, **kw)
    p.end_call("r1", Usage(prompt, completion), 1.0)
    return p


def stored(hashes, session, block_size=16):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                       token_ids=list(range(len(hashes) * block_size)), block_size=block_size,
                       lora_id=None, medium="GPU", lora_name=None, session_id=session)


# -- the formula ---------------------------------------------------------------------------


def test_reasoning_program_counts_its_full_demand_plus_buffer():
    ledger, _ = make()
    p = reasoning("a", "w0", 1000)
    ledger.refresh(p)
    assert ledger.load_tokens("w0") == 1000 + RESERVE + BUF
    assert ledger.utilization("w0") == pytest.approx((1000 + RESERVE + BUF) / CAP)
    assert ledger.utilization("w1") == 0.0
    assert ledger.contribution("a") == 1000 + RESERVE + BUF
    assert ledger.counted_worker("a") == "w0"


def test_acting_program_counts_its_context_times_acting_token_weight():
    ledger, _ = make(weight=0.5)
    p = acting("a", "w0", 1000, 200)
    ledger.refresh(p)
    assert ledger.load_tokens("w0") == 0.5 * 1200 + BUF
    assert ledger.weight(p) == 0.5


def test_phase_change_reweights_on_refresh():
    ledger, _ = make(weight=0.25)
    p = reasoning("a", "w0", 2000)
    ledger.refresh(p)
    assert ledger.load_tokens("w0") == 2000 + RESERVE + BUF
    p.end_call("r1", Usage(2000, 400), 1.0)
    ledger.refresh(p)
    assert ledger.load_tokens("w0") == 0.25 * 2400 + BUF
    p.begin_call(req("a", "r2", 2500), RESERVE, 2.0)
    ledger.refresh(p)
    assert p.phase is Phase.REASONING and ledger.weight(p) == 1.0
    assert ledger.load_tokens("w0") == 2500 + RESERVE + BUF


def test_utilization_sums_programs_and_buffers_per_worker():
    ledger, _ = make(weight=0.5)
    progs = [reasoning("a", "w0", 1000), acting("b", "w0", 3000, 1000), acting("c", "w1", 500, 0)]
    for p in progs:
        ledger.refresh(p)
    assert ledger.load_tokens("w0") == (1000 + RESERVE) + 0.5 * 4000 + 2 * BUF
    assert ledger.utilization("w0") == pytest.approx(((1000 + RESERVE) + 2000 + 200) / CAP)
    assert ledger.load_tokens("w1") == 0.5 * 500 + BUF
    assert ledger.worker("w0").programs == {"a": 1000 + RESERVE, "b": 4000}


def test_buffer_is_per_active_program_even_with_no_context():
    ledger, _ = make(buffer=250)
    for s in ("a", "b", "c"):
        p = Program(SessionId(s), created_at=0.0)
        p.place("w0", 0.0)
        ledger.refresh(p)
    assert ledger.load_tokens("w0") == 3 * 250


def test_pending_program_is_not_counted():
    ledger, _ = make()
    p = Program(SessionId("a"), created_at=0.0)
    ledger.refresh(p)
    assert ledger.load_tokens("w0") == 0 and ledger.counted_worker("a") is None
    assert ledger.contribution("a") == 0.0


def test_several_calls_in_flight_count_the_largest_demand_once():
    ledger, _ = make()
    p = reasoning("a", "w0", 1000)
    p.begin_call(req("a", "r2", 4000), RESERVE, 0.5)
    ledger.refresh(p)
    assert ledger.load_tokens("w0") == 4000 + RESERVE + BUF


# -- shared tokens -------------------------------------------------------------------------


def _chains():
    sys = {"role": "system", "content": "shared system prompt"}
    task = {"role": "user", "content": "task"}
    a = mint_chain("m", None, None, [sys, task, {"role": "assistant", "content": "A"}])
    b = mint_chain("m", None, None, [sys, task, {"role": "assistant", "content": "B"}])
    c = mint_chain("m", None, None, [sys])
    other = mint_chain("m2", None, None, [sys])
    return a, b, c, other


def test_ancestry_subtracts_common_prefix_tokens_once_per_extra_program():
    ledger, _ = make(weight=1.0)
    ca, cb, cc, _ = _chains()
    # c0: 50 tokens, system: +450, task: +500, answer: +200 / +300
    a = reasoning("a", "w0", 1200, chain=ca, chain_tokens=(50, 500, 1000, 1200))
    b = reasoning("b", "w0", 1300, chain=cb, chain_tokens=(50, 500, 1000, 1300))
    ledger.refresh(a)
    assert ledger.shared_tokens("w0") == 0
    ledger.refresh(b)
    assert ledger.shared_tokens("w0") == 1000  # c0 + system + task
    base = (1200 + RESERVE) + (1300 + RESERVE) + 2 * BUF
    assert ledger.load_tokens("w0") == base - 1000
    c = reasoning("c", "w0", 500, chain=cc, chain_tokens=(50, 500))
    ledger.refresh(c)
    assert ledger.shared_tokens("w0") == 1000 + 500  # c shares c0 + system with both
    ledger.forget("a")
    assert ledger.shared_tokens("w0") == 500
    ledger.forget("c")
    assert ledger.shared_tokens("w0") == 0  # b alone shares with nobody
    ledger.forget("b")
    assert ledger.shared_tokens("w0") == 0
    assert ledger.worker("w0").ancestry_counts == {}


def test_programs_sizing_one_prefix_differently_leave_no_residue():
    # chain_tokens are estimates in the gateway: two programs may size the same prefix
    # differently. Sharing must still vanish when they leave, whatever the order.
    ledger, _ = make(weight=1.0)
    _, _, cc, _ = _chains()
    for first, second in (("a", "b"), ("b", "a")):
        a = acting("a", "w0", 500, 0, chain=cc, chain_tokens=(50, 500))
        b = acting("b", "w0", 520, 0, chain=cc, chain_tokens=(50, 520))
        ledger.refresh(a)
        ledger.refresh(b)
        assert ledger.shared_tokens("w0") in (500, 520)
        ledger.forget(first)
        assert ledger.shared_tokens("w0") == 0
        ledger.forget(second)
        assert ledger.shared_tokens("w0") == 0
        assert ledger.load_tokens("w0") == 0


def test_ancestry_shares_nothing_across_models_or_workers():
    ledger, _ = make()
    ca, cb, cc, other = _chains()
    ledger.refresh(reasoning("a", "w0", 1200, chain=ca, chain_tokens=(50, 500, 1000, 1200)))
    ledger.refresh(reasoning("b", "w1", 1300, chain=cb, chain_tokens=(50, 500, 1000, 1300)))
    ledger.refresh(reasoning("o", "w0", 500, chain=other, chain_tokens=(50, 500)))
    assert ledger.shared_tokens("w0") == 0
    assert ledger.shared_tokens("w1") == 0


def test_programs_without_chain_tokens_share_nothing_by_ancestry():
    ledger, _ = make()
    ca, cb, _, _ = _chains()
    ledger.refresh(reasoning("a", "w0", 1200, chain=ca))
    ledger.refresh(reasoning("b", "w0", 1300, chain=cb))
    assert ledger.shared_tokens("w0") == 0


def test_ancestry_follows_a_programs_new_chain_on_refresh():
    ledger, _ = make()
    ca, cb, cc, _ = _chains()
    a = acting("a", "w0", 500, 10, chain=cc, chain_tokens=(50, 500))
    b = reasoning("b", "w0", 1300, chain=cb, chain_tokens=(50, 500, 1000, 1300))
    ledger.refresh(a)
    ledger.refresh(b)
    assert ledger.shared_tokens("w0") == 500
    a.begin_call(req("a", "r2", 1200, chain=ca, chain_tokens=(50, 500, 1000, 1200)), RESERVE, 2)
    ledger.refresh(a)
    assert ledger.shared_tokens("w0") == 1000


def test_shared_tokens_come_from_the_index_when_the_worker_has_events():
    ledger, index = make(weight=1.0)
    a, b = acting("a", "w0", 100, 0), acting("b", "w0", 100, 0)
    ledger.refresh(a)
    ledger.refresh(b)
    index.apply_events("w0", [stored([1, 2, 3], "a"), stored([1, 2], "b"), stored([9], "x")])
    assert index.has_events("w0")
    # the ledger told the index which sessions to count: a and b, not x
    assert ledger.shared_tokens("w0") == 32
    assert ledger.load_tokens("w0") == 100 + 100 - 32 + 2 * BUF


def test_index_and_ancestry_take_the_larger_lower_bound_when_events_flow():
    ledger, index = make(weight=1.0)
    ca, cb, _, _ = _chains()
    a = reasoning("a", "w0", 1200, chain=ca, chain_tokens=(50, 500, 1000, 1200))
    b = reasoning("b", "w0", 1300, chain=cb, chain_tokens=(50, 500, 1000, 1300))
    ledger.refresh(a)
    ledger.refresh(b)
    index.apply_events("w0", [stored([1, 2], "a"), stored([1, 2], "b")])
    assert index.worker("w0").shared_tokens == 32
    assert ledger.shared_tokens("w0") == max(32, 1000)
    index.apply_events("w0", [stored(range(10, 110), "a"), stored(range(10, 110), "b")])
    assert index.worker("w0").shared_tokens == 32 + 1600
    assert ledger.shared_tokens("w0") == 1632


def test_shared_tokens_fall_back_to_ancestry_on_a_worker_without_events():
    ledger, index = make()
    ca, cb, _, _ = _chains()
    ledger.refresh(reasoning("a", "w1", 1200, chain=ca, chain_tokens=(50, 500, 1000, 1200)))
    ledger.refresh(reasoning("b", "w1", 1300, chain=cb, chain_tokens=(50, 500, 1000, 1300)))
    index.apply_events("w0", [stored([1], "a"), stored([1], "b")])  # events elsewhere only
    assert not index.has_events("w1")
    assert ledger.shared_tokens("w1") == 1000


def test_pausing_a_program_removes_it_and_its_index_sharing():
    ledger, index = make(weight=1.0)
    a, b = acting("a", "w0", 100, 0), acting("b", "w0", 200, 0)
    ledger.refresh(a)
    ledger.refresh(b)
    index.apply_events("w0", [stored([1, 2], "a"), stored([1, 2], "b")])
    assert ledger.load_tokens("w0") == 300 - 32 + 2 * BUF
    a.pause()
    ledger.refresh(a)
    assert "a" not in index.worker("w0").counted
    assert ledger.shared_tokens("w0") == 0
    assert ledger.load_tokens("w0") == 200 + BUF
    assert ledger.counted_worker("a") is None
    assert ledger.worker("w0").programs == {"b": 200}


# -- moving, forgetting ----------------------------------------------------------------------


def test_resume_on_another_worker_moves_the_contribution_and_index_counting():
    ledger, index = make(weight=1.0)
    a = acting("a", "w0", 1000, 0)
    ledger.refresh(a)
    a.pause()
    ledger.refresh(a)
    assert ledger.load_tokens("w0") == 0
    a.resume("w1", 2.0)
    ledger.refresh(a)
    assert ledger.load_tokens("w0") == 0
    assert ledger.load_tokens("w1") == 1000 + BUF
    assert ledger.counted_worker("a") == "w1"
    assert "a" in index.worker("w1").counted and "a" not in index.worker("w0").counted


def test_home_change_while_active_moves_everything_on_refresh():
    ledger, index = make(weight=1.0)
    ca, cb, _, _ = _chains()
    a = acting("a", "w0", 1200, 0, chain=ca, chain_tokens=(50, 500, 1000, 1200))
    b = acting("b", "w0", 1300, 0, chain=cb, chain_tokens=(50, 500, 1000, 1300))
    ledger.refresh(a)
    ledger.refresh(b)
    a.home_worker = "w1"  # what a policy does when it dispatches elsewhere
    ledger.refresh(a)
    assert ledger.shared_tokens("w0") == 0
    assert ledger.load_tokens("w0") == 1300 + BUF
    assert ledger.load_tokens("w1") == 1200 + BUF
    assert set(index.worker("w1").counted) == {"a"}
    assert set(index.worker("w0").counted) == {"b"}


def test_forget_removes_a_program_and_is_idempotent():
    ledger, index = make()
    a = reasoning("a", "w0", 1000)
    ledger.refresh(a)
    ledger.forget("a")
    assert ledger.load_tokens("w0") == 0
    assert ledger.worker("w0").programs == {}
    assert ledger.worker("w0").weighted_demand == 0.0
    assert "a" not in index.worker("w0").counted
    ledger.forget("a")
    ledger.forget("never-seen")
    assert ledger.load_tokens("w0") == 0


def test_refresh_without_change_is_idempotent():
    ledger, _ = make()
    a = acting("a", "w0", 1000, 10)
    for _ in range(3):
        ledger.refresh(a)
    assert ledger.load_tokens("w0") == 0.5 * 1010 + BUF
    assert len(ledger.worker("w0").programs) == 1


# -- capacity -----------------------------------------------------------------------------


def test_unknown_capacity_gives_infinite_utilization_and_takes_no_programs():
    ledger, _ = make(workers=())
    load = ledger.add_worker("w9")
    assert load.capacity_tokens is None and not load.accepts_programs
    assert ledger.utilization("w9") == UNKNOWN_CAPACITY_UTILIZATION == math.inf
    assert ledger.utilization_with("w9", 10) == math.inf
    ledger.set_capacity("w9", 4000)
    assert ledger.utilization("w9") == 0.0
    assert ledger.worker("w9").accepts_programs


def test_unhealthy_worker_accepts_no_programs():
    ledger, _ = make()
    ledger.set_healthy("w0", False)
    assert not ledger.worker("w0").accepts_programs
    ledger.set_healthy("w0", True)
    assert ledger.worker("w0").accepts_programs


def test_utilization_with_adds_the_tokens_and_a_buffer_per_extra_program():
    ledger, _ = make(weight=1.0)
    ledger.refresh(acting("a", "w0", 1000, 0))
    now = ledger.utilization("w0")
    assert now == pytest.approx((1000 + BUF) / CAP)
    assert ledger.utilization_with("w0", 2000) == pytest.approx((1000 + BUF + 2000 + BUF) / CAP)
    assert ledger.utilization_with("w0", 2000, extra_programs=0) == pytest.approx(
        (1000 + BUF + 2000) / CAP)
    assert ledger.utilization("w0") == now  # a what-if changes nothing


@pytest.mark.parametrize("cap", [0, -5])
def test_non_positive_capacity_is_rejected(cap):
    ledger, _ = make(workers=())
    with pytest.raises(ValueError):
        ledger.add_worker("w", cap)
    ledger.add_worker("w")
    with pytest.raises(ValueError):
        ledger.set_capacity("w", cap)


def test_workers_are_registered_once_and_unknown_names_raise():
    ledger, _ = make()
    with pytest.raises(ValueError):
        ledger.add_worker("w0", CAP)
    with pytest.raises(KeyError):
        ledger.worker("nope")
    assert "w0" in ledger and "nope" not in ledger
    assert ledger.worker_names() == ["w0", "w1"]
    assert [w.name for w in ledger.workers()] == ["w0", "w1"]


def test_reconfigure_applies_a_new_weight_as_programs_next_change():
    ledger, _ = make(weight=1.0)
    a = acting("a", "w0", 1000, 0)
    ledger.refresh(a)
    ledger.reconfigure(ProgramAwareConfig(acting_token_weight=0.5, buffer_per_program=BUF))
    a.begin_call(req("a", "r2", 10), 0, 2.0)
    a.end_call("r2", Usage(1000, 0), 3.0)
    ledger.refresh(a)
    assert ledger.load_tokens("w0") == 500 + BUF


# -- property: incremental sums equal a recomputation from the programs -------------------

MESSAGES = ["s", "t", "u"]  # tiny alphabet: plenty of shared prefixes
SESSIONS = ["a", "b", "c", "d"]


def _chain_of(contents: list[str]):
    chain = mint_chain("m", None, None, [{"role": "user", "content": c} for c in contents])
    tokens, total = [50], 50  # c0 (tools) then 100 tokens a message: a function of the prefix
    for _ in contents:
        total += 100
        tokens.append(total)
    return chain, tuple(tokens)


step = st.tuples(
    st.sampled_from(["begin", "end", "abort", "pause", "resume", "mark"]),
    st.sampled_from(SESSIONS),
    st.sampled_from(["w0", "w1"]),
    st.lists(st.sampled_from(MESSAGES), max_size=3),
    st.integers(0, 3000),
)


def _expected(programs: dict[str, Program], worker: str, weight: float) -> float:
    here = [p for p in programs.values() if p.active and p.home_worker == worker]
    total = sum((1.0 if p.phase is Phase.REASONING else weight) * p.demand_tokens() for p in here)
    nodes: dict[str, list[int]] = {}
    for p in here:
        if p.chain is None:
            continue
        prev = 0
        for cid, cum in zip(p.chain.ids, p.chain_tokens):
            nodes.setdefault(cid, []).append(cum - prev)
            prev = cum
    shared = sum(seg[0] * (len(seg) - 1) for seg in nodes.values())
    return total - shared + BUF * len(here)


@settings(max_examples=120, deadline=None)
@given(steps=st.lists(step, min_size=1, max_size=30), weight=st.sampled_from([1.0, 0.5, 0.0]))
def test_incremental_load_equals_recomputation_from_program_states(steps, weight):
    ledger, _ = make(weight=weight)
    programs: dict[str, Program] = {}
    n = 0
    for kind, s, w, contents, prompt in steps:
        n += 1
        p = programs.get(s)
        if p is None:
            p = programs[s] = Program(SessionId(s), created_at=0.0)
            p.place(w, 0.0)
        if kind == "begin" and p.active:
            chain, tokens = _chain_of(contents)
            p.begin_call(req(s, f"r{n}", prompt, chain=chain, chain_tokens=tokens), RESERVE, n)
        elif kind in ("end", "abort") and p.in_flight:
            rid = next(iter(p.in_flight))
            p.end_call(rid, Usage(prompt, 10) if kind == "end" else None, n)
        elif kind == "pause" and p.active and p.phase is Phase.ACTING:
            p.pause()
        elif kind == "resume" and p.paused:
            p.resume(w, n)
        elif kind == "mark" and p.active and p.phase is Phase.REASONING and not p.marked:
            p.mark()
        ledger.refresh(p)
        for worker in ("w0", "w1"):
            assert ledger.load_tokens(worker) == pytest.approx(_expected(programs, worker, weight))
            n_here = sum(1 for q in programs.values() if q.active and q.home_worker == worker)
            assert len(ledger.worker(worker).programs) == n_here
