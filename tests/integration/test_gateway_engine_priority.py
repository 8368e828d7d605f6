"""The policy's engine priority reaches the workers that order by it

A worker declared ``scheduling_policy: priority`` gets ``"priority": engine_priority(...)``
on its chat, completions and Responses calls: 0 for a call admitted on arrival, minus the
held time for a held one (and the resume boost for a resumed program), plus the soft-band
delay in a soft band, autellix's queue as 10^9 ms tiers. A worker declared ``fcfs`` and every
Messages call get none. The gateway runs on a clock the test sets, so every value is exact;
the workers are fake vLLMs that record the bodies they receive (tests/support/fake_vllm.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from controller.gateway import create_app
from entry.ports import free_port
from tests.support.fake_vllm import FakeState
from tests.support.gateway_harness import (
    ADMIN,
    Gateway,
    LogSink,
    ServerThread,
    chat,
    fakes,
    serve_config,
    wait_for,
)

START = 1000.0
QUEUE_MS = 10**9  # one autellix queue as an engine sees it (QUEUE_TIER_S in ms)


class SetClock:
    """The gateway's policy clock, moved by the test (read from the server's thread)."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@contextmanager
def clocked_gateway(workers: list[dict], clock: SetClock, **overrides: Any) -> Iterator[Gateway]:
    log = LogSink()
    app = create_app(serve_config(workers, **overrides), clock=clock, log_stream=log)
    gw = Gateway(ServerThread(app).start(), app, log)
    try:
        yield gw
    finally:
        gw.close()


