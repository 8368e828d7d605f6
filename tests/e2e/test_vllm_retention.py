"""Retention directives on real vLLM CPU workers: the gateway's program_aware policy
sends ``kv.retain`` for the programs it places, the engine plugin biases vLLM's eviction order,
and a retained program's prefix survives a flood of other sessions that an unretained one does
not.

The flood goes straight to the worker, past the gateway: co-tenant traffic Sluice does not
schedule, with sessions the plugin holds at the normal class. Each run uses content no other
run or test uses.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import pytest

from tests.support.gateway_harness import wait_for
from tests.e2e.test_vllm_gateway import (
    cached_tokens,
    chat,
    client_for,
    conversation,
    next_turn,
    sluice,
    words,
)
from tests.support.vllm_fleet import BLOCK_SIZE, MODEL_NAME, NUM_BLOCKS, Fleet

pytestmark = pytest.mark.e2e

FLOOD_REQUESTS = 16
FLOOD_WORDS = 300        # ~10 blocks of 32 tokens each: 16 of them cycle the 64-block pool 2.5×


def flood(worker_url: str, tag: str) -> int:
    """Distinct one-turn sessions straight to the worker; returns the prompt tokens sent."""
    sent = 0
    with httpx.Client(base_url=worker_url, timeout=120, trust_env=False) as direct:
        for i in range(FLOOD_REQUESTS):
            rng = random.Random(f"{tag}-flood-{i}")
            body = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": f"{tag} flood {i}: {words(rng, FLOOD_WORDS)}"}],
                    "session_id": f"{tag}-flood-{i}"}
            r = direct.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            sent += r.json()["usage"]["prompt_tokens"]
    return sent


def keeper_run(fleet: Fleet, tag: str, retain: bool) -> dict[str, Any]:
    """One program's two turns through the gateway with a flood on its worker in between."""
    session = f"{tag}-keeper"
    seed = f"retention-{tag}"
    messages = conversation(seed, system_words=500, user_words=60)
    policy = {"tick_interval_s": 0.2, "retention": {"enabled": retain}}
    with sluice(fleet, "program_aware", **policy) as gw, client_for(gw) as client:
        sink = gw.parts.admission.sink
        first = chat(client, session, messages)
        assert first.status_code == 200, first.text
        home = gw.programs()[session]["home_worker"]
        if retain:
            wait_for(lambda: sink.sent["retain"] >= 1, timeout=5, what="a kv.retain sent for the keeper")
        time.sleep(0.3)  # the PUSH socket delivers; the plugin applies it at the next allocation
        flooded = flood(fleet[home].url, tag)
        second = chat(client, session, next_turn(messages, seed), final=True)
        assert second.status_code == 200, second.text
        return {"retain": retain, "worker": home,
                "first_prompt_tokens": first.json()["usage"]["prompt_tokens"],
                "flood_prompt_tokens": flooded,
                "second_prompt_tokens": second.json()["usage"]["prompt_tokens"],
                "second_cached_tokens": cached_tokens(second),
                "directives_sent": dict(sink.sent)}


def test_retained_session_keeps_its_prefix_through_a_flood_and_unretained_does_not(fleet: Fleet):
    # without the directive first: a retained keeper left behind would only make the pool smaller
    without = keeper_run(fleet, "noretain", retain=False)
    with_retain = keeper_run(fleet, "retain", retain=True)
    print("\n[e2e] retention:", json.dumps({"without": without, "with": with_retain}, indent=1))

    for run in (without, with_retain):
        # the flood alone is more than the worker's pool: everything unprotected cycles out
        assert run["flood_prompt_tokens"] > 2 * NUM_BLOCKS * BLOCK_SIZE
    assert without["directives_sent"]["retain"] == 0
    assert without["second_cached_tokens"] == 0, "the unretained keeper's prefix survived the flood"
    # the retained keeper's whole first-turn prompt, in full blocks, comes from cache
    full_blocks = with_retain["first_prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE
    assert with_retain["second_cached_tokens"] >= full_blocks - BLOCK_SIZE, with_retain
