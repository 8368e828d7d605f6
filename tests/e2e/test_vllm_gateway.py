"""The gateway in front of two real vLLM CPU workers (tiny dummy-weight model).

The gateway runs in-process (tests/integration/gateway_harness.py), so the tests can look at
its policy. Each test starts its own gateway on the session's workers and uses content no
other test uses, so the workers' caches carry nothing from one test into another.

The tests on the gateway's KV index (``index predicts the cache``, ``restart resets the
index``) need the gateway's KV-event subscriber (controller/subscriber.py); without
it they fail, naming what is missing.
"""

from __future__ import annotations

import importlib.util
import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.support.gateway_harness import Gateway, gateway, serve_config, wait_for
from scheduler.kv_events import EventBatchDecoder
from tests.support.vllm_fleet import (
    BLOCK_SIZE,
    CAPACITY_TOKENS,
    MODEL_NAME,
    Fleet,
    KvEventTap,
    replay,
    vllm_block_hashes,
)

pytestmark = pytest.mark.e2e

# Words the tiny model's tokenizer was trained on: about one token each.
WORDS = ("agent tool call result session program worker cache block token prompt prefix "
         "model request response user system read write edit file line code test build run "
         "error fix patch diff commit branch merge search query answer plan step think "
         "reason observe act return value function class module import").split()
INDEX_WAIT_S = 10.0


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(seed: str, system_words: int = 120, user_words: int = 40) -> list[dict]:
    rng = random.Random(seed)
    return [{"role": "system", "content": f"{seed}: {words(rng, system_words)}"},
            {"role": "user", "content": words(rng, user_words)}]


def next_turn(messages: list[dict], seed: str, reply_words: int = 30, tool_words: int = 50) -> list[dict]:
    rng = random.Random(f"{seed}/{len(messages)}")
    return [*messages, {"role": "assistant", "content": words(rng, reply_words)},
            {"role": "user", "content": words(rng, tool_words)}]


def chat(client: httpx.Client, session: str, messages: list[dict], *, max_tokens: int = 8,
         final: bool = False, **extra: Any) -> httpx.Response:
    headers = {"x-session-id": session}
    if final:
        headers["x-dynamo-session-final"] = "true"
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body, headers=headers)


def cached_tokens(response: httpx.Response) -> int:
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def served_by(gw: Gateway, session: str) -> list[str]:
    """Workers of the session's finished calls, in order, from the gateway's log."""
    out = []
    for line in gw.log.lines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "call done" and record.get("session_id") == session:
            out.append(record["worker"])
    return out


@contextmanager
def sluice(fleet: Fleet, policy: str = "program_aware", **policy_keys: Any) -> Iterator[Gateway]:
    config = serve_config(
        [w.gateway_entry() for w in fleet.workers],
        policy={"name": policy, **policy_keys},
        health_interval_s=0.5, unhealthy_after=1, capacity_retry_s=0.2,
        upstream={"connect_timeout_s": 2.0, "read_timeout_s": 120.0},
    )
    with gateway(config) as gw:
        wait_for(lambda: all(w["capacity_tokens"] == CAPACITY_TOKENS and w["healthy"]
                             for w in gw.workers().values()),
                 timeout=15, what="both workers healthy with their /metrics capacity")
        yield gw


def client_for(gw: Gateway) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=120, trust_env=False)


def subscriber_missing(gw: Gateway, worker: str) -> str:
    has_module = importlib.util.find_spec("controller.subscriber") is not None
    index = gw.parts.admission.policy.index
    return (f"the gateway's KV index never showed the expected blocks of {worker} within "
            f"{INDEX_WAIT_S:.0f} s (controller.subscriber {'exists' if has_module else 'does not exist'}; "
            f"index.has_events({worker!r}) = {index.has_events(worker)}). The KV-event subscriber "
            "must feed policy.index from the workers' kv_events sockets.")