def post(url: str, session: str, route: str = "/v1/chat/completions", body: dict | None = None,
         **headers: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as client:
        response = client.post(route, json=body or chat(f"task of {session}"),
                               headers={"x-session-id": session, **headers})
    assert response.status_code == 200, response.text
    return response


@contextmanager
def in_flight(url: str, session: str) -> Iterator[None]:
    """A call of ``session`` that runs upstream until the block ends (a slow stream the
    client then leaves: the gateway aborts it in the policy, which ticks)."""
    with httpx.Client(base_url=url, timeout=10, trust_env=False) as client, client.stream(
            "POST", "/v1/chat/completions", json=chat("long", stream=True),
            headers={"x-session-id": session, "x-test-chunks": "1000",
                     "x-test-chunk-delay-s": "0.05"}) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()  # kept: a dropped iterator closes the stream
        next(chunks)  # upstream and streaming
        yield


def bodies(fake: FakeState, session: str) -> list[dict]:
    return [seen.body for seen in fake.seen if seen.body.get("session_id") == session]


ROUTE_BODIES = {
    "/v1/chat/completions": chat("hello"),
    "/v1/completions": {"model": "fake-model", "prompt": "hello"},
    "/v1/responses": {"model": "fake-model", "input": "hello"},
    "/v1/messages": {"model": "fake-model", "max_tokens": 5,
                     "messages": [{"role": "user", "content": "hello"}]},
}


@pytest.mark.parametrize("scheduling_policy", ["priority", "fcfs"])
def test_a_call_admitted_on_arrival_carries_priority_0_to_a_priority_worker_only(scheduling_policy):
    with fakes("w0") as [(fake, server)]:
        worker = {"name": "w0", "url": server.url, "capacity_tokens": 1_000_000,
                  "scheduling_policy": scheduling_policy}
        with clocked_gateway([worker], SetClock()) as gw:
            for route, body in ROUTE_BODIES.items():
                post(gw.url, f"s{route}", route, body)
            post(gw.url, "streamed", body=chat("hello", stream=True))
    sent = {seen.path if seen.body["session_id"] != "streamed" else "stream": seen.body
            for seen in fake.seen}
    assert set(sent) == {*ROUTE_BODIES, "stream"}
    for route, body in sent.items():
        if scheduling_policy == "priority" and route != "/v1/messages":
            assert body["priority"] == 0, route
        else:
            assert "priority" not in body, route  # fcfs worker, or vLLM's Messages route
    assert sent["stream"]["stream_options"] == {"include_usage": True}


# With a single worker of 1,000 tokens and the default reserves (512 growth + 100 buffer per
# program), one program with a call in flight fills ~62% of it and a second one does not fit.
SMALL = 1000


# held_call_lead_s: the default (0) counts a held call as arriving when it is let go; null
# gives it its whole hold as lead
@pytest.mark.parametrize(("policy", "held_priority"), [({}, 0), ({"held_call_lead_s": None}, -3_500)])
def test_a_held_call_carries_minus_the_time_it_was_held_up_to_its_lead(policy, held_priority):
    clock = SetClock()
    with fakes("w0") as [(fake, server)]:
        worker = {"name": "w0", "url": server.url, "capacity_tokens": SMALL,
                  "scheduling_policy": "priority"}
        with clocked_gateway([worker], clock, policy=policy) as gw, ThreadPoolExecutor(1) as pool:
            with in_flight(gw.url, "a"):
                held = pool.submit(post, gw.url, "c")
                wait_for(lambda: gw.programs().get("c", {}).get("waiting") == 1, what="c held")
                clock.now = START + 3.5
            # a's call ended (its client left) 3.5 s later: room for c
            held.result()
    assert bodies(fake, "a")[0]["priority"] == 0
    assert bodies(fake, "c")[0]["priority"] == held_priority


def test_a_call_admitted_in_the_soft_band_carries_the_delay():
    clock = SetClock()
    with fakes("w0") as [(fake, server)]:
        worker = {"name": "w0", "url": server.url, "capacity_tokens": SMALL,
                  "scheduling_policy": "priority"}
        # a's call in flight puts U at ~0.62: inside [pause_target, pause_threshold)
        policy = {"pause_target": 0.5, "tick_interval_s": 0.05, "soft_band_delay_s": 2.0}
        with clocked_gateway([worker], clock, policy=policy) as gw, in_flight(gw.url, "a"):
            wait_for(lambda: gw.parts.admission.policy.in_soft_band("w0"), what="w0 in the soft band")
            post(gw.url, "a")  # a second call of the same program goes home, 2 s later
    assert [body["priority"] for body in bodies(fake, "a")] == [0, 2_000]


@pytest.mark.parametrize(("lead", "resumed_priority"), [(0.0, -1_000), (None, -5_000)])
def test_a_resumed_programs_call_carries_its_hold_up_to_its_lead_and_the_resume_boost(
        lead, resumed_priority):
    clock = SetClock()
    policy = {"buffer_per_program": 0, "growth_reserve_tokens": 0, "pause_threshold": 1.0,
              "pause_target": 0.9, "max_wait_s": None, "dormant_quantile": None,
              "resume_priority_boost_s": 1.0, "held_call_lead_s": lead}
    with fakes("w0") as [(fake, server)]:
        worker = {"name": "w0", "url": server.url, "capacity_tokens": SMALL,
                  "scheduling_policy": "priority"}
        with clocked_gateway([worker], clock, policy=policy) as gw, ThreadPoolExecutor(1) as pool:
            post(gw.url, "p", **{"x-test-prompt-tokens": "300"})  # p: 305 tokens, acting
            clock.now = START + 1.0
            # q's completion brings U to 1.11: the pause pass pauses p, the smaller one
            post(gw.url, "q", **{"x-test-prompt-tokens": "800"})
            assert gw.programs()["p"]["lifecycle"] == "paused"
            clock.now = START + 10.0
            resumed = pool.submit(post, gw.url, "p")
            wait_for(lambda: gw.programs()["p"]["waiting"] == 1, what="p's call held")
            clock.now = START + 14.0
            # q's last call ends it: room for p, resumed with its call 1 s ahead
            post(gw.url, "q", **{"x-test-prompt-tokens": "800", "x-dynamo-session-final": "true"})
            resumed.result()
    # held from 1010 to 1014 (counted only with lead None), and 1 s of boost
    assert [body["priority"] for body in bodies(fake, "p")] == [0, resumed_priority]
    assert [body["priority"] for body in bodies(fake, "q")] == [0, 0]


def test_autellix_queues_reach_the_engine_as_tiers():
    with fakes("w0") as [(fake, server)]:
        worker = {"name": "w0", "url": server.url, "capacity_tokens": 1_000_000,
                  "scheduling_policy": "priority"}
        with clocked_gateway([worker], SetClock(), policy={"name": "autellix"}) as gw:
            # 100 output tokens: 2 s of attained service, PLAS queue 3 (index 2)
            post(gw.url, "served", body=chat("hello", max_tokens=100))
            post(gw.url, "served")
            post(gw.url, "fresh")
    assert [body["priority"] for body in bodies(fake, "served")] == [0, 2 * QUEUE_MS]
    assert bodies(fake, "fresh")[0]["priority"] == 0


@pytest.mark.parametrize("dead_policy,alive_policy", [("priority", "fcfs"), ("fcfs", "priority")])
def test_a_call_placed_again_gets_the_treatment_of_the_worker_it_lands_on(dead_policy, alive_policy):
    with fakes("alive") as [(fake, server)]:
        workers = [{"name": "dead", "url": f"http://127.0.0.1:{free_port()}",
                    "capacity_tokens": 100_000, "scheduling_policy": dead_policy},
                   {"name": "alive", "url": server.url, "capacity_tokens": 100_000,
                    "scheduling_policy": alive_policy}]
        with clocked_gateway(workers, SetClock(), health_interval_s=60, unhealthy_after=3) as gw:
            answer = post(gw.url, "s")  # placed on "dead" first (both empty: the first wins)
            assert answer.headers["x-worker"] == "alive"
            assert any("worker unreachable" in line for line in gw.log.lines())
    [body] = bodies(fake, "s")
    if alive_policy == "priority":
        assert body["priority"] == 0
    else:
        assert "priority" not in body


@pytest.mark.parametrize("forward_client_keys,expected", [([], 0), (["priority"], 7)])
def test_the_clients_priority_is_dropped_for_the_policys_unless_forwarded(forward_client_keys,
                                                                          expected):
    with fakes("w0") as [(fake, server)]:
        worker = {"name": "w0", "url": server.url, "capacity_tokens": 1_000_000,
                  "scheduling_policy": "priority"}
        with clocked_gateway([worker], SetClock(), forward_client_keys=forward_client_keys) as gw:
            post(gw.url, "s", body=chat("hello", priority=7))
            # vLLM reads the same from a header, before the body: dropped alike
            post(gw.url, "h", **{"x-vllm-priority": "-9"})
    assert bodies(fake, "s")[0]["priority"] == expected
    [seen] = [seen for seen in fake.seen if seen.body["session_id"] == "h"]
    assert seen.body["priority"] == 0
    assert seen.headers.get("x-vllm-priority") == ("-9" if forward_client_keys else None)


def test_a_worker_added_at_run_time_gets_the_treatment_its_entry_names():
    with fakes("w0", "w1") as [(old, old_server), (new, new_server)]:
        worker = {"name": "w0", "url": old_server.url, "capacity_tokens": 1_000_000}
        with clocked_gateway([worker], SetClock()) as gw:
            added = gw.client.post("/sluice/workers", headers=ADMIN, json={
                "name": "w1", "url": new_server.url, "capacity_tokens": 1_000_000,
                "scheduling_policy": "priority"})
            assert added.status_code == 201, added.text
            assert {w: gw.workers()[w]["scheduling_policy"] for w in ("w0", "w1")} == {
                "w0": "fcfs", "w1": "priority"}  # what the admin listing shows
            assert gw.client.post("/sluice/workers/w0/drain", headers=ADMIN).status_code == 200
            post(gw.url, "s")
    assert old.seen == []
    assert bodies(new, "s")[0]["priority"] == 0
