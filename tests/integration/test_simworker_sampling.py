"""Sampling as vLLM samples (simworker/worker.py): without a seed, at a temperature above 0
(the default), identical prompts get different replies; with a ``seed`` or ``temperature``
0 the reply is fixed by the prompt, on every API; a worker's ``sampling_seed`` makes its
whole run reproducible."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from simworker.worker import SimWorkerConfig, create_app
from tests.support.gateway_harness import ServerThread

MODEL = "sluice-sim"
TRIES = 5  # five identical unseeded calls all starting the filler at the same word: p ≈ 4e-8


def serve(**settings) -> ServerThread:
    config = SimWorkerConfig(**{"name": "sampling", "num_blocks": 300, "block_size": 16, "kv_events": None,
                                "time_scale": 0.01, "default_max_tokens": 12, **settings})
    return ServerThread(create_app(config)).start()


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    server = serve()
    try:
        yield server.url
    finally:
        server.stop()


def reply(url: str, api: str, prompt: str, **fields) -> str:
    if api == "chat":
        body = httpx.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, **fields},
            timeout=30).json()
        return body["choices"][0]["message"]["content"]
    if api == "completions":
        body = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, **fields}, timeout=30).json()
        return body["choices"][0]["text"]
    if api == "messages":
        fields.pop("seed", None)  # the Messages API has no seed
        body = httpx.post(f"{url}/v1/messages", json={
            "model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": prompt}], **fields},
            timeout=30).json()
        return body["content"][0]["text"]
    body = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": prompt, **fields}, timeout=30).json()
    return body["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("api", ["chat", "completions", "messages", "responses"])
def test_identical_prompts_get_different_replies_without_a_seed(url, api):
    replies = {reply(url, api, f"Same prompt ({api}).") for _ in range(TRIES)}
    assert len(replies) > 1


@pytest.mark.parametrize("api", ["chat", "completions", "messages", "responses"])
def test_greedy_decoding_repeats_itself(url, api):
    replies = {reply(url, api, f"Greedy prompt ({api}).", temperature=0) for _ in range(3)}
    assert len(replies) == 1


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
def test_a_seed_repeats_the_reply_and_another_seed_changes_it(url, api):
    prompt = f"Seeded prompt ({api})."
    assert len({reply(url, api, prompt, seed=42, temperature=0.8) for _ in range(3)}) == 1
    assert len({reply(url, api, prompt, seed=seed) for seed in range(TRIES)}) > 1


def test_a_workers_sampling_seed_makes_its_run_reproducible():
    runs = []
    for _ in range(2):
        server = serve(sampling_seed=1234)
        try:
            runs.append([reply(server.url, "chat", "Unseeded call.") for _ in range(3)])
        finally:
            server.stop()
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
