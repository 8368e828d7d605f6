"""Bounds and policy errors through the gateway: a call past ``limits:`` is refused with
Retry-After and counted; a policy that raises fails only the call at hand, is counted in
``sluice_core_errors_total``, and leaves the gateway and the policy agreeing on every call
(``Admission.disagreements``). Real servers on loopback, real httpx clients."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.support.gateway_harness import chat, fakes, gateway, serve_config, wait_for

TINY = 1000  # one program per worker fits (see test_gateway_admission.py)


def _post(url: str, session: str, timeout: float = 10.0, **headers: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=timeout, trust_env=False) as client:
        return client.post("/v1/chat/completions", json=chat(f"task of {session}"),
                           headers={"x-session-id": session, **headers})


def _metric(gw, line_start: str) -> float:
    for line in gw.client.get("/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric line {line_start}")


@pytest.fixture
def tight_with(request):
    """Two tiny workers behind a gateway with the limits given by the test's parameter."""
    with fakes("w0", "w1") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": TINY} for f, s in started]
        with gateway(serve_config(workers, limits=request.param)) as gw:
            yield gw, {f.name: f for f, _ in started}


def _fill(pool, gw, workers, delay="1.0"):
    calls = [pool.submit(_post, gw.url, s, **{"x-test-delay-s": delay}) for s in ("a", "b")]
    wait_for(lambda: all(any(s in f.sessions() for f in workers.values()) for s in ("a", "b")),
             what="a and b upstream")
    return calls


@pytest.mark.parametrize("tight_with", [{"max_programs": 2, "retry_after_s": 7}], indirect=True)
def test_a_call_starting_a_program_past_max_programs_gets_429_with_retry_after(tight_with):
    gw, _ = tight_with
    assert _post(gw.url, "one").status_code == 200
    assert _post(gw.url, "two").status_code == 200
    refused = _post(gw.url, "three")
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "7"
    assert "limits.max_programs" in refused.json()["error"]["message"]
    assert "three" not in gw.programs()
    assert _post(gw.url, "one").status_code == 200  # known programs go on
    assert _metric(gw, 'sluice_limit_refusals_total{limit="max_programs"}') == 1
    assert gw.parts.admission.disagreements() == []


@pytest.mark.parametrize("tight_with", [{"max_held_calls": 1}], indirect=True)
def test_a_call_the_policy_would_hold_past_max_held_calls_gets_429(tight_with):
    gw, workers = tight_with
    with ThreadPoolExecutor(4) as pool:
        a, b = _fill(pool, gw, workers)
        c = pool.submit(_post, gw.url, "c")
        wait_for(lambda: gw.programs().get("c", {}).get("waiting") == 1, what="c held")
        refused = _post(gw.url, "d")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
        assert "d" not in gw.programs()  # taken back out of the policy, program and all
        assert a.result().status_code == b.result().status_code == c.result().status_code == 200
    assert not any("d" in f.sessions() for f in workers.values())
    assert _metric(gw, 'sluice_limit_refusals_total{limit="max_held_calls"}') == 1
    assert gw.parts.admission.disagreements() == []


@pytest.mark.parametrize("tight_with", [{"max_hold_s": 0.3}], indirect=True)
def test_a_call_held_max_hold_s_gets_503_and_is_dropped_from_the_policy(tight_with):
    gw, workers = tight_with
    with ThreadPoolExecutor(4) as pool:
        a, b = _fill(pool, gw, workers, delay="1.5")
        started = time.monotonic()
        refused = _post(gw.url, "c")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert time.monotonic() - started < 1.5  # not admitted when a or b finished
        assert "limits.max_hold_s" in refused.json()["error"]["message"]
        assert "c" not in gw.programs()
        assert a.result().status_code == b.result().status_code == 200
    assert not any("c" in f.sessions() for f in workers.values())
    assert _metric(gw, 'sluice_limit_refusals_total{limit="max_hold_s"}') == 1
    assert gw.parts.admission.disagreements() == []


