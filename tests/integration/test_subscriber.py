"""The gateway's KV-event subscriber (controller/subscriber.py) on real ZMQ sockets.

Events come from a real simworker, or from :class:`FramePublisher`: vLLM 0.32's
``ZmqEventPublisher`` framing (``[topic, seq (8 B big-endian), msgpack batch]``) and replay
ROUTER (``[b"", start]`` → ``[b"", topic, seq, payload]``… then seq −1), written here with
knobs to lose frames on purpose. The gateway's index is compared with a baseline index built
from the publisher's whole history, so "repaired" means "equal to never having lost a thing".
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

import msgspec
import pytest
import zmq
from tests.support.fake_vllm import FakeState, create_fake
from entry.ports import free_port
from tests.support.gateway_harness import (ADMIN, ServerThread, applier_stalled, gateway,
                                           serve_config, wait_for)
from prometheus_client.parser import text_string_to_metric_families

from controller.kv_wire import offset_endpoint, worker_from_topic
from scheduler.kv_events import (
    EventBatch,
    EventBatchEncoder,
)
from simworker.worker import SimWorkerConfig, create_app
from tests.support.kv_streams import (
    BS,
    FramePublisher,
    Workload,
    applied_through,
    baseline,
    publisher,
    replay_all,
    snapshot,
    stats,
    sync,
)

DEAD_URL = f"http://127.0.0.1:{free_port()}"  # nothing listens: workers fed only by events


def index_of(gw, worker: str) -> tuple[dict, dict]:
    return snapshot(gw.parts.admission.policy.index.worker(worker))


def metric(gw, name: str, **labels: str) -> float | None:
    text = gw.client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def resets(gw, worker: str) -> dict[str, int]:
    return dict(stats(gw, worker).resets)


def worker_entry(name: str, pub: FramePublisher | None = None, **extra: Any) -> dict:
    entry: dict[str, Any] = {"name": name, "url": DEAD_URL, "capacity_tokens": 100_000, **extra}
    if pub is not None:
        entry["kv_events"] = pub.endpoint
        if pub.replay is not None:
            entry["replay"] = pub.replay
    return entry


def gateway_for(workers: list[dict], **overrides: Any):
    return gateway(serve_config(workers, health_interval_s=30.0, **overrides))


# -- pure helpers --------------------------------------------------------------------------------


def test_topics_name_the_longest_configured_worker_and_ranks_offset_vllms_way():
    names = ["w1", "w1@a", "gpu-0"]
    assert worker_from_topic(b"kv@w1@model", names) == "w1"
    assert worker_from_topic(b"kv@w1@a@org/model", names) == "w1@a"
    assert worker_from_topic(b"kv@gpu-0", names) == "gpu-0"
    assert worker_from_topic(b"kv@w2@model", names) is None
    assert worker_from_topic(b"other@w1@model", names) is None
    assert worker_from_topic(b"\xff", names) is None
    assert offset_endpoint("tcp://10.0.0.1:5558", 2) == "tcp://10.0.0.1:5560"
    assert offset_endpoint("tcp://10.0.0.1:5558", 0) == "tcp://10.0.0.1:5558"
    assert offset_endpoint("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint("inproc://replay", 1) == "inproc://replay_dp1"
    assert offset_endpoint(None, 1) is None


# -- a real simworker ----------------------------------------------------------------------------


def test_simworker_events_reach_the_gateway_index():
    sim_app = create_app(SimWorkerConfig(name="sim0", num_blocks=400, block_size=BS,
                                         kv_events="tcp://127.0.0.1:*", replay="tcp://127.0.0.1:*",
                                         time_scale=0.05))
    sim_server = ServerThread(sim_app).start()
    sim = sim_app.state.worker
    try:
        workers = [{"name": "sim0", "url": sim_server.url, "kv_events": sim.kv_endpoint,
                    "replay": sim.replay_endpoint},
                   {"name": "quiet", "url": DEAD_URL}]  # no events, no capacity: never chosen
        with gateway_for(workers, capacity_retry_s=0.05) as gw:
            wait_for(lambda: gw.parts.workers.states["sim0"].capacity_tokens, what="sim0 capacity")
            body = {"model": "sluice-sim", "max_tokens": 8, "messages": [
                {"role": "system", "content": "You are a careful engineer. " * 30},
                {"role": "user", "content": "Fix the failing test."}]}
            r = gw.client.post("/v1/chat/completions", json=body, headers={"x-session-id": "sess-1"})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            last = sim.publisher.next_seq - 1
            assert last >= 0
            applied_through(gw, "sim0", last)
            index = gw.parts.admission.policy.index
            resident = index.session_tokens("sim0", "sess-1")
            prompt = usage["prompt_tokens"]
            assert prompt // BS * BS <= resident <= prompt + usage["completion_tokens"]
            # exactly what the worker published, from seq 0 (however late the SUB joined)
            assert index_of(gw, "sim0") == baseline(replay_all(sim.replay_endpoint))
            assert metric(gw, "sluice_worker_utilization_source", worker="sim0") == 1.0
            assert metric(gw, "sluice_worker_utilization_source", worker="quiet") == 0.0
            assert metric(gw, "sluice_kv_batches_applied_total", worker="sim0") == last + 1
            assert metric(gw, "sluice_kv_last_seq", worker="sim0", rank="0") == last
            listed = gw.client.get("/sluice/workers", headers=ADMIN).json()["workers"]
            assert {w["name"]: w["utilization_source"] for w in listed} == {
                "sim0": "kv_index", "quiet": "estimate"}
            assert not resets(gw, "sim0")
    finally:
        sim_server.stop()


# -- gaps, restarts, layouts, floods --------------------------------------------------------------


def test_a_worker_is_caught_up_from_its_replay_at_start_before_any_live_batch():
    """A gateway that starts after its engine has published (a restart) knows the engine's
    KV before the engine publishes again: the catch-up runs at start, not at the first live
    batch. Batches published meanwhile are applied once, with no reset."""
    work = Workload(seed=4)
    with publisher() as pub:
        for _ in range(12):
            pub.publish(work.batch())
        with gateway_for([worker_entry("w1", pub)]) as gw:
            applied_through(gw, "w1", 11)
            assert index_of(gw, "w1") == baseline(pub.history)
            assert stats(gw, "w1").replayed == 12 and stats(gw, "w1").received == 0
            for _ in range(8):
                pub.publish(work.batch())
            applied_through(gw, "w1", pub.next_seq - 1)
            assert index_of(gw, "w1") == baseline(pub.history)
            s = stats(gw, "w1")
            assert not s.resets and s.applied == 20, s


def test_a_gap_is_repaired_from_replay_to_the_no_gap_index():
    work = Workload(seed=1)
    with publisher() as pub, gateway_for([worker_entry("w1", pub)]) as gw:
        sync(gw, pub, "w1")
        for i in range(40):
            pub.publish(work.batch(), send=not 10 <= i < 20)  # ten frames lost on the way
        last = pub.next_seq - 1
        applied_through(gw, "w1", last)
        assert index_of(gw, "w1") == baseline(pub.history)
        lost = pub.history[-30:-20]
        assert baseline([p for p in pub.history if p not in lost]) != baseline(pub.history)
        s = stats(gw, "w1")
        assert s.gaps_repaired == 1 and s.replayed >= 10 and not s.resets
        assert metric(gw, "sluice_kv_gaps_repaired_total", worker="w1") == 1
        assert metric(gw, "sluice_kv_batches_received_total", worker="w1") == s.received


def test_an_unknown_event_type_is_skipped_and_the_rest_of_its_batch_applied():
    work = Workload(seed=5)
    with publisher() as pub, gateway_for([worker_entry("w1", pub)]) as gw:
        sync(gw, pub, "w1")
        known = [EventBatchEncoder().encode(EventBatch(time.time(), work.batch(), 0)) for _ in range(3)]
        for payload in known:
            ts, events, rank = msgspec.msgpack.decode(payload)
            events.insert(len(events) // 2, {"type": "BlockMovedToTier", "block_hashes": [1], "tier": "cpu"})
            pub.publish_raw(msgspec.msgpack.encode([ts, events, rank]))
        applied_through(gw, "w1", pub.next_seq - 1)
        assert index_of(gw, "w1") == baseline(known)
        assert stats(gw, "w1").events_skipped == 3 and not resets(gw, "w1")
        assert metric(gw, "sluice_kv_events_skipped_total", worker="w1") == 3


def test_a_gap_beyond_the_replay_buffer_resets_and_rebuilds():
    work = Workload(seed=2)
    with publisher(buffer_steps=5) as pub, gateway_for([worker_entry("w1", pub)]) as gw:
        sync(gw, pub, "w1")
        for i in range(31):
            pub.publish(work.batch(), send=not 10 <= i < 30)  # 20 lost, the buffer keeps 5
        last = pub.next_seq - 1
        applied_through(gw, "w1", last)
        assert resets(gw, "w1") == {"gap_beyond_replay": 1}
        # rebuilt from what the replay still held (the last 4 lost) and the batch after
        assert index_of(gw, "w1") == baseline(pub.history[-5:])
        assert metric(gw, "sluice_kv_index_resets_total", worker="w1", reason="gap_beyond_replay") == 1
        assert stats(gw, "w1").gaps_repaired == 0


@pytest.mark.parametrize("epochs", [False, True], ids=["seq-backwards", "new-epoch"])
def test_an_engine_restart_resets_the_workers_index(epochs):
    first = FramePublisher(epoch=b"epoch-1" if epochs else None)
    endpoint, replay = first.endpoint, first.replay
    work = Workload(seed=3)
    try:
        with gateway_for([worker_entry("w1", first)]) as gw:
            sync(gw, first, "w1")
            for _ in range(20):
                first.publish(work.batch())
            applied_through(gw, "w1", first.next_seq - 1)
            first.close()
            # the engine comes back on the same sockets; its seq starts over
            with publisher(endpoint=endpoint, replay=replay, bind=True,
                           epoch=b"epoch-2" if epochs else None) as second:
                fresh = Workload(seed=4, base=10_000)
                time.sleep(0.3)  # the SUB reconnects every 100 ms
                seq = second.publish(fresh.batch())
                deadline = time.monotonic() + 5
                while not resets(gw, "w1"):  # batches lost before the SUB reconnected are
                    assert time.monotonic() < deadline  # caught up from the new replay
                    time.sleep(0.05)
                    seq = second.publish(fresh.batch())
                assert seq < 20
                applied_through(gw, "w1", seq)
                assert resets(gw, "w1") == {"epoch_changed" if epochs else "seq_backwards": 1}
                assert index_of(gw, "w1") == baseline(second.history)
    finally:
        first.close()


def test_llm_d_layout_routes_by_topic_and_by_rank():
    bind = f"tcp://127.0.0.1:{free_port()}"
    with publisher(endpoint=bind, topic="kv@w1@org/model") as rank0, \
            publisher(endpoint=bind, topic="kv@w1@org/model", rank=1) as rank1, \
            publisher(endpoint=bind, topic="kv@w1@org/model", rank=2, replay=None) as rank2, \
            publisher(endpoint=bind, topic="kv@ghost@org/model", replay=None) as ghost:
        workers = [worker_entry("w1", replay=rank0.replay), worker_entry("w2"),
                   worker_entry("w1#dp1", replay=rank1.replay)]
        with gateway_for(workers, kv_events_bind=bind, kv_replay_timeout_s=0.3) as gw:
            sync(gw, rank0, "w1")
            sync(gw, rank1, "w1#dp1", rank=1)
            sync(gw, rank2, "w1", rank=2)  # no w1#dp2: rank 2 shares w1's index
            a, b, c = Workload(5, base=1), Workload(6, base=100_000), Workload(7, base=200_000)
            for _ in range(15):
                rank0.publish(a.batch())
                rank1.publish(b.batch())
                rank2.publish(c.batch())
            applied_through(gw, "w1", rank0.next_seq - 1)
            applied_through(gw, "w1#dp1", rank1.next_seq - 1, rank=1)
            applied_through(gw, "w1", rank2.next_seq - 1, rank=2)
            assert index_of(gw, "w1") == baseline(rank0.history, rank2.history)
            assert index_of(gw, "w1#dp1") == baseline(rank1.history)
            assert index_of(gw, "w2") == ({}, {})
            deadline = time.monotonic() + 5
            while not gw.parts.kv_events.ignored["unknown_topic"]:
                assert time.monotonic() < deadline, "ghost's frames never arrived"
                ghost.publish(Workload(8).batch())
                time.sleep(0.05)
            assert metric(gw, "sluice_kv_messages_ignored_total", reason="unknown_topic") >= 1
            assert metric(gw, "sluice_worker_utilization_source", worker="w2") == 0.0
            assert metric(gw, "sluice_worker_utilization_source", worker="w1#dp1") == 1.0
            assert not resets(gw, "w1") and not resets(gw, "w1#dp1")


def test_a_flood_beyond_the_queue_is_dropped_counted_and_repaired():
    work = Workload(seed=9)
    with publisher() as pub, gateway_for([worker_entry("w1", pub)], kv_events_queue=4) as gw:
        sync(gw, pub, "w1")
        with applier_stalled(gw):
            before = stats(gw, "w1").received
            for _ in range(200):
                pub.publish(work.batch())
            wait_for(lambda: stats(gw, "w1").received - before == 200, what="the flood to be read")
            dropped = stats(gw, "w1").dropped
            assert dropped >= 200 - 4 - 1  # the queue holds 4, the applier 1
            assert gw.parts.kv_events.queue_depths()["w1"] == 4
        # the flood ended with dropped batches that no later batch reveals: the drained
        # queue triggers their repair all the same
        applied_through(gw, "w1", pub.next_seq - 1)
        # the repair counts itself once its replay has ended, a moment after its last batch
        wait_for(lambda: stats(gw, "w1").gaps_repaired >= 1, what="the repair to be counted")
        assert index_of(gw, "w1") == baseline(pub.history)
        s = stats(gw, "w1")
        assert s.dropped == dropped and s.replayed >= dropped
        assert s.gaps_repaired >= 1 and not s.resets
        assert metric(gw, "sluice_kv_batches_dropped_total", worker="w1") == dropped
        for _ in range(5):  # and the stream goes on
            pub.publish(work.batch())
        applied_through(gw, "w1", pub.next_seq - 1)
        assert index_of(gw, "w1") == baseline(pub.history) and not stats(gw, "w1").resets


@pytest.mark.parametrize("case", ["no_replay", "replay_failed", "undecodable"])
def test_an_unrepairable_stream_resets_by_reason_and_rebuilds(case):
    work = Workload(seed=10)
    with publisher(replay=None if case != "undecodable" else "tcp://127.0.0.1:*") as pub:
        extra = {"replay": f"tcp://127.0.0.1:{free_port()}"} if case == "replay_failed" else {}
        with gateway_for([worker_entry("w1", pub, **extra)], kv_replay_timeout_s=0.3) as gw:
            sync(gw, pub, "w1")
            for _ in range(5):
                pub.publish(work.batch())
            if case == "undecodable":
                pub.publish_raw(b"\x93not a batch")
            else:
                pub.publish(work.batch(), send=False)
            cut = pub.next_seq
            for _ in range(5):
                pub.publish(work.batch())
            applied_through(gw, "w1", pub.next_seq - 1)
            assert resets(gw, "w1") == {case: 1}
            assert index_of(gw, "w1") == baseline(pub.history[cut:])
            assert metric(gw, "sluice_worker_utilization_source", worker="w1") == 1.0


# -- failures are logged and the loops restarted -------------------------------------------------


def test_a_failing_applier_is_logged_reset_and_restarted():
    work = Workload(seed=11)
    with publisher() as pub, gateway_for([worker_entry("w1", pub)]) as gw:
        sync(gw, pub, "w1")
        policy = gw.parts.admission.policy
        real = policy.observe_kv
        calls = {"n": 0}

        def flaky(worker, batch):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("index bug")
            return real(worker, batch)

        policy.observe_kv = flaky
        for _ in range(10):
            pub.publish(work.batch())
        applied_through(gw, "w1", pub.next_seq - 1)
        assert resets(gw, "w1") == {"subscriber_error": 1}
        # the batch that failed half-way is gone with the reset; the replay brings it all back
        assert index_of(gw, "w1") == baseline(pub.history)
        failed = [line for line in gw.log.lines() if "KV-event loop failed" in line]
        assert len(failed) == 1 and '"loop": "applier"' in failed[0] and '"worker": "w1"' in failed[0]
        assert "RuntimeError: index bug" in failed[0]


def test_a_busy_bind_address_is_retried_with_backoff():
    port = free_port()
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.PUB)
    squatter.setsockopt(zmq.LINGER, 0)
    squatter.bind(f"tcp://127.0.0.1:{port}")
    try:
        with gateway_for([worker_entry("w1")], kv_events_bind=f"tcp://127.0.0.1:{port}") as gw:
            wait_for(lambda: any("KV-event loop failed" in line for line in gw.log.lines()),
                     what="the bind failure to be logged")
            assert gw.client.get("/health").status_code in (200, 503)  # the gateway still serves
            squatter.close(linger=0)
            wait_for(lambda: gw.parts.kv_events.bound_endpoint, timeout=8, what="the bind to succeed")
            failed = [line for line in gw.log.lines() if "KV-event loop failed" in line]
            assert f'"endpoint": "tcp://127.0.0.1:{port}"' in failed[0] and "retry_s" in failed[0]
    finally:
        squatter.close(linger=0)
        ctx.term()


# -- worker health and ipc endpoints ----------------------------------------------------------


def test_worker_marked_unhealthy_has_its_kv_index_cleared_at_once():
    """A worker that stops answering /health has probably restarted with an empty cache: its
    index is emptied when the health check marks it down, not at its first new event."""
    fake = FakeState("w0")
    server = ServerThread(create_fake(fake)).start()
    work = Workload(seed=3)
    try:
        with publisher() as pub, gateway(serve_config(
                [worker_entry("w0", pub, url=server.url)],
                health_interval_s=0.05, unhealthy_after=1)) as gw:
            sync(gw, pub, "w0")
            for _ in range(5):
                pub.publish(work.batch())
            applied_through(gw, "w0", pub.next_seq - 1)
            assert index_of(gw, "w0")[0], "the index holds the worker's blocks"
            fake.healthy = False  # the engine went away; no event says so
            wait_for(lambda: not gw.workers()["w0"]["healthy"], what="worker marked down")
            assert index_of(gw, "w0") == ({}, {})
            assert not gw.parts.admission.policy.index.has_events("w0")
    finally:
        server.stop()


def test_kv_events_over_an_absolute_ipc_path_reach_the_gateway_index():
    # A short directory of its own: a Unix socket path holds at most 107 bytes.
    directory = tempfile.mkdtemp(prefix="sluice-ipc-")
    endpoint = f"ipc://{directory}/kv.sock"
    work = Workload(seed=4)
    try:
        with publisher(endpoint=endpoint, replay=None, bind=True) as pub, \
                gateway_for([worker_entry("w1", pub)]) as gw:
            assert gw.parts.kv_events is not None and pub.endpoint == endpoint
            sync(gw, pub, "w1")
            for _ in range(5):
                pub.publish(work.batch())
            applied_through(gw, "w1", pub.next_seq - 1)
            assert index_of(gw, "w1") == baseline(pub.history)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
