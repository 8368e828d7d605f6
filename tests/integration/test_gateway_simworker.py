"""The gateway in front of a real simworker (simworker/worker.py): capacity learnt from its
/metrics, a Claude Code session labelled on its KV events, streaming with the usage chunk
the gateway asked for removed, the real usage in the policy, and the policy's retention
directives applied by the simworker's engine model."""

from __future__ import annotations

import re
import time

import msgspec
import pytest
import zmq
from tests.support.gateway_harness import ServerThread, gateway, serve_config, wait_for

from scheduler.kv_events import BlockStored, EventBatchDecoder
from simworker.worker import SimWorkerConfig, create_app

BLOCKS, BS = 400, 16


@pytest.fixture(scope="module")
def sim_fleet():
    app = create_app(SimWorkerConfig(name="sim0", num_blocks=BLOCKS, block_size=BS,
                                     kv_events="tcp://127.0.0.1:*", directives="tcp://127.0.0.1:*",
                                     time_scale=0.05))
    server = ServerThread(app).start()
    try:
        worker = app.state.worker
        config = serve_config([{"name": "sim0", "url": server.url,
                                "directives": worker.directives.bound_endpoint}],
                              capacity_retry_s=0.05)
        with gateway(config) as gw:
            yield gw, worker.kv_endpoint, worker
    finally:
        server.stop()


def _session_events(sub, session: str, timeout: float = 5.0) -> list[BlockStored]:
    decoder = EventBatchDecoder()
    found: list[BlockStored] = []
    deadline = time.monotonic() + timeout
    while not found:
        left = deadline - time.monotonic()
        assert left > 0, f"no BlockStored labelled {session}"
        if sub.poll(int(left * 1000)):
            frames = sub.recv_multipart()
            for event in decoder.decode(frames[2]).events:
                if isinstance(event, BlockStored) and event.session_id == session:
                    found.append(event)
    return found


def test_claude_code_session_is_a_program_and_labels_the_workers_kv_events(sim_fleet):
    gw, kv_endpoint, _ = sim_fleet
    worker = wait_for(lambda: gw.workers()["sim0"]["capacity_tokens"] and gw.workers()["sim0"],
                      what="capacity from the simworker's /metrics")
    # the pool less vLLM's null block: what the simworker's engine holds
    assert worker["capacity_tokens"] == (BLOCKS - 1) * BS and worker["capacity_source"] == "metrics"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(kv_endpoint)
    time.sleep(0.3)  # let the subscription reach the publisher
    try:
        body = {"model": "sluice-sim", "max_tokens": 8, "messages": [
            {"role": "system", "content": "You are a careful engineer. " * 20},
            {"role": "user", "content": "Fix the failing test."}]}
        r = gw.client.post("/v1/chat/completions", json=body,
                           headers={"x-claude-code-session-id": "s1"})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        events = _session_events(sub, "s1")
    finally:
        sub.close()
        ctx.term()
    program = gw.programs()["s1"]
    assert program["context_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert program["home_worker"] == "sim0"
    assert all(re.fullmatch(r"[0-9a-f]{32}", e.continuation_id or "") for e in events)


def test_stream_through_a_simworker_drops_only_the_usage_chunk(sim_fleet):
    gw, _, _ = sim_fleet
    body = {"model": "sluice-sim", "max_tokens": 12, "stream": True,
            "messages": [{"role": "user", "content": "Stream me something."}]}
    with gw.client.stream("POST", "/v1/chat/completions", json=body,
                          headers={"x-session-id": "sim-stream"}) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw())
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [msgspec.json.decode(e[len(b"data: "):]) for e in events[:-1]]
    assert all(chunk["choices"] for chunk in chunks)  # no usage-only chunk reached the client
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text
    program = gw.programs()["sim-stream"]
    assert program["in_flight"] == 0 and program["context_tokens"] > 12


def test_the_simworker_applies_the_retain_the_gateway_sends_for_a_placed_program(sim_fleet):
    gw, _, worker = sim_fleet
    body = {"model": "sluice-sim", "max_tokens": 4, "messages": [
        {"role": "system", "content": "Retained engineer. " * 20},
        {"role": "user", "content": "Keep my cache."}]}
    r = gw.client.post("/v1/chat/completions", json=body, headers={"x-session-id": "kept-1"})
    assert r.status_code == 200, r.text
    sink = gw.parts.admission.sink  # the gateway's side: a retain for the program was sent
    wait_for(lambda: sink.sent["retain"] >= 1, what="a kv.retain sent")
    # the engine's side: the session's cached blocks sit in the retained class (90), behind
    # every normally cached block (50) in eviction order
    pool = worker.engine.pool
    wait_for(lambda: pool._class_of("kept-1") == 90, what="the simworker applied the retain")
    kept = pool._session_blocks["kept-1"]
    assert kept and {pool._block_class[b] for b in kept} == {90}


def test_claude_codes_request_shapes_run_through_the_gateway_on_a_simworker(sim_fleet):
    """What Claude Code 2.1 sends to a model it does not know (so to every self-hosted one): a
    ``system`` message inside ``messages`` (beta mid-conversation-system), thinking and tool
    blocks carried back, ``cache_control`` markers, ``?beta=true``, and its session in the
    ``metadata.user_id`` JSON string. Both turns run, and the session is Claude Code's."""
    gw, _, _ = sim_fleet
    session = "9d2c0a3e-7f41-4c1a-9b55-claude-code"
    user_id = ('{"device_id":"' + "a" * 64 + '","account_uuid":"","session_id":"' + session + '"}')
    system = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    tools = [{"name": "Bash", "description": "Run a command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]
    # the fleet's model: Claude Code is pointed at it (ANTHROPIC_MODEL), as at any self-hosted one
    first = {"model": "sluice-sim", "max_tokens": 32000, "stream": True, "system": system,
             "tools": tools, "metadata": {"user_id": user_id},
             "messages": [{"role": "user", "content": [{"type": "text", "text": "fix the test"}]}]}
    headers = {"anthropic-beta": "mid-conversation-system-2026-04-07,interleaved-thinking-2025-05-14",
               "anthropic-version": "2023-06-01"}
    with gw.client.stream("POST", "/v1/messages?beta=true", json=first, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert b"message_stop" in r.read()
    second = {**first, "messages": [
        *first["messages"],
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look at the test", "signature": "c2ln"},
            {"type": "tool_use", "id": "toolu_01A", "name": "Bash", "input": {"command": "pytest -x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A",
                                      "content": "1 failed", "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "The user changed directory to /repo."},
        {"role": "user", "content": [{"type": "text", "text": "go on"}]}]}
    with gw.client.stream("POST", "/v1/messages?beta=true", json=second, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert b"message_stop" in r.read()
    program = gw.programs()[session]
    assert program["steps"] == 2
