"""Sharded gateways behind a balancer that knows nothing of programs (controller/shard_forward.py):
each gateway forwards a call for a program another owns to it, once.

Two gateways with two simworkers each and the same ``shards:`` list. The nginx tier's 64
programs (tests/support/shard_fleet.py) send every call to one gateway, then every call to the
other, as a round-robin balancer could: either way each program lives on the gateway its
root session hashes to, and only there. A forwarded call is not forwarded again; an owner
that cannot be reached gets its programs' calls a JSON 502 ``shard_unreachable``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller.identity import shard_key
from scheduler.rendezvous import rendezvous_shard
from tests.support.gateway_harness import Gateway, gateway, serve_config, wait_for
from tests.support.shard_fleet import (
    ROOTS,
    assert_held_by_owners,
    call,
    free_port,
    program_headers,
    send_every_call,
    simworker_entries,
)

MAX_BODY = 4096
# A LONG_TOKENS stream runs for seconds; the 4-token calls take milliseconds.
TIME_SCALE = 0.2
LONG_TOKENS = 3000



@pytest.fixture
def two_gateways() -> Iterator[tuple[list[Gateway], ExitStack]]:
    with ExitStack() as stack:
        ports = [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        gateways = []
        for index, name in enumerate(("a", "b")):
            entries = simworker_entries(stack, [f"{name}-w0", f"{name}-w1"], time_scale=TIME_SCALE)
            config = serve_config(entries, shards={"index": index, "gateways": urls},
                                  max_body_bytes=MAX_BODY)
            gateways.append(stack.enter_context(gateway(config, ports[index])))
        yield gateways, stack


def forwards(gw: Gateway) -> dict[tuple[str, str], float]:
    text = gw.client.get("/metrics").text
    return {(sample.labels["shard"], sample.labels["outcome"]): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "sluice_shard_forwards_total"}


@pytest.mark.parametrize("entry", [0, 1])
def test_every_program_lives_on_its_owner_whichever_gateway_its_calls_reach(two_gateways, entry):
    gateways, _ = two_gateways
    calls = program_headers()
    owner = {key: rendezvous_shard(shard_key(headers[0]), 2) for key, headers in calls.items()}
    with httpx.Client(base_url=gateways[entry].url, timeout=30, trust_env=False) as client:
        send_every_call(client, calls)

    assert_held_by_owners([set(gw.programs()) for gw in gateways], owner)
    other = 1 - entry
    sent_on = sum(len(headers) for key, headers in calls.items() if owner[key] == other)
    sent_on += owner[ROOTS[0]] == other  # the streamed call
    assert forwards(gateways[entry]) == {(str(other), "answered"): sent_on}
    assert forwards(gateways[other]) == {}  # what it got was forwarded already: served there


def test_a_forwarded_call_is_served_where_it_lands(two_gateways):
    gateways, _ = two_gateways
    stray = next(root for root in ROOTS if rendezvous_shard(root, 2) == 1)
    with httpx.Client(base_url=gateways[0].url, timeout=30, trust_env=False) as client:
        answer = call(client, {"x-session-id": stray, "x-sluice-forwarded": "1"})
    assert answer.status_code == 200, answer.text[:300]
    assert stray in gateways[0].programs() and stray not in gateways[1].programs()
    assert forwards(gateways[0]) == {}


def test_an_owner_out_of_reach_fails_only_its_programs_calls_with_a_json_502(two_gateways):
    gateways, _ = two_gateways
    gateways[1].close()
    with httpx.Client(base_url=gateways[0].url, timeout=30, trust_env=False) as client:
        for root in ROOTS[:16]:
            answer = call(client, {"x-session-id": root})
            if rendezvous_shard(root, 2) == 1:
                assert answer.status_code == 502, (root, answer.status_code, answer.text[:300])
                error = answer.json()["error"]
                assert error["code"] == "shard_unreachable" and "shard 1" in error["message"], error
                assert answer.headers.get("retry-after") == "5"
            else:
                assert answer.status_code == 200, (root, answer.status_code, answer.text[:300])
        # an Anthropic call gets Anthropic's error shape
        stray = next(root for root in ROOTS if rendezvous_shard(root, 2) == 1)
        answer = client.post("/v1/messages", headers={"x-session-id": stray},
                             json={"model": "sluice-sim", "max_tokens": 4,
                                   "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 502 and answer.json()["type"] == "error", answer.text[:300]
    assert forwards(gateways[0])[("1", "unreachable")] >= 1


def test_a_body_past_the_limit_is_refused_before_it_is_forwarded(two_gateways):
    gateways, _ = two_gateways
    stray = next(root for root in ROOTS if rendezvous_shard(root, 2) == 1)
    body = {"model": "sluice-sim", "max_tokens": 4,
            "messages": [{"role": "user", "content": "x" * (2 * MAX_BODY)}]}
    answer = gateways[0].client.post("/v1/chat/completions", json=body, headers={"x-session-id": stray})
    assert answer.status_code == 413, answer.text[:300]
    assert forwards(gateways[0]) == {}


def test_a_client_that_leaves_a_forwarded_stream_stops_the_owner_s_call(two_gateways):
    gateways, _ = two_gateways
    stray = next(root for root in ROOTS if rendezvous_shard(root, 2) == 1)
    body = {"model": "sluice-sim", "max_tokens": LONG_TOKENS, "stream": True,
            "messages": [{"role": "user", "content": "a long answer"}]}
    with httpx.Client(base_url=gateways[0].url, timeout=30, trust_env=False) as client:
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"x-session-id": stray}) as answer:
            assert answer.status_code == 200
            chunks = answer.iter_raw()  # kept: a generator dropped closes the stream
            next(chunks)  # the stream runs
            time.sleep(0.5)
            assert gateways[1].programs()[stray]["in_flight"] == 1
        left = time.monotonic()
    # the owner's call ends with the client, not after the LONG_TOKENS it was asked for (the
    # program may go with it: its only call never completed)
    wait_for(lambda: gateways[1].programs().get(stray, {}).get("in_flight", 0) == 0, timeout=10,
             what="the owner to end the call")
    assert time.monotonic() - left < 2.0
