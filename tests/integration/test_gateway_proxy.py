"""The gateway as a proxy: what reaches the worker, what reaches the client, and the error
answers. Real uvicorn servers on loopback (the gateway and fake vLLM workers), real httpx."""

from __future__ import annotations

import json

import pytest
from entry.ports import free_port
from tests.support.gateway_harness import ADMIN, chat, fakes, gateway, serve_config

from sim.traces import load_sluice


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("log") / "requests.jsonl"
    with fakes("w0", "w1") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 1_000_000} for f, s in started]
        # kv_cache_report_mode is allowed through so the forwarding test can see a client
        # vllm_xargs key survive next to the continuation id Sluice sets.
        config = serve_config(workers, max_body_bytes=4096, request_log=str(log_path),
                              upstream={"read_timeout_s": 0.5},
                              forward_client_keys=["vllm_xargs.kv_cache_report_mode"])
        with gateway(config) as gw:
            yield gw, {f.name: f for f, _ in started}, log_path


def _seen(fakes_by_name, session_id):
    for fake in fakes_by_name.values():
        for seen in fake.seen:
            if seen.body.get("session_id") == session_id:
                return fake, seen
    raise AssertionError(f"no worker saw {session_id}")


def _events(raw: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def test_forwarded_request_carries_session_header_continuation_and_only_named_client_headers(fleet):
    gw, workers, _ = fleet
    body = chat("fix the bug", vllm_xargs={"continuation_id": "forged", "kv_cache_report_mode": "full"},
                continuation_id="forged-too")
    r = gw.client.post("/v1/chat/completions", json=body, headers={
        "x-session-id": "fwd-1", "Authorization": "Bearer sk-user", "x-custom": "kept",
        "Connection": "keep-alive, x-drop-me", "x-drop-me": "1", "Proxy-Authorization": "secret",
        "TE": "trailers",
    })
    assert r.status_code == 200, r.text
    _, seen = _seen(workers, "fwd-1")
    assert seen.headers["x-session-id"] == "fwd-1"
    for kept_back in ("authorization", "x-custom"):  # forward_client_headers names neither
        assert kept_back not in seen.headers
    for hop in ("x-drop-me", "proxy-authorization", "te"):
        assert hop not in seen.headers
    xargs = seen.body["vllm_xargs"]
    assert xargs["kv_cache_report_mode"] == "full"
    assert xargs["continuation_id"] not in ("forged",) and len(xargs["continuation_id"]) == 32
    assert "continuation_id" not in seen.body
    assert seen.body["messages"] == body["messages"]
    # The worker's own answer reaches the client unchanged.
    assert r.json()["usage"]["prompt_tokens"] == 10
    assert r.headers["x-worker"] in workers


def test_stream_without_usage_request_is_byte_identical_minus_the_usage_chunk(fleet):
    gw, workers, _ = fleet
    with gw.client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=7),
                          headers={"x-session-id": "stream-1", "x-test-chunks": "20",
                                   "x-test-prompt-tokens": "321"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        got = b"".join(r.iter_raw())
    fake, seen = _seen(workers, "stream-1")
    assert seen.body["stream_options"] == {"include_usage": True}
    sent = fake.streams[r.headers["x-fake-request-id"]]
    usage_events = [e for e in _events(sent) if b'"choices":[]' in e]
    assert len(usage_events) == 1
    assert got == sent.replace(usage_events[0], b"")
    assert got.endswith(b"data: [DONE]\n\n")
    # The policy got the real usage off the dropped chunk.
    program = gw.programs()["stream-1"]
    assert program["context_tokens"] == 321 + 7
    assert program["in_flight"] == 0


def test_stream_with_client_usage_request_is_byte_identical(fleet):
    gw, workers, _ = fleet
    body = chat(stream=True, max_tokens=4, stream_options={"include_usage": True})
    with gw.client.stream("POST", "/v1/chat/completions", json=body,
                          headers={"x-session-id": "stream-2"}) as r:
        got = b"".join(r.iter_raw())
    fake, _ = _seen(workers, "stream-2")
    sent = fake.streams[r.headers["x-fake-request-id"]]
    assert got == sent
    assert b'"choices":[]' in got
    assert gw.programs()["stream-2"]["context_tokens"] == 10 + 4


@pytest.mark.parametrize("route,body", [
    ("/v1/messages", {"model": "fake-model", "max_tokens": 6, "system": "sys",
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "fake-model", "max_output_tokens": 6, "input": "hi"}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_and_responses_usage_reaches_the_policy(fleet, route, body, stream):
    gw, workers, _ = fleet
    session = f"usage-{route.rsplit('/', 1)[1]}-{stream}"
    body = {**body, "stream": stream, "max_tokens": 6}
    r = gw.client.post(route, json=body, headers={"x-session-id": session,
                                                   "x-test-prompt-tokens": "50",
                                                   "x-test-cached-tokens": "20"})
    assert r.status_code == 200, r.text
    if stream:
        fake, _ = _seen(workers, session)
        assert r.content == fake.streams[r.headers["x-fake-request-id"]]
    assert gw.programs()[session]["context_tokens"] == 50 + 6


def test_request_records_are_dynamo_request_end_lines_the_trace_loader_reads(fleet):
    gw, _, log_path = fleet
    for turn in range(2):
        r = gw.client.post("/v1/chat/completions", json=chat(f"turn {turn}", max_tokens=3),
                           headers={"x-session-id": "traced", "x-parent-session-id": "boss",
                                    "x-test-cached-tokens": "4"})
        assert r.status_code == 200
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    mine = [rec for rec in records if rec["agent_context"]["session_id"] == "traced"]
    assert len(mine) == 2
    rec = mine[-1]
    assert rec["schema"] == "dynamo.request.trace.v1"
    assert rec["event_type"] == "request_end"
    assert rec["event_source"] == "sluice"
    assert rec["agent_context"]["parent_session_id"] == "boss"
    req = rec["request"]
    assert (req["input_tokens"], req["output_tokens"], req["cached_tokens"]) == (10, 3, 4)
    assert req["model"] == "fake-model"
    assert req["queue_time_ms"] == 0
    assert req["total_time_ms"] > 0 and req["request_received_ms"] > 1.6e12
    assert req["ttft_ms"] is None  # not a stream
    programs, _ = load_sluice(log_path)
    traced = [p for p in programs if p.session_id == "traced"][0]
    assert [c.prompt_tokens for c in traced.calls] == [10, 10]
    assert traced.parent_session_id == "boss"


def test_every_call_leaves_a_record_with_its_status_and_refused_ones_no_program(fleet):
    gw, _, log_path = fleet
    calls = [  # (session, headers, body, expected status)
        ("rec-ok", {}, chat(max_tokens=2), 200),
        ("rec-4xx", {"x-test-status": "400"}, chat(), 400),
        ("rec-5xx", {"x-test-status": "500"}, chat(), 502),
        ("rec-slow", {"x-test-delay-s": "1.5"}, chat(), 504),
        ("rec-model", {}, chat(model="no-such-model"), 404),
        ("rec-bad", {}, {"model": "fake-model", "messages": "not a list"}, 400),
    ]
    for session, headers, body, status in calls:
        r = gw.client.post("/v1/chat/completions", json=body,
                           headers={"x-session-id": session, **headers})
        assert r.status_code == status, (session, r.text)
    records = {rec["agent_context"]["session_id"]: rec
               for rec in map(json.loads, log_path.read_text().splitlines())}
    for session, _, _, status in calls:
        if session == "rec-bad":
            continue  # refused before its identity was read: no session to file it under
        rec = records[session]
        assert rec["sluice"]["status"] == status, session
        assert ("error" in rec["sluice"]) == (status != 200), session
    bad = [rec for rec in map(json.loads, log_path.read_text().splitlines())
           if rec["sluice"]["status"] == 400 and rec["agent_context"]["session_id"] is None]
    assert bad and "body.messages" in bad[-1]["sluice"]["error"]
    assert "worker w" in records["rec-4xx"]["sluice"]["error"]
    # nothing of the refused or failed ones is left in the policy, and a replay skips them
    programs = gw.programs()
    assert "rec-ok" in programs and not {"rec-4xx", "rec-5xx", "rec-slow", "rec-model"} & set(programs)
    replayed = {p.session_id for p in load_sluice(log_path)[0]}
    assert "rec-ok" in replayed and not {"rec-4xx", "rec-5xx", "rec-slow"} & replayed


def test_upstream_5xx_becomes_502_with_the_workers_status_and_body(fleet):
    gw, _, _ = fleet
    for stream in (False, True):
        r = gw.client.post("/v1/chat/completions", json=chat(stream=stream),
                           headers={"x-session-id": f"fail-{stream}", "x-test-status": "500"})
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["type"] == "upstream_error" and error["code"] == 502
        assert "answered 500" in error["message"] and "failed on purpose" in error["message"]
        # The call ended in the policy, and its program, which never ran, with it.
        assert f"fail-{stream}" not in gw.programs()


def test_upstream_4xx_is_passed_through_unchanged(fleet):
    gw, _, _ = fleet
    r = gw.client.post("/v1/chat/completions", json=chat(),
                       headers={"x-session-id": "bad-req", "x-test-status": "400"})
    assert r.status_code == 400
    assert "failed on purpose" in r.json()["error"]["message"]
    assert "bad-req" not in gw.programs()  # refused: no program left behind


def test_upstream_timeout_becomes_504(fleet):
    gw, _, _ = fleet
    r = gw.client.post("/v1/chat/completions", json=chat(),
                       headers={"x-session-id": "slow", "x-test-delay-s": "1.5"})
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "upstream_timeout"


def test_connection_refused_becomes_502_json():
    config = serve_config([{"name": "dead", "url": f"http://127.0.0.1:{free_port()}",
                            "capacity_tokens": 100_000}])
    with gateway(config) as gw:
        r = gw.client.post("/v1/chat/completions", json=chat(), headers={"x-session-id": "x"})
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["type"] == "upstream_error" and "cannot reach worker dead" in error["message"]
        assert "x" not in gw.programs()


def test_malformed_json_is_400(fleet):
    gw, _, _ = fleet
    for content in (b"{not json", b"[1, 2]", b""):
        r = gw.client.post("/v1/chat/completions", content=content,
                           headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_body_over_the_limit_is_413(fleet):
    gw, _, _ = fleet
    big = chat("x" * 10_000)
    r = gw.client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    r = gw.client.post("/v1/chat/completions", content=chunks())
    assert r.status_code == 413


def test_unknown_route_and_wrong_method_are_json(fleet):
    gw, _, _ = fleet
    r = gw.client.get("/v1/nothing-here")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"
    r = gw.client.get("/v1/chat/completions")
    assert r.status_code == 405
    assert "error" in r.json()


@pytest.mark.parametrize("headers,body_extra,param", [
    ({"x-session-id": "s" * 300}, {}, "x-session-id"),
    ({"x-claude-code-session-id": ""}, {}, "x-claude-code-session-id"),
    ({}, {"session_id": 123}, "body.session_id"),
    ({}, {"program_id": "bad\u00e9id"}, "body.program_id"),
    ({"x-session-id": "ok", "x-dynamo-parent-session-id": "p" * 257}, {}, "x-dynamo-parent-session-id"),
])
def test_invalid_ids_are_400_naming_the_header_or_field(fleet, headers, body_extra, param):
    gw, _, _ = fleet
    r = gw.client.post("/v1/chat/completions", json=chat(**body_extra), headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert param in error["message"]


def test_models_are_merged_from_the_workers_or_taken_from_config(fleet):
    gw, _, _ = fleet
    r = gw.client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["fake-model"]
    config = serve_config([{"name": "w", "url": "http://127.0.0.1:9", "capacity_tokens": 10}],
                          models=["a", "b"])
    with gateway(config) as other:
        assert [m["id"] for m in other.client.get("/v1/models").json()["data"]] == ["a", "b"]


def test_health_and_metrics(fleet):
    gw, _, _ = fleet
    r = gw.client.get("/health")
    assert r.status_code == 200 and r.json()["workers_healthy"] == 2
    gw.client.post("/v1/chat/completions", json=chat(), headers={"x-session-id": "metered"})
    text = gw.client.get("/metrics").text
    for name in ("sluice_programs{lifecycle=\"active\",phase=\"acting\"}", "sluice_pauses_total",
                 "sluice_resumes_total", "sluice_marks_total", "sluice_forced_resumes_total",
                 "sluice_holds_total", "sluice_wait_limit_resumes_total", "sluice_dormant_total",
                 "sluice_policy_adaptive", "sluice_worker_utilization{worker=\"w0\"}",
                 "sluice_hold_seconds_bucket", "sluice_upstream_latency_seconds_bucket",
                 'sluice_requests_total{route="/v1/chat/completions",status="200"}'):
        assert name in text, name


def test_metrics_registry_is_per_app(fleet):
    gw, _, _ = fleet
    config = serve_config([{"name": "w", "url": "http://127.0.0.1:9", "capacity_tokens": 10}])
    with gateway(config) as other:
        text = other.client.get("/metrics").text
        assert 'sluice_requests_total{route="/v1/chat/completions",status="200"}' not in text
    assert gw.client.get("/metrics").status_code == 200


def test_admin_endpoints_need_the_bearer_token(fleet):
    gw, _, _ = fleet
    for method, path in (("GET", "/sluice/programs"), ("GET", "/sluice/workers"),
                         ("GET", "/sluice/config"), ("POST", "/sluice/programs/x/release")):
        assert gw.client.request(method, path).status_code == 401
        wrong = gw.client.request(method, path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["type"] == "authentication_error"
    assert gw.client.get("/sluice/programs", headers=ADMIN).status_code == 200


def test_admin_api_is_off_without_a_token():
    config = serve_config([{"name": "w", "url": "http://127.0.0.1:9", "capacity_tokens": 10}],
                          admin_token=None)
    with gateway(config) as gw:
        r = gw.client.get("/sluice/programs", headers=ADMIN)
        assert r.status_code == 403


def test_operator_release(fleet):
    gw, _, _ = fleet
    gw.client.post("/v1/chat/completions", json=chat(), headers={"x-session-id": "a/b c"})
    assert "a/b c" in gw.programs()
    r = gw.client.post("/sluice/programs/a%2Fb%20c/release", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"released": "a/b c"}
    assert "a/b c" not in gw.programs()
    assert gw.client.post("/sluice/programs/nobody/release", headers=ADMIN).status_code == 404
    # a percent sign in the id is decoded once, not twice (the fuzz tier's TestClient decodes
    # twice: tests/fuzz/gateway_fixture.py path_segment)
    gw.client.post("/v1/chat/completions", json=chat(), headers={"x-session-id": "2,%bd"})
    r = gw.client.post("/sluice/programs/2%2C%25bd/release", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"released": "2,%bd"}, r.text
    # a program named "." is released as %2E: a literal dot segment never reaches the route
    gw.client.post("/v1/chat/completions", json=chat(), headers={"x-session-id": "."})
    r = gw.client.post("/sluice/programs/%2E/release", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"released": "."}, r.text


def test_stream_broken_by_the_worker_ends_with_an_error_event(fleet):
    gw, _, _ = fleet
    with gw.client.stream("POST", "/v1/chat/completions", json=chat(stream=True),
                          headers={"x-session-id": "cut", "x-test-chunks": "10",
                                   "x-test-break-after": "3"}) as r:
        assert r.status_code == 200
        got = b"".join(r.iter_raw())
    assert got.count(b"data: ") == 4 and b"[DONE]" not in got
    last = json.loads(_events(got)[-1][len(b"data: "):])
    assert last["error"]["code"] == 502 and "broke off the response" in last["error"]["message"]
    assert "cut" not in gw.programs()
