"""Two gaps a real client hits: ``POST /v1/messages/count_tokens`` (Claude Code
calls it before its calls) is relayed to a worker without being admitted as a call, and a
model no worker serves is a 404 in the API's own error shape instead of being forwarded.
Real uvicorn servers on loopback (the gateway and fake vLLM workers), real httpx."""

from __future__ import annotations

import pytest
from entry.ports import free_port
from tests.support.gateway_harness import chat, fakes, gateway, serve_config, wait_for

MESSAGES_BODY = {"model": "fake-model", "max_tokens": 6,
                 "messages": [{"role": "user", "content": "hi"}]}
COUNT_BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "ok"},
                                                  {"role": "user", "content": "and?"}]}


@pytest.fixture(scope="module")
def fleet():
    with fakes("w0", "w1") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 1_000_000} for f, s in started]
        with gateway(serve_config(workers)) as gw:
            yield gw, {f.name: f for f, _ in started}


def _workers(gw) -> list[str]:
    return sorted(gw.parts.workers.states)


def _assert_anthropic_error(response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == error_type
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# -- count_tokens -------------------------------------------------------------------------------


def test_count_tokens_is_relayed_from_a_worker_without_admitting_a_call(fleet):
    gw, by_name = fleet
    calls_before = {name: len(f.seen) for name, f in by_name.items()}
    r = gw.client.post("/v1/messages/count_tokens?beta=true", json=COUNT_BODY,
                       headers={"x-session-id": "counted-only", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    assert r.json() == {"input_tokens": 30}
    answered_by = r.headers["x-worker"]
    [counted] = [c for c in by_name[answered_by].counted if c.headers.get("x-session-id") == "counted-only"]
    assert counted.body["messages"] == COUNT_BODY["messages"]
    assert "session_id" not in counted.body and "vllm_xargs" not in counted.body
    # not a call: no program, nothing held, no call reached any worker's generate routes
    assert "counted-only" not in gw.programs()
    assert "counted-only" not in gw.parts.admission.policy.programs
    assert gw.parts.admission.held == 0
    assert {name: len(f.seen) for name, f in by_name.items()} == calls_before


def test_count_tokens_goes_to_the_sessions_home_worker(fleet):
    gw, by_name = fleet
    homes: dict[str, str] = {}
    for n in range(8):  # enough sessions that both workers are somebody's home
        session = f"home-{n}"
        r = gw.client.post("/v1/messages", json=MESSAGES_BODY, headers={"x-session-id": session})
        assert r.status_code == 200, r.text
        homes[session] = gw.programs()[session]["home_worker"]
    assert set(homes.values()) == set(by_name), "placement put every session on one worker"
    for session, home in homes.items():
        r = gw.client.post("/v1/messages/count_tokens", json=COUNT_BODY,
                           headers={"x-session-id": session})
        assert r.status_code == 200, r.text
        assert r.headers["x-worker"] == home, session


def test_count_tokens_the_worker_does_not_serve_is_an_anthropic_404():
    with fakes("w0", serves_count_tokens=False) as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 1_000_000} for f, s in started]
        with gateway(serve_config(workers)) as gw:
            r = gw.client.post("/v1/messages/count_tokens", json=COUNT_BODY,
                               headers={"x-session-id": "no-route"})
            error = _assert_anthropic_error(r, 404, "not_found_error")
            assert "count_tokens" in error["message"] and "w0" in error["message"]


def test_count_tokens_with_no_healthy_worker_is_an_anthropic_503_overloaded():
    config = serve_config([{"name": "dead", "url": f"http://127.0.0.1:{free_port()}",
                            "capacity_tokens": 100_000}],
                          health_interval_s=0.05, unhealthy_after=1)
    with gateway(config) as gw:
        wait_for(lambda: not gw.workers()["dead"]["healthy"], what="the dead worker marked down")
        r = gw.client.post("/v1/messages/count_tokens", json=COUNT_BODY,
                           headers={"x-session-id": "nobody"})
        _assert_anthropic_error(r, 503, "overloaded_error")
        assert "nobody" not in gw.programs()


# -- unknown models -----------------------------------------------------------------------------


def test_unknown_model_is_a_404_model_not_found_in_the_openai_shape_and_not_forwarded(fleet):
    gw, by_name = fleet
    calls_before = sum(len(f.seen) for f in by_name.values())
    for route, body in [("/v1/chat/completions", chat(model="no-such-model")),
                        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
                        ("/v1/responses", {"model": "no-such-model", "input": "x"})]:
        r = gw.client.post(route, json=body, headers={"x-session-id": "lost-model"})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "no-such-model" in error["message"]
    assert sum(len(f.seen) for f in by_name.values()) == calls_before
    assert "lost-model" not in gw.programs()


def test_unknown_model_on_messages_and_count_tokens_is_an_anthropic_not_found_error(fleet):
    gw, by_name = fleet
    counted_before = sum(len(f.counted) for f in by_name.values())
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        r = gw.client.post(route, json={**MESSAGES_BODY, "model": "claude-nope"},
                           headers={"x-session-id": "lost-anthropic"})
        error = _assert_anthropic_error(r, 404, "not_found_error")
        assert "claude-nope" in error["message"]
    assert sum(len(f.counted) for f in by_name.values()) == counted_before
    assert "lost-anthropic" not in gw.programs()


def test_known_model_and_a_body_without_model_are_still_forwarded(fleet):
    gw, _ = fleet
    assert gw.client.post("/v1/chat/completions", json=chat(),
                          headers={"x-session-id": "known"}).status_code == 200
    no_model = {"messages": [{"role": "user", "content": "hi"}]}
    assert gw.client.post("/v1/chat/completions", json=no_model,
                          headers={"x-session-id": "modelless"}).status_code == 200


def test_models_named_in_the_config_are_the_known_models():
    with fakes("w0") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 1_000_000} for f, s in started]
        with gateway(serve_config(workers, models=["fake-model", "alias"])) as gw:
            assert gw.client.post("/v1/chat/completions", json=chat(model="alias")).status_code == 200
            r = gw.client.post("/v1/chat/completions", json=chat(model="other"))
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_model_a_worker_loads_later_is_found_after_a_refresh():
    with fakes("w0") as started:
        fake = started[0][0]
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 1_000_000} for f, s in started]
        with gateway(serve_config(workers)) as gw:
            assert gw.client.post("/v1/chat/completions", json=chat(model="new-model")).status_code == 404
            fake.model = "new-model"  # the worker now serves it
            wait_for(lambda: gw.client.post("/v1/chat/completions",
                                            json=chat(model="new-model")).status_code == 200,
                     timeout=10, what="the new model to be found")


def test_model_is_not_checked_when_no_worker_list_can_be_fetched():
    with fakes("w0", models_status=500) as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 1_000_000} for f, s in started]
        with gateway(serve_config(workers)) as gw:
            r = gw.client.post("/v1/chat/completions", json=chat(model="anything"))
            assert r.status_code == 200, r.text
