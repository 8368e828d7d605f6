"""What the gateway's KV-event subscriber (controller/subscriber.py) does with input that is not
a well-behaved engine's, on real ZMQ sockets on 127.0.0.1:

- a message that does not decode is counted and dropped: it is not a gap, nor a restart, and
  the worker's index is left as it was (only the replay's own copy of a batch not decoding
  loses that batch);
- no socket reads a frame over ``MAX_MESSAGE_BYTES`` (controller/kv_wire.py), neither the
  subscriber nor the replay DEALER, and a worker's queue holds at most ``QUEUE_BYTES_LIMIT``
  bytes of batches.

"Forged" frames go out on the publisher's socket without entering its history or its replay
buffer: a stranger's frames on the worker's topic, which the replay knows nothing of.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from controller.kv_wire import MAX_MESSAGE_BYTES
from controller.subscriber import QUEUE_BYTES_LIMIT
from entry.ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from scheduler.kv_events import BlockStored, EventBatch, EventBatchEncoder
from tests.support.gateway_harness import applier_stalled, gateway, serve_config, wait_for
from tests.support.kv_streams import BS, FramePublisher, Workload, baseline, publisher, snapshot

DEAD_URL = f"http://127.0.0.1:{free_port()}"  # nothing listens: workers fed only by events
WAIT_S = 60.0  # generous: a loaded 2-core machine moves tens of MB over loopback slowly
FORGED_HASH = 987_654_321_000  # a block no Workload ever stores (theirs count up from 1)


def gateway_for(pub: FramePublisher, **overrides: Any):
    entry: dict[str, Any] = {"name": "w1", "url": DEAD_URL, "capacity_tokens": 100_000,
                             "kv_events": pub.endpoint}
    if pub.replay is not None:
        entry["replay"] = pub.replay
    return gateway(serve_config([entry], health_interval_s=30.0, **overrides))


def stats(gw, worker: str = "w1"):
    return gw.parts.kv_events.stats[worker]


def index_of(gw, worker: str = "w1") -> tuple[dict, dict]:
    return snapshot(gw.parts.admission.policy.index.worker(worker))


def metric(gw, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(gw.client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def applied_through(gw, seq: int, worker: str = "w1") -> None:
    wait_for(lambda: stats(gw, worker).last_seq.get(0) == seq
             and gw.parts.kv_events.queue_depths().get(worker, 0) == 0,
             timeout=WAIT_S, what=f"{worker} to apply seq {seq}")


def sync(gw, pub: FramePublisher) -> None:
    """Publish empty batches until the gateway applies one (the SUB is connected and
    subscribed, again after a dropped connection)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        seq = pub.publish([])
        try:
            wait_for(lambda: stats(gw).last_seq.get(0) == seq, timeout=0.3)
            return
        except AssertionError:
            assert time.monotonic() < deadline, "w1 never received events"


def forge(pub: FramePublisher, seq: int, payload: bytes) -> None:
    """A frame on the worker's topic that the publisher's history and replay never hold."""
    pub.pub.send_multipart([pub.topic, seq.to_bytes(8, "big"), payload])


def padded_batch(size: int, block_hash: int = FORGED_HASH, rank: int = 0) -> bytes:
    """A batch that decodes (one BlockStored of ``block_hash``) and is ``size`` bytes or more:
    the padding is a key the decoder skips, as it skips any key it does not know."""
    event = msgspec.msgpack.decode(EventBatchEncoder().encode(EventBatch(time.time(), [
        BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=list(range(BS)),
                    block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                    session_id="forged")], rank)))
    event[1][0]["padding"] = b"\0" * size
    return msgspec.msgpack.encode(event)


# Payloads that do not decode, each failing somewhere else: not msgpack at all (the reader's
# rank peek fails), msgpack that is no batch (the peek reads a rank from it, the applier fails),
# a batch whose event breaks its schema, and nesting deeper than msgspec decodes (RecursionError).
UNDECODABLE = {
    "not_msgpack": b"\xc1\xc1\xc1",
    "not_a_batch": b"\x93not a batch",
    "broken_event": msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}], 0]),
    "nested_too_deep": b"\x93\xcb" + b"\0" * 8 + b"\x91" * 100_000 + b"\x90\x00",
}


# -- undecodable input ------------------------------------------------------------------------


