"""The KV index's ingest path (scheduler/kv_events.py ``EventBatchDecoder(token_ids=False)``,
scheduler/kv_index.py ``KVIndex.apply_batch``) against a straightforward reference: the same
events decoded in full and applied one at a time with ``WorkerKV.apply``, and the brute-force
replay of tests/unit/test_kv_index.py. The batch path leaves token ids unparsed and applies
consecutive removals at once; neither may change the state an index ends in.
"""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.kv_ingest import build_stream
from scheduler.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockStoredRaw,
    EventBatch,
    EventBatchDecoder,
    EventBatchEncoder,
    block_token_counts,
    raw_array_len,
)
from scheduler.kv_index import TUPLE_SESSIONS, KVIndex
from tests.unit.test_kv_index import CONTINUATIONS, SESSIONS, WORKERS, _replay, _replay_host, ops
from tests.unit.test_kv_index_bounds import assert_consistent, state

ENCODER = EventBatchEncoder()


def snapshot(index: KVIndex, worker: str) -> dict:
    """All of a worker's state, orders included, both media."""
    kv = index.worker(worker)
    host = index.host(worker)
    return {
        **state(kv),
        "order": list(kv.blocks),
        "zero_blocks": dict(kv._zero_blocks),
        "shared_blocks": {s: list(owned) for s, owned in kv.shared_blocks.items()},
        "continuation_blocks": {c: list(owned) for c, owned in kv.continuation_blocks.items()},
        "session_order": list(kv.session_tokens),
        "counted": list(kv.counted),
        "counts": [(h, b.counted) for h, b in kv.blocks.items()],
        "orphans": dict(kv._orphans),
        "counters": (kv.events_seen, kv.attributed_removals, kv.overflow_dropped),
        "host": (dict(host.blocks), dict(host.session_tokens),
                 {s: list(owned) for s, owned in host.session_blocks.items()},
                 host.events_seen, host.unknown_removals),
    }


def _event(op: tuple, i: int):
    kind = op[0]
    if kind == "store":
        _, _, hashes, session, parent, size, n_tokens, cont = op
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(n_tokens)),
                           block_size=size, lora_id=None, medium="GPU", lora_name=None,
                           session_id=session, continuation_id=cont)
    if kind == "remove":
        return BlockRemoved(block_hashes=op[2], medium="GPU", continuation_id=op[3], num_tokens=op[4])
    if kind == "clear":
        return AllBlocksCleared()
    if kind == "host_store":
        _, _, hashes, session, size, n_tokens = op
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(range(n_tokens)),
                           block_size=size, lora_id=None, medium="CPU", lora_name=None, session_id=session)
    assert kind == "host_remove"
    return BlockRemoved(block_hashes=op[2], medium="CPU")


def _run(history: list[tuple]) -> tuple[KVIndex, KVIndex]:
    """The history through both paths: (batched, one event at a time). Consecutive events of
    a worker go in one batch, through the wire and the ingest decoder."""
    batched, single = KVIndex(), KVIndex()
    decoder = EventBatchDecoder(token_ids=False)
    pending: list = []
    pending_worker = None

    def flush() -> None:
        if pending:
            payload = ENCODER.encode(EventBatch(0.0, list(pending)))
            batch = decoder.decode(payload)
            carried = batched.apply_batch(pending_worker, batch)
            assert carried == sum(len(getattr(e, "block_hashes", ())) for e in pending)
            pending.clear()

    for i, op in enumerate(history):
        kind, worker = op[0], op[1]
        if kind in ("count", "reset"):
            flush()
            for index in (batched, single):
                if kind == "reset":
                    index.reset_worker(worker)
                else:
                    index.worker(worker).set_counted(op[2], op[3])
            continue
        if worker != pending_worker:
            flush()
            pending_worker = worker
        event = _event(op, i)
        pending.append(event)
        if kind.startswith("host"):
            single.apply_events(worker, [event])
        else:
            kv = single.worker(worker)
            kv.apply(event)
    flush()
    return batched, single


@settings(max_examples=150, deadline=None)
@given(history=ops)
def test_batches_decoded_lean_end_where_single_events_and_the_brute_force_end(history):
    _check(history)


