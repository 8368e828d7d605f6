"""Faults a client can provoke, answered as the API it speaks would answer them:
a body nested too deeply to parse, errors on Anthropic routes in Anthropic's own shape, and
engine-level keys (``priority``, ``vllm_xargs``) a client must not set unless the config says
so. Real uvicorn servers on loopback (the gateway and fake vLLM workers), real httpx."""

from __future__ import annotations

import json

import pytest
from entry.ports import free_port
from tests.support.gateway_harness import chat, fakes, gateway, serve_config

MESSAGES_BODY = {"model": "fake-model", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def fleet():
    with fakes("w0") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 1_000_000} for f, s in started]
        config = serve_config(workers, max_body_bytes=64 * 1024, upstream={"read_timeout_s": 0.5})
        with gateway(config) as gw:
            yield gw, started[0][0]


def _seen_by(fake, session_id):
    matches = [seen for seen in fake.seen if seen.body.get("session_id") == session_id]
    assert matches, f"the worker never saw {session_id}"
    return matches[-1]


def _assert_anthropic_error(response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == error_type
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert set(body) == {"type", "error"}
    return body["error"]


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _deep_bodies(depth: int) -> list[bytes]:
    """A deep value in a field nobody reads, and one inside the prompt that identity walks."""
    beside_prompt = b'{"model":"fake-model","max_tokens":6,"messages":[{"role":"user","content":"hi"}],"x":'
    inside_prompt = b'{"model":"fake-model","max_tokens":6,"messages":[{"role":"user","content":'
    return [beside_prompt + _nested(depth) + b"}", inside_prompt + _nested(depth) + b"}]}"]


# -- deep JSON ----------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1_000, 20_000])
def test_deeply_nested_json_is_400_in_the_openai_shape_without_a_traceback(fleet, depth):
    gw, _ = fleet
    for content in _deep_bodies(depth):
        r = gw.client.post("/v1/chat/completions", content=content,
                           headers={"content-type": "application/json", "x-session-id": "deep"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == 400
        assert "nested" in error["message"]
    assert "Traceback" not in gw.log.getvalue()
    assert "unhandled error" not in gw.log.getvalue()


def test_deeply_nested_json_on_messages_is_400_in_the_anthropic_shape(fleet):
    gw, _ = fleet
    for content in _deep_bodies(1_000):
        r = gw.client.post("/v1/messages", content=content,
                           headers={"content-type": "application/json", "x-session-id": "deep-a"})
        _assert_anthropic_error(r, 400, "invalid_request_error")
    assert "Traceback" not in gw.log.getvalue()


def test_moderately_nested_json_is_still_forwarded(fleet):
    gw, fake = fleet
    body = chat("hi", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    value: object = "leaf"
    for _ in range(100):
        value = {"v": [value]}
    body["tools"][0]["function"]["parameters"] = value
    r = gw.client.post("/v1/chat/completions", json=body, headers={"x-session-id": "nested-100"})
    assert r.status_code == 200, r.text
    assert _seen_by(fake, "nested-100").body["tools"] == body["tools"]


# -- Anthropic-shaped errors on Anthropic routes -------------------------------------------------


def test_malformed_body_on_messages_is_an_anthropic_invalid_request_error(fleet):
    gw, _ = fleet
    for content in (b"{not json", b"[1, 2]", b""):
        r = gw.client.post("/v1/messages", content=content,
                           headers={"content-type": "application/json"})
        _assert_anthropic_error(r, 400, "invalid_request_error")


def test_invalid_session_id_on_messages_is_an_anthropic_invalid_request_error(fleet):
    gw, _ = fleet
    r = gw.client.post("/v1/messages", json=MESSAGES_BODY, headers={"x-session-id": "s" * 300})
    error = _assert_anthropic_error(r, 400, "invalid_request_error")
    assert "x-session-id" in error["message"]


def test_body_over_the_limit_on_messages_is_an_anthropic_request_too_large(fleet):
    gw, _ = fleet
    big = {**MESSAGES_BODY, "messages": [{"role": "user", "content": "x" * 100_000}]}
    _assert_anthropic_error(gw.client.post("/v1/messages", json=big), 413, "request_too_large")


def test_wrong_method_on_messages_is_an_anthropic_error(fleet):
    gw, _ = fleet
    _assert_anthropic_error(gw.client.get("/v1/messages"), 405, "invalid_request_error")


def test_unrouted_path_under_messages_is_an_anthropic_not_found_error(fleet):
    gw, _ = fleet
    r = gw.client.post("/v1/messages/no-such-endpoint", json=MESSAGES_BODY)
    _assert_anthropic_error(r, 404, "not_found_error")


@pytest.mark.parametrize("stream", [False, True])
def test_worker_failure_on_messages_is_an_anthropic_api_error(fleet, stream):
    gw, _ = fleet
    r = gw.client.post("/v1/messages", json={**MESSAGES_BODY, "stream": stream},
                       headers={"x-session-id": f"fail-a-{stream}", "x-test-status": "500"})
    error = _assert_anthropic_error(r, 502, "api_error")
    assert "answered 500" in error["message"]


def test_worker_timeout_on_messages_is_an_anthropic_timeout_error(fleet):
    gw, _ = fleet
    r = gw.client.post("/v1/messages", json=MESSAGES_BODY,
                       headers={"x-session-id": "slow-a", "x-test-delay-s": "1.5"})
    _assert_anthropic_error(r, 504, "timeout_error")


def test_stream_broken_on_messages_ends_with_an_anthropic_error_event(fleet):
    gw, _ = fleet
    with gw.client.stream("POST", "/v1/messages", json={**MESSAGES_BODY, "stream": True},
                          headers={"x-session-id": "cut-a", "x-test-chunks": "10",
                                   "x-test-break-after": "3"}) as r:
        assert r.status_code == 200
        got = b"".join(r.iter_raw())
    last = got.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    event_line, data_line = last.split(b"\n")
    assert event_line == b"event: error"
    payload = json.loads(data_line[len(b"data: "):])
    assert payload["type"] == "error" and payload["error"]["type"] == "api_error"
    assert "broke off the response" in payload["error"]["message"]


def test_no_healthy_worker_on_messages_is_an_anthropic_overloaded_error():
    config = serve_config([{"name": "dead", "url": f"http://127.0.0.1:{free_port()}",
                            "capacity_tokens": 100_000}], unhealthy_after=1, health_interval_s=0.05)
    with gateway(config) as gw:
        wait_until_down = 100
        for _ in range(wait_until_down):
            if not gw.parts.workers.healthy_names():
                break
            gw.client.get("/health")
        r = gw.client.post("/v1/messages", json=MESSAGES_BODY, headers={"x-session-id": "x"})
        _assert_anthropic_error(r, 503, "overloaded_error")


def test_openai_routes_keep_the_openai_error_shape(fleet):
    gw, _ = fleet
    r = gw.client.post("/v1/chat/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == 400
    assert "type" not in r.json()


# -- client keys that reach the engine -----------------------------------------------------------


def test_client_priority_and_vllm_xargs_are_stripped_by_default(fleet):
    gw, fake = fleet
    body = chat("hi", priority=-1000, vllm_xargs={"kv_cache_report_mode": "full", "anything": 1})
    r = gw.client.post("/v1/chat/completions", json=body, headers={"x-session-id": "strip-1"})
    assert r.status_code == 200, r.text
    seen = _seen_by(fake, "strip-1").body
    assert "priority" not in seen
    # Only what Sluice sets itself is left: the continuation id it minted.
    assert set(seen["vllm_xargs"]) == {"continuation_id"}
    assert len(seen["vllm_xargs"]["continuation_id"]) == 32


def test_client_engine_keys_named_in_forward_client_keys_are_forwarded():
    with fakes("w0") as started:
        fake, server = started[0]
        config = serve_config(
            [{"name": "w0", "url": server.url, "capacity_tokens": 1_000_000}],
            forward_client_keys=["priority", "vllm_xargs.kv_cache_report_mode"])
        with gateway(config) as gw:
            body = chat("hi", priority=5, vllm_xargs={"kv_cache_report_mode": "full", "other": 1})
            r = gw.client.post("/v1/chat/completions", json=body, headers={"x-session-id": "allow-1"})
            assert r.status_code == 200, r.text
            seen = _seen_by(fake, "allow-1").body
            assert seen["priority"] == 5
            assert seen["vllm_xargs"]["kv_cache_report_mode"] == "full"
            assert "other" not in seen["vllm_xargs"]
            assert "continuation_id" in seen["vllm_xargs"]


def test_naming_vllm_xargs_forwards_all_its_keys_but_not_a_forged_continuation_id():
    with fakes("w0") as started:
        fake, server = started[0]
        config = serve_config(
            [{"name": "w0", "url": server.url, "capacity_tokens": 1_000_000}],
            forward_client_keys=["vllm_xargs"])
        with gateway(config) as gw:
            body = chat("hi", priority=5,
                        vllm_xargs={"a": 1, "b": "two", "continuation_id": "forged"})
            r = gw.client.post("/v1/chat/completions", json=body, headers={"x-session-id": "allow-2"})
            assert r.status_code == 200, r.text
            seen = _seen_by(fake, "allow-2").body
            assert "priority" not in seen
            assert seen["vllm_xargs"]["a"] == 1 and seen["vllm_xargs"]["b"] == "two"
            assert seen["vllm_xargs"]["continuation_id"] != "forged"