def test_the_anthropic_route_gets_its_own_error_shape_and_retry_after_on_a_limit():
    with fakes("w0") as started:
        _, server = started[0]
        workers = [{"name": "w0", "url": server.url, "capacity_tokens": 100_000}]
        with gateway(serve_config(workers, limits={"max_programs": 1})) as gw:
            body = {"model": "fake-model", "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}]}
            gw.client.post("/v1/messages", json=body, headers={"x-session-id": "first"})
            refused = gw.client.post("/v1/messages", json=body, headers={"x-session-id": "second"})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            assert refused.json()["type"] == "error"


# -- policy errors -------------------------------------------------------------------------


@pytest.fixture
def roomy():
    with fakes("w0") as started:
        _, server = started[0]
        workers = [{"name": "w0", "url": server.url, "capacity_tokens": 1_000_000}]
        with gateway(serve_config(workers)) as gw:
            yield gw


def test_a_policy_error_on_arrival_fails_that_call_with_500_counts_it_and_nothing_else(roomy):
    gw = roomy
    policy = gw.parts.admission.policy
    real = policy.decide_arrival

    def fails_for_boom(program, call, now):
        if call.session_id == "boom":
            raise RuntimeError("injected policy failure")
        return real(program, call, now)

    policy.decide_arrival = fails_for_boom
    r = _post(gw.url, "boom")
    assert r.status_code == 500
    assert "scheduling policy" in r.json()["error"]["message"]
    assert _metric(gw, 'sluice_core_errors_total{operation="on_arrival"}') == 1
    assert gw.parts.admission.disagreements() == []  # the half-recorded call was taken back
    assert gw.programs()["boom"]["in_flight"] == 0 and gw.programs()["boom"]["waiting"] == 0
    assert _post(gw.url, "fine").status_code == 200
    assert any('"operation": "on_arrival"' in line and "injected policy failure" in line
               for line in gw.log.lines())


@pytest.mark.parametrize("tight_with", [{}], indirect=True)
def test_a_tick_that_fails_after_admitting_a_held_call_still_wakes_that_call(tight_with):
    """The tick after a's completion dispatches c inside the policy, then raises: the Admit
    is lost with the exception. Reconciling wakes c at once (without it c would wait for
    max_hold_s, counted in flight by the policy all along)."""
    gw, workers = tight_with
    policy = gw.parts.admission.policy
    real_tick = policy.tick
    failures = []

    def tick_then_fail(now):
        actions = real_tick(now)
        if any(getattr(a, "session_id", None) == "c" for a in actions) and not failures:
            failures.append(now)
            raise RuntimeError("injected tick failure")
        return actions

    policy.tick = tick_then_fail
    with ThreadPoolExecutor(4) as pool:
        a, b = _fill(pool, gw, workers)
        c = pool.submit(_post, gw.url, "c", timeout=8)
        wait_for(lambda: gw.programs().get("c", {}).get("waiting") == 1, what="c held")
        assert a.result().status_code == b.result().status_code == 200
        assert c.result().status_code == 200
    assert failures, "the injected failure never fired"
    assert _metric(gw, 'sluice_core_errors_total{operation="tick"}') == 1
    assert gw.parts.admission.disagreements() == []
    assert gw.programs()["c"]["in_flight"] == 0


def test_a_policy_error_on_completion_still_delivers_the_answer_and_retires_the_call(roomy):
    gw = roomy
    policy = gw.parts.admission.policy
    real = policy.after_call

    def fails(program, now):
        if program.session_id == "late":
            raise RuntimeError("injected completion failure")
        return real(program, now)

    policy.after_call = fails
    r = _post(gw.url, "late")
    assert r.status_code == 200 and r.json()["choices"]
    assert _metric(gw, 'sluice_core_errors_total{operation="on_complete"}') == 1
    assert gw.parts.admission.disagreements() == []
    assert gw.programs()["late"]["in_flight"] == 0