@st.composite
def evictions(draw) -> list[tuple]:
    """Stores of chains and the evictions the removal path settles by run (one worker): a
    store's blocks evicted together from the chain's head (the bench's order), from its tail
    (vLLM frees a request's blocks tail first), or any which way; branches, empty tail blocks,
    re-stores from block 0, touches by other sessions, unknown hashes, attributed removals."""
    history: list[tuple] = []
    chains: dict = {s: [] for s in SESSIONS + [None]}
    stores: list[list[int]] = []
    order: list[int] = []  # every hash stored, first store first
    fresh = iter(range(1000, 10**6))
    for _ in range(draw(st.integers(4, 24))):
        kind = draw(st.sampled_from(["store"] * 5 + ["restore", "head", "tail", "any", "count"]))
        if kind == "store":
            session = draw(st.sampled_from(SESSIONS + [None]))
            chain = chains[session]
            n = draw(st.integers(1, 6))
            hashes = [next(fresh) for _ in range(n)]
            pick = draw(st.integers(0, 5))
            # mostly the chain's tail; a root; a branch off any block stored before
            parent = (chain[-1] if chain and pick > 1 else
                      draw(st.sampled_from(order)) if order and pick == 1 else None)
            n_tokens = draw(st.sampled_from([n * 4, n * 4, 0, n * 4 - 2, max(n * 4 - 7, 1)]))
            history.append(("store", "w0", hashes, session, parent, 4, n_tokens,
                            draw(st.sampled_from(CONTINUATIONS + [None]))))
            chain.extend(hashes)
            stores.append(hashes)
            order.extend(hashes)
        elif kind == "restore" and stores:
            hashes = draw(st.sampled_from(stores))[: draw(st.integers(1, 6))]
            history.append(("store", "w0", hashes, draw(st.sampled_from(SESSIONS)), None, 4,
                            len(hashes) * 4, draw(st.sampled_from(CONTINUATIONS + [None]))))
        elif kind == "count":
            history.append(("count", "w0", draw(st.sampled_from(SESSIONS)), draw(st.booleans())))
        elif order:
            if kind == "head":
                gone = order[: draw(st.integers(1, 12))]
            elif kind == "tail":
                gone = list(reversed(draw(st.sampled_from(stores))))
            else:
                gone = draw(st.lists(st.sampled_from(order + [99]), min_size=1, max_size=12))
            for h in gone:
                if draw(st.integers(0, 9)):
                    history.append(("remove", "w0", [h], None, None))
                else:  # attributed: applied alone, between runs
                    history.append(("remove", "w0", [h], draw(st.sampled_from(CONTINUATIONS)),
                                    draw(st.sampled_from([None, 8, 40]))))
            order = [h for h in order if h not in gone]
    return history


@settings(max_examples=300, deadline=None)
@given(history=evictions())
def test_eviction_runs_end_where_single_events_and_the_brute_force_end(history):
    _check(history)


def _check(history: list[tuple]) -> None:
    batched, single = _run(history)
    for w in WORKERS:
        assert snapshot(batched, w) == snapshot(single, w), (w, history)
        assert_consistent(batched.worker(w))
        want = _replay(history, w, [])
        kv = batched.worker(w)
        assert kv.session_tokens == want["per_session"], (w, history)
        assert kv.shared_tokens == want["shared"]
        assert kv.holes == want["holes"] and kv.caps == want["caps"]
        assert (kv.unknown_removals, kv.attributed_removals, kv.evicted_tokens) == want["counters"]
        for c, best in want["conts"].items():
            assert kv.continuation_tokens([c]) == best
        want_host = _replay_host(history, w)
        assert {s: batched.host_tokens(w, s) for s in SESSIONS} == {s: want_host.get(s, 0) for s in SESSIONS}


def test_the_bench_stream_ends_in_the_same_state_by_either_path():
    fill, expected, steady = build_stream(seed=5, workers=2, batches=400, pool_blocks=600, sessions=12)
    lean, full = EventBatchDecoder(token_ids=False), EventBatchDecoder()
    batched, single = KVIndex(), KVIndex()
    carried = 0
    for i, (worker, payload) in enumerate(fill + steady):
        n = batched.apply_batch(worker, lean.decode(payload))
        if i >= len(fill):
            carried += n
        kv = single.worker(worker)
        for event in full.decode(payload).events:
            kv.apply(event)
    assert carried == expected
    for worker in ("w0", "w1"):
        assert snapshot(batched, worker) == snapshot(single, worker)
        assert_consistent(batched.worker(worker))


