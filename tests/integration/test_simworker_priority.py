"""Priority as vLLM schedules it (``scheduling_policy``): with one call at a time
(``max_num_seqs`` 1), calls queued behind a running one start in ``priority`` order, lower
first, under "priority", and in arrival order under "fcfs" (where vLLM 0.32 accepts a
non-zero priority and ignores it). The Anthropic route has no ``priority``.

The order is read from the worker's KV events: with one call at a time, the first
``BlockStored`` of each call's session comes in the order the engine admitted the calls.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import zmq

from scheduler.kv_events import BlockStored, EventBatchDecoder
from simworker.worker import SimWorkerConfig, create_app
from tests.support.gateway_harness import ServerThread

MODEL = "sluice-sim"
# (session, route, priority) in the order they reach the engine. The Anthropic call's
# priority is not a field of that route: it runs at 0.
CALLS = [("p5", "chat", 5), ("p1", "completions", 1), ("p3", "responses", 3), ("m2", "chat", -2),
         ("anthropic", "messages", -100)]
BY_PRIORITY = ["m2", "anthropic", "p1", "p3", "p5"]
BY_ARRIVAL = [session for session, _, _ in CALLS]
WAIT_S = 30.0


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not in {WAIT_S:.0f} s"
        time.sleep(0.02)


def gauge(url: str, name: str) -> int:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError(f"{name} missing from /metrics")


def waiting(url: str) -> int:
    return gauge(url, "vllm:num_requests_waiting")


def running(url: str) -> int:
    return gauge(url, "vllm:num_requests_running")


def post(url: str, session: str, route: str, priority: int) -> httpx.Response:
    # a prompt of its own, long enough to fill blocks, so each call stores some
    text = f"Call {session}: " + "read the module and fix the failing test " * 6
    headers = {"x-session-id": session}
    if route == "messages":
        body = {"model": MODEL, "max_tokens": 8, "priority": priority, "messages": [{"role": "user", "content": text}]}
        return httpx.post(f"{url}/v1/messages", json=body, headers=headers, timeout=60)
    if route == "completions":
        body = {"model": MODEL, "max_tokens": 4, "priority": priority, "prompt": text}
        return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    if route == "responses":
        body = {"model": MODEL, "max_output_tokens": 4, "priority": priority, "input": text}
        return httpx.post(f"{url}/v1/responses", json=body, headers=headers, timeout=60)
    body = {"model": MODEL, "max_tokens": 4, "priority": priority, "messages": [{"role": "user", "content": text}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def admission_order(policy: str) -> list[str]:
    config = SimWorkerConfig(name=f"prio-{policy}", num_blocks=800, block_size=16, kv_events="tcp://127.0.0.1:*",
                             time_scale=1.0, max_num_seqs=1, scheduling_policy=policy)
    app = create_app(config)
    server = ServerThread(app).start()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(app.state.worker.kv_endpoint)
    answers: dict[str, int] = {}
    threads = []
    try:
        time.sleep(0.3)  # let the subscription reach the publisher
        # a long call holds the only slot (4,000 tokens of decode: seconds at time scale 1)
        blocker = httpx.Client(timeout=60)
        stream = blocker.stream("POST", f"{server.url}/v1/chat/completions", headers={"x-session-id": "blocker"},
                                json={"model": MODEL, "max_tokens": 4000, "stream": True,
                                      "messages": [{"role": "user", "content": "Hold the engine."}]})
        response = stream.__enter__()
        lines = response.iter_lines()  # kept: dropping the iterator would close the connection
        next(lines)
        wait_for(lambda: running(server.url) == 1, "the long call running")
        for number, (session, route, priority) in enumerate(CALLS, start=1):
            def call(session=session, route=route, priority=priority) -> None:
                answers[session] = post(server.url, session, route, priority).status_code
            thread = threading.Thread(target=call)
            thread.start()
            threads.append(thread)
            # one at a time into the queue, so the arrival order is this order
            wait_for(lambda n=number: waiting(server.url) == n, f"{session} queued")
        stream.__exit__(None, None, None)  # the client leaves: the call is aborted, the slot frees
        blocker.close()
        for thread in threads:
            thread.join(WAIT_S)
        assert answers == {session: 200 for session, _, _ in CALLS}
        order: list[str] = []
        decoder = EventBatchDecoder()
        deadline = time.monotonic() + WAIT_S
        while len(order) < len(CALLS):
            assert time.monotonic() < deadline, f"KV events of {order} only"
            if sub.poll(200):
                for event in decoder.decode(sub.recv_multipart()[2]).events:
                    if isinstance(event, BlockStored) and event.session_id not in (*order, "blocker", None):
                        order.append(event.session_id)
        return order
    finally:
        sub.close()
        context.term()
        server.stop()


@pytest.mark.parametrize("policy, expected", [("priority", BY_PRIORITY), ("fcfs", BY_ARRIVAL)])
def test_queued_calls_start_in_the_policys_order(policy, expected):
    assert admission_order(policy) == expected


def test_a_non_integer_priority_is_refused_as_vllm_refuses_it():
    server = ServerThread(create_app(SimWorkerConfig(name="prio", num_blocks=64, kv_events=None,
                                                     scheduling_policy="priority"))).start()
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "priority": "high"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "body.priority" and r.json()["error"]["type"] == "Bad Request"
        assert json.loads(r.text)["error"]["message"].startswith("1 validation error")
    finally:
        server.stop()
