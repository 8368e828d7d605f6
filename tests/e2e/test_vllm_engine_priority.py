"""The policy's engine priority reaches a real vLLM and orders its queue.

One vLLM CPU worker started with ``--scheduling-policy priority --max-num-seqs 1``: it runs
one sequence at a time and orders its waiting queue by ``(priority, arrival)``. Behind the
gateway under autellix, a program with attained service (PLAS queue 3) and a fresh one
(queue 1) queue behind a long call; the fresh one, sent later, runs first. The same gateway
with the worker declared ``fcfs`` sends no priority, and the two run in arrival order. The
bodies the gateway sent are read off its relay, the order off its ``call done`` lines.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_vllm_gateway import client_for, conversation
from tests.support.gateway_harness import Gateway, gateway, serve_config, wait_for
from tests.support.vllm_fleet import CAPACITY_TOKENS, MAX_MODEL_LEN, MODEL_NAME, Fleet

pytestmark = pytest.mark.e2e

WORKER = "wp"
QUEUE_MS = 10**9  # one autellix queue as the engine sees it (QUEUE_TIER_S in ms)
# autellix's service estimate per output token, raised so 30 tokens are 3 s of service:
# PLAS queue 3 (index 2) with bounds 1, 2, 4 s, far from both edges
DECODE_TOKEN_S = 0.1
SERVED_TOKENS = 30


@pytest.fixture(scope="module")
def priority_fleet(vllm_python: Path, tiny_model: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(vllm_python, tiny_model, tmp_path_factory.mktemp("vllm-priority"),
                  extra_args=("--scheduling-policy", "priority", "--max-num-seqs", "1"))
    try:
        try:
            fleet.start([WORKER])
        except RuntimeError as err:
            pytest.fail(str(err), pytrace=False)
        yield fleet
    finally:
        fleet.stop_all()


@contextmanager
def sluice(fleet: Fleet, scheduling_policy: str) -> Iterator[tuple[Gateway, list[dict]]]:
    """A gateway under autellix with the worker declared ``scheduling_policy``, and the list
    of bodies its relay sends (recorded on the way out)."""
    entry = {**fleet[WORKER].gateway_entry(), "scheduling_policy": scheduling_policy}
    config = serve_config([entry], policy={"name": "autellix",
                                           "decode_token_s": DECODE_TOKEN_S},
                          health_interval_s=0.5, capacity_retry_s=0.2,
                          upstream={"connect_timeout_s": 2.0, "read_timeout_s": 120.0})
    with gateway(config) as gw:
        wait_for(lambda: gw.workers()[WORKER]["capacity_tokens"] == CAPACITY_TOKENS,
                 timeout=15, what="the worker's /metrics capacity")
        relay = gw.parts.pool.relay(WORKER)
        request = relay.request
        sent: list[dict] = []

        async def recorded(method: bytes, path: bytes, headers: Any, content: bytes):
            sent.append(json.loads(content))
            return await request(method, path, headers, content)

        relay.request = recorded
        yield gw, sent


def waiting_on_engine(fleet: Fleet) -> float:
    text = httpx.get(f"{fleet[WORKER].url}/metrics", timeout=5, trust_env=False).text
    found = re.search(r"^vllm:num_requests_waiting\{[^}]*\}\s+(\S+)", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def call(gw: Gateway, session: str, tag: str, max_tokens: int) -> httpx.Response:
    with client_for(gw) as client:
        return client.post("/v1/chat/completions", headers={"x-session-id": session}, json={
            "model": MODEL_NAME, "messages": conversation(f"{tag}-{session}", 20, 10),
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})


def finished_order(gw: Gateway, sessions: set[str], after_line: int) -> list[str]:
    """Sessions of the calls done after log line ``after_line``, in the order they finished."""
    done = [json.loads(line) for line in gw.log.lines()[after_line:] if '"call done"' in line]
    return [record["session_id"] for record in done if record["session_id"] in sessions]


def queue_behind_a_long_call(fleet: Fleet, gw: Gateway, tag: str) -> list[str]:
    """``served`` (3 s of attained service) and then ``fresh`` queue on the engine behind
    ``blocker``'s long stream; the blocker's client then leaves. Returns the order in which
    ``served`` and ``fresh`` finished."""
    first = call(gw, "served", tag, SERVED_TOKENS)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == SERVED_TOKENS
    logged = len(gw.log.lines())
    blocker = {"model": MODEL_NAME, "messages": conversation(f"{tag}-blocker", 20, 10),
               "max_tokens": MAX_MODEL_LEN - 200, "ignore_eos": True, "stream": True}
    with client_for(gw) as client, ThreadPoolExecutor(2) as pool, client.stream(
            "POST", "/v1/chat/completions", json=blocker,
            headers={"x-session-id": "blocker"}) as stream:
        assert stream.status_code == 200
        chunks = stream.iter_raw()  # kept: a dropped iterator closes the stream
        next(chunks)  # the blocker runs: the engine's one sequence
        served = pool.submit(call, gw, "served", tag, 8)
        wait_for(lambda: waiting_on_engine(fleet) >= 1, timeout=30, what="served queued on vLLM")
        fresh = pool.submit(call, gw, "fresh", tag, 8)
        wait_for(lambda: waiting_on_engine(fleet) >= 2, timeout=30,
                 what="fresh queued on vLLM too, behind the blocker")
        # leaving the block ends the blocker's stream: the gateway aborts it upstream
    assert served.result().status_code == fresh.result().status_code == 200
    return finished_order(gw, {"served", "fresh"}, logged)


def test_priority_reaches_vllm_and_a_better_queue_runs_first(priority_fleet: Fleet):
    with sluice(priority_fleet, "priority") as (gw, sent):
        order = queue_behind_a_long_call(priority_fleet, gw, f"prio-{time.time_ns()}")
    priorities = [(body["session_id"], body["priority"]) for body in sent]
    # served's first call and the blocker were fresh programs (queue 1); served's second call
    # has 3 s of service (queue 3); fresh is new
    assert priorities == [("served", 0), ("blocker", 0), ("served", 2 * QUEUE_MS), ("fresh", 0)]
    assert order == ["fresh", "served"]  # sent later, but in a better queue


def test_a_worker_declared_fcfs_gets_no_priority_and_runs_in_arrival_order(priority_fleet: Fleet):
    with sluice(priority_fleet, "fcfs") as (gw, sent):
        order = queue_behind_a_long_call(priority_fleet, gw, f"fcfs-{time.time_ns()}")
    assert [body["session_id"] for body in sent] == ["served", "blocker", "served", "fresh"]
    assert all("priority" not in body for body in sent)
    assert order == ["served", "fresh"]