@pytest.mark.parametrize("with_replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("kind", sorted(UNDECODABLE))
def test_an_undecodable_message_is_counted_and_dropped_and_the_index_kept(kind, with_replay):
    work = Workload(seed=21)
    with publisher(replay="tcp://127.0.0.1:*" if with_replay else None) as pub, \
            gateway_for(pub, kv_replay_timeout_s=1.0) as gw:
        sync(gw, pub)
        for _ in range(5):
            pub.publish(work.batch())
        # The seq the engine's next batch will carry, and one far ahead: neither may be taken
        # for a restart or a gap.
        forge(pub, pub.next_seq, UNDECODABLE[kind])
        forge(pub, 1 << 40, UNDECODABLE[kind])
        for i in range(6):
            pub.publish(work.batch(), send=not (with_replay and i == 2))  # a real gap, too
        applied_through(gw, pub.next_seq - 1)
        s = stats(gw)
        assert s.undecodable == 2 and not s.resets
        assert index_of(gw) == baseline(pub.history)
        assert gw.parts.kv_events.ignored["undecodable"] == 2
        assert metric(gw, "sluice_kv_messages_ignored_total", reason="undecodable") == 2
        if with_replay:
            assert s.gaps_repaired == 1  # the real gap is still told apart, and repaired
        assert not [line for line in gw.log.lines() if "KV-event loop failed" in line]


def test_a_stranger_on_the_bound_socket_cannot_wipe_a_worker_with_garbage():
    bind = f"tcp://127.0.0.1:{free_port()}"
    work = Workload(seed=22)
    with publisher(endpoint=bind, topic="kv@w1@org/model") as pub:
        entry = {"name": "w1", "url": DEAD_URL, "capacity_tokens": 100_000, "replay": pub.replay}
        with gateway(serve_config([entry], health_interval_s=30.0, kv_events_bind=bind)) as gw:
            sync(gw, pub)
            for _ in range(5):
                pub.publish(work.batch())
            applied_through(gw, pub.next_seq - 1)
            held = index_of(gw)
            assert held[0]
            ctx = zmq.Context()
            stranger = ctx.socket(zmq.PUB)
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.connect(bind)
            try:
                deadline = time.monotonic() + WAIT_S
                while not stats(gw).undecodable:  # until its subscription reached the stranger
                    assert time.monotonic() < deadline, "the stranger's frames never arrived"
                    stranger.send_multipart([b"kv@w1@org/model", pub.next_seq.to_bytes(8, "big"),
                                             UNDECODABLE["not_a_batch"]])
                    time.sleep(0.05)
            finally:
                stranger.close(linger=0)
                ctx.term()
            assert index_of(gw) == held and not stats(gw).resets
            for _ in range(5):
                pub.publish(work.batch())
            applied_through(gw, pub.next_seq - 1)
            assert index_of(gw) == baseline(pub.history) and not stats(gw).resets


def test_a_replayed_batch_nested_too_deep_is_lost_not_a_crash():
    """The replay's copy is the engine's own: a batch of it that does not decode is lost, so
    the index is reset (reason ``undecodable``) and rebuilt, and the applier does not fail."""
    work = Workload(seed=23)
    with publisher() as pub, gateway_for(pub) as gw:
        sync(gw, pub)
        for _ in range(5):
            pub.publish(work.batch())
        pub.publish_raw(UNDECODABLE["nested_too_deep"], send=False)  # lost on the way
        cut = pub.next_seq
        for _ in range(5):
            pub.publish(work.batch())
        applied_through(gw, pub.next_seq - 1)
        assert dict(stats(gw).resets) == {"undecodable": 1}
        assert stats(gw).undecodable == 1
        assert index_of(gw) == baseline(pub.history[cut:])
        assert not [line for line in gw.log.lines() if "KV-event loop failed" in line]


# -- size limits ------------------------------------------------------------------------------


def test_a_frame_over_the_size_limit_is_never_read():
    work = Workload(seed=24)
    with publisher() as pub, gateway_for(pub) as gw:
        sync(gw, pub)
        for _ in range(3):
            pub.publish(work.batch())
        # A large batch well under the limit still goes through: a 20,000-block prefill.
        hashes = list(range(10_000_000, 10_020_000))
        pub.publish([BlockStored(block_hashes=hashes, parent_block_hash=None,
                                 token_ids=[151_000 + i % 900 for i in range(len(hashes) * BS)],
                                 block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                                 session_id="big")])
        assert len(pub.history[-1]) > 1_000_000
        # Over the limit, on a rank of its own from seq 0: read, it would be applied at once.
        forge(pub, 0, padded_batch(MAX_MESSAGE_BYTES, rank=7))
        sync(gw, pub)  # the SUB lost its connection over it, and is back
        for _ in range(3):
            pub.publish(work.batch())
        applied_through(gw, pub.next_seq - 1)
        assert 7 not in stats(gw).last_seq
        assert FORGED_HASH not in index_of(gw)[0]
        assert index_of(gw) == baseline(pub.history)  # what the SUB missed came from replay
        assert not stats(gw).resets and not stats(gw).undecodable


def test_a_replay_answer_over_the_size_limit_is_refused():
    work = Workload(seed=25)
    with publisher() as pub, gateway_for(pub, kv_replay_timeout_s=1.0) as gw:
        sync(gw, pub)
        for _ in range(3):
            pub.publish(work.batch())
        pub.publish_raw(padded_batch(MAX_MESSAGE_BYTES), send=False)  # only the replay holds it
        cut = pub.next_seq
        for _ in range(3):
            pub.publish(work.batch())
        applied_through(gw, pub.next_seq - 1)
        # The DEALER dropped the connection rather than read the answer: no answer in time.
        assert dict(stats(gw).resets) == {"replay_failed": 1}
        assert FORGED_HASH not in index_of(gw)[0]
        assert index_of(gw) == baseline(pub.history[cut:])


def test_a_workers_queue_holds_a_bounded_number_of_bytes():
    size = QUEUE_BYTES_LIMIT * 3 // 8  # two fit in the queue, a third does not
    assert size < MAX_MESSAGE_BYTES
    with publisher() as pub, gateway_for(pub) as gw:
        sync(gw, pub)
        with applier_stalled(gw, WAIT_S):
            before = stats(gw).received
            for n in range(4):
                pub.publish_raw(padded_batch(size, block_hash=FORGED_HASH + n))
            wait_for(lambda: stats(gw).received - before == 4, timeout=WAIT_S,
                     what="the four large batches to be read")
            # The applier holds one batch; of the three others the queue takes two at most.
            assert stats(gw).dropped >= 1
            assert gw.parts.kv_events._sources["w1"].queued_bytes <= QUEUE_BYTES_LIMIT
        applied_through(gw, pub.next_seq - 1)  # the drops are repaired from replay
        assert index_of(gw) == baseline(pub.history)
        assert not stats(gw).resets