def wait_resident(gw: Gateway, worker: str, hashes: list[int]) -> None:
    """Until the gateway's index holds all of ``hashes`` on ``worker``; fails (never skips)
    when it does not, since the subscriber is then missing or broken."""
    kv = gw.parts.admission.policy.index.worker(worker)
    deadline = time.monotonic() + INDEX_WAIT_S
    while kv.prefix_tokens(hashes) < len(hashes) * BLOCK_SIZE:
        if time.monotonic() > deadline:
            pytest.fail(subscriber_missing(gw, worker), pytrace=False)
        time.sleep(0.05)


# -- (a) session ids reach vLLM's KV events ------------------------------------------------------


def test_session_id_reaches_kv_events_and_programs(fleet: Fleet, kv_tap: KvEventTap):
    messages = conversation("events-s1")
    prompt = fleet.tokenize_chat(messages)
    with sluice(fleet) as gw, client_for(gw) as client:
        r = chat(client, "s1", messages)
        assert r.status_code == 200, r.text
        (worker,) = served_by(gw, "s1")
        programs = gw.programs()
        assert "s1" in programs and programs["s1"]["home_worker"] == worker

    stored = kv_tap.wait_stored("s1")
    assert stored, "no BlockStored with session_id 's1' arrived on the test's SUB"
    assert {w for w, _ in stored} == {worker}
    hashes = [h for _, event in stored for h in event.block_hashes]
    expected = vllm_block_hashes(prompt)
    assert len(expected) == len(prompt) // BLOCK_SIZE >= 2
    assert hashes[:len(expected)] == expected  # the prompt's blocks, hashed as vLLM does
    first = stored[0][1]
    assert first.parent_block_hash is None and first.block_size == BLOCK_SIZE
    assert first.token_ids[:BLOCK_SIZE] == prompt[:BLOCK_SIZE]
    assert kv_tap.errors == []

    # The frames: topic as configured, seq contiguous per worker, and the replay socket
    # serves the same bytes the SUB got.
    got = [r for r in kv_tap.snapshot() if r.worker == worker]
    assert {r.topic for r in got} == {fleet[worker].topic}
    seqs = [r.seq for r in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    replayed = {seq: payload for _, seq, payload in replay(fleet[worker], seqs[0])}
    assert all(replayed[r.seq] == r.payload for r in got)
    assert EventBatchDecoder().decode(replayed[seqs[-1]]) == got[-1].batch


# -- (b) the second turn hits the prefix cache on the same worker --------------------------------


def test_second_turn_is_cached_on_the_same_worker(fleet: Fleet):
    first = conversation("cache-s2")
    second = next_turn(first, "cache-s2")
    first_tokens = fleet.tokenize_chat(first)
    with sluice(fleet) as gw, client_for(gw) as client:
        r1 = chat(client, "s2", first)
        assert r1.status_code == 200, r1.text
        assert cached_tokens(r1) == 0
        r2 = chat(client, "s2", second)
        assert r2.status_code == 200, r2.text
        workers = served_by(gw, "s2")
        assert len(workers) == 2 and workers[0] == workers[1]
        assert gw.programs()["s2"]["home_worker"] == workers[0]
    cached = cached_tokens(r2)
    assert cached > 0
    assert cached % BLOCK_SIZE == 0
    # every full block of the first prompt is a prefix of the second
    assert cached >= (len(first_tokens) // BLOCK_SIZE) * BLOCK_SIZE
    assert cached < r2.json()["usage"]["prompt_tokens"]


# -- (d) the index predicts the cache ------------------------------------------------------------


def predicted(gw: Gateway, hashes: list[int]) -> dict[str, int]:
    index = gw.parts.admission.policy.index
    return {name: index.worker(name).prefix_tokens(hashes) for name in index.workers()}


def expected_hit_blocks(prefix_tokens: int, prompt_len: int) -> int:
    # vLLM caps a hit at prompt_len - 1 tokens: the last token is always computed
    return min(prefix_tokens // BLOCK_SIZE, (prompt_len - 1) // BLOCK_SIZE)


def test_index_predicts_cached_tokens(fleet: Fleet):
    shared = conversation("probe-d")
    with sluice(fleet) as gw, client_for(gw) as client:
        r1 = chat(client, "probe", shared)
        assert r1.status_code == 200, r1.text
        (home,) = served_by(gw, "probe")
        wait_resident(gw, home, vllm_block_hashes(fleet.tokenize_chat(shared)))

        # Probe 1: the same program's next turn.
        turn2 = next_turn(shared, "probe-d")
        tokens2 = fleet.tokenize_chat(turn2)
        before = predicted(gw, vllm_block_hashes(tokens2))
        r2 = chat(client, "probe", turn2)
        assert r2.status_code == 200, r2.text
        worker2 = served_by(gw, "probe")[-1]
        assert before[worker2] > 0
        assert cached_tokens(r2) // BLOCK_SIZE == expected_hit_blocks(before[worker2], len(tokens2))
        assert cached_tokens(r2) % BLOCK_SIZE == 0

        # Probe 2: a new program sharing the system prompt, wherever the policy puts it.
        wait_resident(gw, worker2, vllm_block_hashes(tokens2))
        other = [shared[0], {"role": "user", "content": "a different task: " + shared[1]["content"]}]
        tokens3 = fleet.tokenize_chat(other)
        before3 = predicted(gw, vllm_block_hashes(tokens3))
        r3 = chat(client, "probe-new", other)
        assert r3.status_code == 200, r3.text
        (worker3,) = served_by(gw, "probe-new")
        assert cached_tokens(r3) // BLOCK_SIZE == expected_hit_blocks(before3[worker3], len(tokens3))


# -- (e) overload: program_aware vs kv_aware -------------------------------------------------------

SESSIONS = 10
TURNS = 5
TOOL_S = 0.2
LOAD_POLICY = {"growth_reserve_tokens": 32, "buffer_per_program": 32, "tick_interval_s": 0.2}
# A router has no U of its own to tune: its section takes only the tick.
ROUTER_POLICY = {"tick_interval_s": 0.2}


def run_load(fleet: Fleet, policy: str) -> dict[str, Any]:
    """SESSIONS programs at once, TURNS calls each, through a fresh gateway. The content is
    the same for every policy except the first words (so no run reuses another's cache)."""
    records: list[dict] = []

    def program(i: int) -> None:
        seed = f"load-{i}"
        messages = conversation(seed, system_words=200, user_words=30)
        messages[0]["content"] = f"{policy} {messages[0]['content']}"
        session = f"{policy}-{i}"
        with client_for(gw) as client:
            for turn in range(TURNS):
                r = chat(client, session, messages, final=turn == TURNS - 1)
                rec = {"session": session, "turn": turn, "status": r.status_code}
                if r.status_code == 200:
                    usage = r.json()["usage"]
                    rec.update(prompt=usage["prompt_tokens"], cached=cached_tokens(r))
                else:
                    rec["error"] = r.text[:300]
                records.append(rec)
                if r.status_code != 200:
                    return
                messages = next_turn(messages, seed, reply_words=30, tool_words=60)
                time.sleep(TOOL_S)

    started = time.monotonic()
    keys = LOAD_POLICY if policy == "program_aware" else ROUTER_POLICY
    with sluice(fleet, policy, **keys) as gw:
        with ThreadPoolExecutor(SESSIONS) as pool:
            list(pool.map(program, range(SESSIONS)))
        stats = gw.parts.admission.snapshot(with_programs=False).stats
    ok = [r for r in records if r["status"] == 200]
    reprefill = sum(r["prompt"] - r["cached"] for r in ok) - sum(r["prompt"] for r in ok if r["turn"] == 0)
    return {
        "policy": policy,
        "requests": len(records),
        "failed": [r for r in records if r["status"] != 200],
        "prompt_tokens": sum(r["prompt"] for r in ok),
        "cached_tokens": sum(r["cached"] for r in ok),
        "reprefill_tokens": reprefill,
        "max_prompt": max((r["prompt"] for r in ok), default=0),
        "pauses": stats["pauses"], "resumes": stats["resumes"], "held": stats["held"],
        "seconds": round(time.monotonic() - started, 1),
    }


def test_overload_program_aware_vs_kv_aware(fleet: Fleet):
    results = {policy: run_load(fleet, policy) for policy in ("program_aware", "kv_aware")}
    print("\n[e2e] overload:", json.dumps(results, indent=1))
    pa, kv = results["program_aware"], results["kv_aware"]
    for r in (pa, kv):
        assert r["failed"] == [], r["failed"]
        assert r["requests"] == SESSIONS * TURNS
    # more context than the two pools hold, at the peak
    assert SESSIONS * pa["max_prompt"] > 2 * CAPACITY_TOKENS
    assert pa["pauses"] > 0 and pa["resumes"] > 0  # program_aware made room by pausing
    assert kv["reprefill_tokens"] > pa["reprefill_tokens"]


# -- restarting a worker resets its index -----------------------------------------------------


def test_restarted_worker_resets_its_index(fleet: Fleet):
    worker = fleet.workers[-1]
    before = conversation("restart-before")
    after = conversation("restart-after")
    with sluice(fleet) as gw, httpx.Client(base_url=worker.url, timeout=60, trust_env=False) as direct:
        r = chat(direct, "restart-a", before)  # straight to the worker, past the gateway
        assert r.status_code == 200, r.text
        old = vllm_block_hashes(fleet.tokenize_chat(before, worker.name))
        wait_resident(gw, worker.name, old)  # fails fast without a subscriber
        fleet.restart(worker.name)
        r = chat(direct, "restart-b", after)
        assert r.status_code == 200, r.text
        new = vllm_block_hashes(fleet.tokenize_chat(after, worker.name))
        wait_resident(gw, worker.name, new)
        kv = gw.parts.admission.policy.index.worker(worker.name)
        assert kv.prefix_tokens(old) == 0, "the restarted engine's old blocks are still in the index"
        assert kv.prefix_tokens(new) == len(new) * BLOCK_SIZE
        # the plugin's publisher epoch told the restart apart (not only a seq going backwards)
        assert gw.parts.kv_events.stats[worker.name].resets.get("epoch_changed", 0) >= 1


# -- (c) a worker crashes mid-stream (last: it leaves that worker down) -------------------------


def test_worker_crash_mid_stream(fleet: Fleet):
    messages = conversation("crash-s3", system_words=40, user_words=10)
    with sluice(fleet) as gw, client_for(gw) as client:
        r = chat(client, "s3", messages)
        assert r.status_code == 200, r.text
        (victim,) = served_by(gw, "s3")
        survivor = next(w.name for w in fleet.workers if w.name != victim)

        turn2 = next_turn(messages, "crash-s3")
        body = {"model": MODEL_NAME, "messages": turn2, "max_tokens": 900, "ignore_eos": True,
                "stream": True, "temperature": 0}
        events: list[str] = []
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"x-session-id": "s3"}) as stream:
            assert stream.status_code == 200
            for line in stream.iter_lines():  # a clean end: no exception from the client
                if not line.startswith("data:"):
                    continue
                events.append(line[5:].strip())
                if len(events) == 5:
                    fleet.kill(victim)
        assert len(events) > 5
        assert events[-1] != "[DONE]"
        error = json.loads(events[-1])
        assert "error" in error and victim in error["error"]["message"], error
        assert "[DONE]" not in events

        wait_for(lambda: not gw.workers()[victim]["healthy"], timeout=10, what=f"{victim} marked down")
        wait_for(lambda: gw.programs()["s3"]["home_worker"] != victim, timeout=10,
                 what="program s3 re-homed")
        r3 = chat(client, "s3", next_turn(turn2, "crash-s3"))
        assert r3.status_code == 200, r3.text
        assert served_by(gw, "s3")[-1] == survivor
        assert gw.programs()["s3"]["home_worker"] == survivor