def test_a_block_many_sessions_touch_keeps_them_in_order_past_the_tuple():
    index = KVIndex()
    names = [f"s{i}" for i in range(TUPLE_SESSIONS + 3)]
    for name in names:
        index.worker("w").set_counted(name, True)
    events = [BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(20)),
                          block_size=16, lora_id=None, medium="GPU", lora_name=None, session_id=name)
              for name in names + names[:2]]
    index.apply_batch("w", EventBatch(0.0, events))
    kv = index.worker("w")
    assert list(kv.blocks[1].sessions) == names
    assert kv.session_tokens == {name: 20 for name in names}
    assert kv.shared_tokens == 20 * (len(names) - 1)
    assert_consistent(kv)
    index.apply_batch("w", EventBatch(0.0, [BlockRemoved(block_hashes=[1, 2], medium="GPU")]))
    assert kv.session_tokens == {} and kv.shared_tokens == 0 and kv.shared_blocks == {}


# -- the ingest decoder ------------------------------------------------------------------------


@pytest.mark.parametrize("n_tokens", [0, 5, 15, 16, 20, 47, 48, 300, 70_000])
def test_unparsed_token_ids_count_as_parsed_ones(n_tokens):
    ids = [random.Random(n_tokens).randrange(151_936) for _ in range(n_tokens)]
    event = BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=ids, block_size=16,
                        lora_id=None, medium="GPU", lora_name=None)
    payload = ENCODER.encode(EventBatch(1.0, [event]))
    (raw,) = EventBatchDecoder(token_ids=False).decode(payload).events
    assert isinstance(raw, BlockStoredRaw) and isinstance(raw, BlockStored)
    assert raw_array_len(raw.token_ids) == n_tokens
    assert block_token_counts(raw) == block_token_counts(event)
    assert ENCODER.encode(EventBatch(1.0, [raw])) == payload  # the same bytes back


@pytest.mark.parametrize("token_ids", ["abc", None, {"a": 1}, 7, b"\x01"])
def test_token_ids_that_are_no_array_fail_the_batch_as_the_full_decoder_fails_it(token_ids):
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
             "token_ids": token_ids, "block_size": 16, "lora_id": None, "medium": None, "lora_name": None}
    payload = msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [9], "medium": None},
                                            event]])
    with pytest.raises(msgspec.DecodeError) as full:
        EventBatchDecoder().decode(payload)
    with pytest.raises(msgspec.DecodeError) as lean:
        EventBatchDecoder(token_ids=False).decode(payload)
    assert str(lean.value) == str(full.value)


def test_the_ingest_decoder_skips_and_counts_unknown_types_as_the_full_one_does():
    stored = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
              "token_ids": list(range(20)), "block_size": 16, "lora_id": None, "medium": None,
              "lora_name": None}
    payload = msgspec.msgpack.encode([0.0, [{"type": "NewEngineEvent", "x": 1}, stored,
                                            {"type": "BlockRemoved", "block_hashes": [1], "medium": None}]])
    lean = EventBatchDecoder(token_ids=False)
    batch = lean.decode(payload)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
    assert lean.skipped == {"NewEngineEvent": 1} and lean.skipped_total == 1
    assert block_token_counts(batch.events[0]) == [16, 4]
    # a known event that breaks its schema still fails the batch
    broken = msgspec.msgpack.encode([0.0, [{"type": "NewEngineEvent"}, {**stored, "block_size": "x"}]])
    with pytest.raises(msgspec.DecodeError):
        lean.decode(broken)


def test_events_seen_counts_the_gpu_events_of_any_iterable_once():
    def stored(hashes, medium="GPU"):
        return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(range(16 * len(hashes))),
                           block_size=16, lora_id=None, medium=medium, lora_name=None, session_id="a")

    events = [stored([1, 2]), BlockRemoved(block_hashes=[1], medium="GPU"), stored([3], "CPU"),
              BlockRemoved(block_hashes=[2], medium="GPU", continuation_id="c", num_tokens=32),
              BlockRemoved(block_hashes=[3], medium="CPU"), AllBlocksCleared(), stored([4])]
    for feed in (list, iter):
        index = KVIndex()
        assert index.apply_events("w", feed(events)) == 7
        assert index.worker("w").events_seen == 5  # the host tier's two are the host's
        assert index.host("w").events_seen == 2
