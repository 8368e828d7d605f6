"""The ledger's hot reads (``load_tokens``, ``utilization``, ``utilizations``,
``utilization_with``) inline ``shared_tokens`` and the index's ``has_events``: on random
histories of programs, KV events, clears, resets and dropped workers, each equals, to the bit,
the formula the ledger documents computed the slow way through the public queries. And the
chain nodes a refresh reuses from the program's previous chain are those computed from
scratch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.calls import CallRequest, Usage
from scheduler.config import ProgramAwareConfig
from scheduler.coordinates import SessionId, mint_chain
from scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from scheduler.kv_index import KVIndex
from scheduler.ledger import UNKNOWN_CAPACITY_UTILIZATION, Ledger
from scheduler.programs import Program

WORKERS = ("w0", "w1", "w2")
SESSIONS = ("a", "b", "c", "d")
HASHES = (1, 2, 3, 4, 5, 6)
MESSAGES = ({"role": "system", "content": "s"}, {"role": "user", "content": "t"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"})


def _chain(length: int, branch: int):
    """A chain of ``length`` messages, its last ``branch`` of them changed (a divergence)."""
    messages = [dict(m, content=m["content"] + ("!" if i >= length - branch else ""))
                for i, m in enumerate(MESSAGES[:length])]
    return mint_chain("m", None, None, messages)


def _slow_segments(program: Program) -> tuple:
    if program.chain is None or program.chain_tokens is None:
        return ()
    out, previous = [], 0
    for cid, cumulative in zip(program.chain.ids, program.chain_tokens):
        out.append((cid, max(0, cumulative - previous)))
        previous = cumulative
    return tuple(out)


def _slow_load(ledger: Ledger, index: KVIndex, name: str) -> float:
    load = ledger.worker(name)
    shared = load.ancestry_shared
    if index.has_events(name):
        shared = max(shared, index.worker(name).shared_tokens)
    return load.weighted_demand - shared + ledger.weights.buffer_per_program * len(load.programs)


op = st.one_of(
    st.tuples(st.just("call"), st.sampled_from(SESSIONS), st.sampled_from(WORKERS),
              st.integers(0, 5000), st.integers(0, 3000), st.booleans(), st.integers(0, 4),
              st.integers(0, 2), st.booleans()),
    st.tuples(st.just("store"), st.sampled_from(WORKERS), st.sampled_from(SESSIONS),
              st.lists(st.sampled_from(HASHES), min_size=1, max_size=4, unique=True)),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS),
              st.lists(st.sampled_from(HASHES), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS)),
    st.tuples(st.just("reset"), st.sampled_from(WORKERS)),
    st.tuples(st.just("drop"), st.sampled_from(WORKERS)),
    st.tuples(st.just("forget"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("capacity"), st.sampled_from(WORKERS), st.integers(1, 20_000)),
)


@settings(max_examples=150, deadline=None)
@given(history=st.lists(op, max_size=30), extra=st.floats(0, 1e5), weight=st.floats(0, 1))
def test_hot_reads_equal_the_documented_formula(history, extra, weight):
    index = KVIndex()
    ledger = Ledger(ProgramAwareConfig(acting_token_weight=weight, buffer_per_program=100), index)
    for w in WORKERS:
        ledger.add_worker(w, 10_000 if w != "w2" else None)
    programs: dict[str, Program] = {}
    for step, o in enumerate(history):
        kind = o[0]
        if kind == "call":
            _, session, worker, prompt, completion, acting, length, branch, dormant = o
            program = programs.get(session)
            if program is None or program.home_worker != worker:
                program = programs[session] = Program(SessionId(session), created_at=0.0)
                program.place(worker, 0.0)
            if program.in_flight:
                program.end_call(next(iter(program.in_flight)), Usage(prompt, completion), 1.0)
            chain = _chain(length, branch) if length else None
            nodes = len(chain.ids) if chain is not None else 0
            ramp = tuple(300 * (i + 1) for i in range(nodes))  # an extended chain keeps its counts
            program.begin_call(CallRequest(
                request_id=f"r{step}", session_id=SessionId(session), prompt_tokens=prompt,
                chain=chain, chain_tokens=ramp or None), 500, 0.0)
            ledger.refresh(program)
            if acting:
                program.end_call(f"r{step}", Usage(prompt, completion), 1.0)
                ledger.refresh(program)
                if dormant:
                    ledger.set_dormant(program)
            counted = ledger._counted[session]
            assert counted.chain == (() if ledger.is_dormant(session) else _slow_segments(program))
        elif kind == "store":
            _, worker, session, hashes = o
            index.apply_batch(worker, EventBatch(ts=float(step), events=[BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16 * len(hashes))),
                block_size=16, lora_id=None, medium="GPU", lora_name=None, session_id=session)]))
        elif kind == "remove":
            index.apply_batch(o[1], EventBatch(ts=float(step), events=[
                BlockRemoved(block_hashes=o[2], medium="GPU")]))
        elif kind == "clear":
            index.apply_batch(o[1], EventBatch(ts=float(step), events=[AllBlocksCleared()]))
        elif kind == "reset":
            index.reset_worker(o[1])
        elif kind == "drop":
            index.drop_worker(o[1])
        elif kind == "forget":
            ledger.forget(o[1])
            programs.pop(o[1], None)
        else:
            ledger.set_capacity(o[1], o[2])
        assert [(load.name, u) for load, u in ledger.utilizations()] == \
            [(w, ledger.utilization(w)) for w in ledger.worker_names()]
        for w in WORKERS:
            load, capacity = _slow_load(ledger, index, w), ledger.worker(w).capacity_tokens
            buffer = ledger.weights.buffer_per_program
            assert ledger.load_tokens(w) == load
            ancestry = ledger.worker(w).ancestry_shared
            assert ledger.shared_tokens(w) == (max(ancestry, index.worker(w).shared_tokens)
                                               if index.has_events(w) else ancestry)
            if capacity:
                assert ledger.utilization(w) == load / capacity
                assert ledger.utilization_with(w, extra) == (load + (extra + buffer)) / capacity
                assert ledger.utilization_with(w, extra, 2) == (load + (extra + buffer * 2)) / capacity
            else:
                assert ledger.utilization(w) == UNKNOWN_CAPACITY_UTILIZATION
                assert ledger.utilization_with(w, extra) == UNKNOWN_CAPACITY_UTILIZATION
