"""The simworker (simworker/worker.py) as a client sees it: a real uvicorn server on loopback,
real HTTP, a real ZMQ SUB socket on its KV events and a real DEALER on its replay socket."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest
import uvicorn
import zmq

from entry.ports import free_port
from scheduler.kv_events import BlockStored, EventBatchDecoder
from simworker.worker import DEFAULT_MAX_MODEL_LEN, SimWorker, SimWorkerConfig, create_app
from sim.step_time import preset

BLOCKS = 400
BS = 16
TOPIC = b"kv@t0"
SYSTEM = ("You are a careful software engineer. You read the repository, run the tests, and fix "
          "the bug with the smallest change that makes the failing test pass. ") * 6


@dataclass
class Worker:
    url: str
    worker: SimWorker
    kv: str
    replay: str


@contextlib.contextmanager
def serve(**overrides) -> Iterator[Worker]:
    settings = dict(name="t0", num_blocks=BLOCKS, block_size=BS, kv_events="tcp://127.0.0.1:*",
                    replay="tcp://127.0.0.1:*", time_scale=0.05)
    settings.update(overrides)
    app = create_app(SimWorkerConfig(**settings))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False,
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive(), "the simworker failed to start"
        assert time.monotonic() < deadline, "the simworker did not start in 10 s"
        time.sleep(0.01)
    worker = app.state.worker
    try:
        yield Worker(f"http://127.0.0.1:{sock.getsockname()[1]}", worker, worker.kv_endpoint,
                     worker.replay_endpoint)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def fast() -> Iterator[Worker]:
    with serve() as worker:
        yield worker


@pytest.fixture(scope="module")
def slow() -> Iterator[Worker]:
    with serve(name="slow", time_scale=0.5) as worker:
        yield worker


@pytest.fixture(scope="module")
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def chat(url: str, messages: list[dict], headers: dict | None = None, **body) -> dict:
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": "sluice-sim", "messages": messages, **body},
                          headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def sse(url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def user(text: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


# -- the OpenAI API ---------------------------------------------------------------------


def test_chat_completion_returns_an_openai_shaped_body_with_usage(fast):
    body = chat(fast.url, user("What does the failing test check?"), max_tokens=24)
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "sluice-sim" and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 24
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24
    assert usage["prompt_tokens"] > len(SYSTEM) // 5
    # The same prompt again reads every full block of it from the prefix cache.
    again = chat(fast.url, user("What does the failing test check?"), max_tokens=24)["usage"]
    assert again["prompt_tokens"] == usage["prompt_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] // BS * BS


def test_without_max_tokens_the_default_length_ends_with_stop(fast):
    body = chat(fast.url, [{"role": "user", "content": "hi"}])
    assert body["usage"]["completion_tokens"] == 256 and body["choices"][0]["finish_reason"] == "stop"


def test_chat_stream_sends_role_then_content_chunks_a_usage_chunk_and_done(fast):
    messages = user("Stream me a plan.")
    lines = sse(fast.url, "/v1/chat/completions",
                {"messages": messages, "max_tokens": 60, "stream": True, "seed": 11,
                 "stream_options": {"include_usage": True}})
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    *content, usage_chunk = chunks
    assert len(content) >= 3  # decode runs are capped, so the text arrives in pieces
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    # vLLM opens the stream with the role alone, before the first token
    assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["length"]
    assert all("usage" not in c for c in content)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 60
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    # seeded, the output is reproducible: the same prompt without streaming gives the same text
    assert text == chat(fast.url, messages, max_tokens=60, seed=11)["choices"][0]["message"]["content"]


def test_stream_without_include_usage_has_no_usage_chunk(fast):
    lines = sse(fast.url, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True})
    chunks = [json.loads(line) for line in lines[:-1]]
    assert lines[-1] == "[DONE]" and all(c["choices"] and "usage" not in c for c in chunks)


def test_completions_stream_and_not(fast):
    response = httpx.post(f"{fast.url}/v1/completions",
                          json={"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}, timeout=30)
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["text"].startswith(" ")
    lines = sse(fast.url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "stream": True,
                                              "temperature": 0,
                                              "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True}})
    chunks = [json.loads(line) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" and "usage" in c for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks][-2:] == [12, 12]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == body["choices"][0]["text"]
    assert chunks[-1]["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]


def test_models_health_and_unknown_routes(fast):
    assert httpx.get(f"{fast.url}/health").status_code == 200
    missing = httpx.post(f"{fast.url}/v1/embeddings", json={})
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}  # vLLM's (Starlette's) body
    [model] = httpx.get(f"{fast.url}/v1/models").json()["data"]
    assert model["id"] == "sluice-sim" and model["max_model_len"] == DEFAULT_MAX_MODEL_LEN


def test_requests_that_cannot_be_served_get_400_with_a_json_error(fast):
    too_long = httpx.post(f"{fast.url}/v1/completions", json={"prompt": "lorem ipsum " * 5000}, timeout=30)
    assert too_long.status_code == 400
    assert "maximum context length" in too_long.json()["error"]["message"]
    too_many = httpx.post(f"{fast.url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": DEFAULT_MAX_MODEL_LEN + 1},
                          timeout=30)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    for payload in (b"{not json", b"[1, 2]", json.dumps({"messages": []}).encode(),
                    json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode()):
        response = httpx.post(f"{fast.url}/v1/chat/completions", content=payload,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["message"]
    assert httpx.get(f"{fast.url}/health").status_code == 200


# -- prefix cache and KV events ----------------------------------------------------------


def recv_frames(sub: zmq.Socket, until: Callable[[list[list[bytes]]], bool], timeout: float = 5.0
                ) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while not until(got):
        left = deadline - time.monotonic()
        assert left > 0, f"expected events did not arrive ({len(got)} batches seen)"
        if sub.poll(int(left * 1000)):
            got.append(sub.recv_multipart())
    return got


def stored_events(frames: list[list[bytes]]) -> list[BlockStored]:
    decoder = EventBatchDecoder()
    return [event for frame in frames for event in decoder.decode(frame[2]).events
            if isinstance(event, BlockStored)]


def test_shared_prefix_is_cached_and_block_stored_events_carry_the_session(fast, zctx):
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(fast.kv)
    time.sleep(0.3)  # let the subscription reach the publisher
    try:
        system = "Events test. " + SYSTEM  # a prefix no other test has cached
        first = chat(fast.url, user("Explain the stack trace.", system), headers={"X-Session-ID": "sess-a"},
                     max_tokens=8)
        second = chat(fast.url, user("Now write the fix.", system), headers={"X-Session-ID": "ignored"},
                      session_id="sess-b", max_tokens=8,
                      vllm_xargs={"continuation_id": "cont-b", "kv_cache_report_mode": "full"})
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(SYSTEM) // 5 and cached % BS == 0

        frames = recv_frames(sub, lambda got: any(e.session_id == "sess-b" and e.parent_block_hash is not None
                                                  for e in stored_events(got)))
    finally:
        sub.close()
    for frame in frames:
        # vLLM's three frames, and the plugin's per-start epoch as a fourth, the same every time
        assert len(frame) == 4 and frame[0] == TOPIC and len(frame[1]) == 8
        assert frame[3] == fast.worker.publisher.epoch and len(frame[3]) == 16
        raw = msgspec.msgpack.decode(frame[2])  # vLLM's layout: [ts, [events...], rank]
        assert isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], float) and raw[2] == 0
        assert all(next(iter(event)) == "type" for event in raw[1])
    seqs = [int.from_bytes(frame[1], "big") for frame in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

    stored = stored_events(frames)
    by_a = [e for e in stored if e.session_id == "sess-a"]
    by_b = [e for e in stored if e.session_id == "sess-b"]
    assert by_a and by_b and all(e.continuation_id is None for e in by_a)
    assert all(e.continuation_id == "cont-b" and e.block_size == BS for e in by_b)
    # "full" report mode: the hit comes first, as a store of the whole prefix from block 0
    report, *fresh = by_b
    assert report.parent_block_hash is None and len(report.block_hashes) * BS == cached
    assert report.block_hashes == by_a[0].block_hashes[:len(report.block_hashes)]
    assert report.token_ids == by_a[0].token_ids[:cached]
    assert fresh[0].parent_block_hash == report.block_hashes[-1]
    for event in stored:
        assert len(event.token_ids) == BS * len(event.block_hashes)
        assert (event.medium, event.group_idx, event.kv_cache_spec_kind) == ("GPU", 0, "full_attention")
        assert event.extra_keys == [None] * len(event.block_hashes)


def _push(zctx: zmq.Context, endpoint: str, message: bytes) -> None:
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(endpoint)
    push.send(message)
    push.close()


def _envelope(kind: str, session: str, **payload) -> bytes:
    return json.dumps({"protocol_version": 1, "message_id": f"m-{kind}-{session}",
                       "actions": [{"action_id": "a0", "action_type": kind, "action_version": 1,
                                    "payload": {"session_id": session, **payload}}]}).encode()


def test_retention_directives_reorder_which_cached_blocks_the_engine_evicts_first():
    with serve(directives="tcp://127.0.0.1:*") as w, zmq.Context() as zctx:
        directives = w.worker.directives
        chat(w.url, user("Keep me.", "Keeper. " + SYSTEM), headers={"X-Session-ID": "keeper"}, max_tokens=4)
        chat(w.url, user("Drop me.", "Other. " + SYSTEM), headers={"X-Session-ID": "other"}, max_tokens=4)
        pool = w.worker.engine.pool
        keeper = set(pool._session_blocks["keeper"])
        other = set(pool._session_blocks["other"])
        order = pool.free_queue_order()
        # plain LRU: the keeper's blocks, freed first, would be evicted before the other's
        assert max(order.index(b) for b in keeper) < min(order.index(b) for b in other)

        _push(zctx, directives.bound_endpoint, _envelope("kv.retain", "keeper", priority=90, ttl_s=60))
        wait_for(lambda: directives.applied == 1)
        order = pool.free_queue_order()
        assert min(order.index(b) for b in keeper) > max(order.index(b) for b in other)

        _push(zctx, directives.bound_endpoint, b"{not json")
        _push(zctx, directives.bound_endpoint, _envelope("kv.demote", "keeper"))
        wait_for(lambda: directives.applied == 2)
        assert directives.dropped == 1 and directives.received == 3
        order = pool.free_queue_order()
        assert max(order.index(b) for b in keeper) < min(order.index(b) for b in other)
        text = metrics(w.url)
        assert metric(text, "sluice_simworker:directives_applied_total") == 2
        assert metric(text, "sluice_simworker:directives_dropped_total") == 1


def test_offload_and_prefetch_directives_reach_the_engine_not_only_the_counter():
    """Without a host tier an offload is a demotion and a prefetch undoes it, as the plugin
    does on vLLM (before, both were counted as applied and ignored)."""
    with serve(directives="tcp://127.0.0.1:*") as w, zmq.Context() as zctx:
        directives = w.worker.directives
        chat(w.url, user("Park me.", "Parked. " + SYSTEM), headers={"X-Session-ID": "parked"}, max_tokens=4)
        chat(w.url, user("Stay.", "Staying. " + SYSTEM), headers={"X-Session-ID": "other"}, max_tokens=4)
        pool = w.worker.engine.pool
        parked = set(pool._session_blocks["parked"])
        other = set(pool._session_blocks["other"])
        _push(zctx, directives.bound_endpoint, _envelope("kv.retain", "parked", priority=90, ttl_s=60))
        wait_for(lambda: directives.applied == 1)
        _push(zctx, directives.bound_endpoint, _envelope("kv.offload", "parked"))
        wait_for(lambda: directives.applied == 2)
        order = pool.free_queue_order()
        assert max(order.index(b) for b in parked) < min(order.index(b) for b in other)
        _push(zctx, directives.bound_endpoint, _envelope("kv.prefetch", "parked", priority=70))
        wait_for(lambda: directives.applied == 3)
        assert pool._session_class.get("parked") is None  # the demotion is undone


def test_an_assistant_reply_sent_back_verbatim_hits_through_the_reply(fast):
    turn1 = user("Find the bug in utils.py (verbatim test).")
    first = chat(fast.url, turn1, max_tokens=70)
    reply = first["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Run the tests."}]
    second = chat(fast.url, turn2, max_tokens=4)
    computed = first["usage"]["prompt_tokens"] + 70 - 1  # the last sampled token is never computed
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == computed // BS * BS


def test_replay_returns_buffered_batches_then_the_end_marker(fast, zctx):
    chat(fast.url, user("Something to publish."), max_tokens=4)
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(fast.replay)

    def replay(start: int) -> list[list[bytes]]:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[2] == b"\xff" * 8:
                return replies

    try:
        everything = replay(0)
        *batches, end = everything
        assert end == [b"", b"", b"\xff" * 8, b""]
        assert len(batches) >= 2
        seqs = [int.from_bytes(frames[2], "big") for frames in batches]
        assert seqs == list(range(len(batches)))
        decoder = EventBatchDecoder()
        for frames in batches:
            assert len(frames) == 4 and frames[0] == b"" and frames[1] == TOPIC
            assert decoder.decode(frames[3]).events
        later = replay(len(batches) - 1)
        assert later[0] == batches[-1] and later[1] == end
        assert replay(10**9) == [end]
    finally:
        dealer.close()


def test_metrics_expose_cache_config_and_token_counters(fast):
    # twice, long enough to fill whole blocks: the second call is a prefix hit of its own,
    # whatever other tests left in the cache
    for _ in range(2):
        chat(fast.url, user("Count me and my cached prefix. " * 12), max_tokens=5)
    text = metrics(fast.url)
    [info] = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    assert int(labels["num_gpu_blocks"]) * int(labels["block_size"]) == BLOCKS * BS
    assert labels["enable_prefix_caching"] == "True" and "engine" in labels
    assert info.endswith(" 1.0")
    assert 0.0 <= metric(text, "vllm:kv_cache_usage_perc") <= 1.0
    assert metric(text, "vllm:prompt_tokens_total") >= metric(text, "vllm:prefix_cache_hits_total") > 0
    assert metric(text, "vllm:generation_tokens_total") >= 5
    assert metric(text, "vllm:prefix_cache_queries_total") == metric(text, "vllm:prompt_tokens_total")


# -- time and disconnects ---------------------------------------------------------------


@pytest.mark.parametrize("which", ["fast", "slow"])
def test_wall_latency_is_model_latency_times_the_time_scale(which, request):
    worker: Worker = request.getfixturevalue(which)
    model = preset(worker.worker.config.preset)
    n = 200 if which == "fast" else 60
    started = time.monotonic()
    body = chat(worker.url, [{"role": "user", "content": f"latency probe {which}"}], max_tokens=n)
    wall = time.monotonic() - started
    p = body["usage"]["prompt_tokens"]
    # alone on the engine: one prefill iteration, then n - 1 decode steps
    modelled = model.step_s(p, 1, p) + model.decode_run_s(1, p + 1, n - 1)
    expected = modelled * worker.worker.config.time_scale
    # Never faster than the model; slower only by what a loaded machine adds (an ignored
    # time scale would be 20x or 2x off, far outside this band).
    assert 0.9 * expected <= wall <= 1.6 * expected + 0.3, (wall, expected)


def test_a_stream_whose_client_disconnects_is_aborted_and_its_blocks_freed(slow):
    before = metric(metrics(slow.url), "sluice_simworker:aborted_requests_total")
    body = {"messages": user("A very long answer please."), "max_tokens": 3000, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{slow.url}/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()  # kept open: closing it would close the connection
            for line in lines:
                if line.startswith("data: "):
                    break
            text = metrics(slow.url)
            assert metric(text, "vllm:num_requests_running") == 1
            assert metric(text, "vllm:kv_cache_usage_perc") > 0
    wait_for(lambda: metric(metrics(slow.url), "vllm:num_requests_running") == 0)
    text = metrics(slow.url)
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(text, "sluice_simworker:aborted_requests_total") == before + 1


def test_a_non_streaming_call_whose_client_disconnects_is_aborted(slow):
    before = metric(metrics(slow.url), "sluice_simworker:aborted_requests_total")
    payload = json.dumps({"messages": user("Another long answer."), "max_tokens": 3000}).encode()
    host, port = slow.url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    wait_for(lambda: metric(metrics(slow.url), "vllm:num_requests_running") == 1)
    assert metric(metrics(slow.url), "vllm:kv_cache_usage_perc") > 0
    conn.close()
    wait_for(lambda: metric(metrics(slow.url), "vllm:num_requests_running") == 0)
    text = metrics(slow.url)
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(text, "sluice_simworker:aborted_requests_total") == before + 1


# -- the command line ---------------------------------------------------------------------


def test_sluice_simworker_command_serves_the_api_metrics_and_kv_events(zctx):
    port, kv = free_port(), free_port()
    sluice = Path(sys.executable).with_name("sluice")
    command = [str(sluice)] if sluice.exists() else [sys.executable, "-m", "entry.cli"]
    process = subprocess.Popen(
        command + ["simworker", "--port", str(port), "--blocks", "128", "--block-size", "32",
                   "--kv-events", f"tcp://*:{kv}", "--allow-insecure-bind",
                   "--time-scale", "0.05", "--name", "cli"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        def up() -> bool:
            assert process.poll() is None, process.stderr.read().decode()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=20)
        text = metrics(f"http://127.0.0.1:{port}")
        assert 'num_gpu_blocks="128"' in text and 'block_size="32"' in text
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{kv}")
        time.sleep(0.3)
        try:
            body = chat(f"http://127.0.0.1:{port}", user("hi from the command line"), max_tokens=3)
            assert body["usage"]["completion_tokens"] == 3
            [frame, *_] = recv_frames(sub, lambda got: len(got) > 0)
        finally:
            sub.close()
        assert frame[0] == b"kv@cli" and int.from_bytes(frame[1], "big") == 0
        assert stored_events([frame])[0].block_size == 32
    finally:
        process.terminate()
        _, err = process.communicate(timeout=10)
    assert b"simworker ready" in err


def test_sluice_simworker_refuses_an_unknown_scheduling_policy():
    sluice = Path(sys.executable).with_name("sluice")
    command = [str(sluice)] if sluice.exists() else [sys.executable, "-m", "entry.cli"]
    done = subprocess.run(command + ["simworker", "--scheduling-policy", "lottery"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "error: --scheduling-policy must be fcfs or priority" in done.stderr
