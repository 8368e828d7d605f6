"""The simworker is as strict and as lenient as vLLM 0.32: one corpus of
requests (tests/support/conformance_corpus.py) sent to a simworker and to a real vLLM CPU
worker (the tiny model), compared on status, error envelope, error type and param, and the
kind of a successful answer.

vLLM starts once for this module, with the flags an agent deployment uses
(``--enable-auto-tool-choice --tool-call-parser hermes``), beside a simworker that serves the
same model name, model length and block size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from simworker.worker import SimWorkerConfig, create_app
from tests.support.conformance_corpus import CASES, DIFFERENCES, MAX_MODEL_LEN, MODEL_NAME, Case
from tests.support.gateway_harness import ServerThread
from tests.support.vllm_fleet import BLOCK_SIZE, NUM_BLOCKS, Fleet, VllmWorker

pytestmark = pytest.mark.e2e

# What an agent deployment adds to the e2e fleet's flags: tool calls parsed from the output.
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
REQUEST_TIMEOUT_S = 60.0


class ToolCallingFleet(Fleet):
    """The e2e fleet's vLLM command (tests/support/vllm_fleet.py) with TOOL_FLAGS."""

    def command(self, worker: VllmWorker) -> list[str]:
        return [*super().command(worker), *TOOL_FLAGS]


@pytest.fixture(scope="module")
def vllm_url(vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    fleet = ToolCallingFleet(vllm_python, tiny_model, tmp_path_factory.mktemp("vllm-conformance"))
    try:
        try:
            fleet.start(["conformance"])
        except RuntimeError as err:
            pytest.fail(str(err), pytrace=False)
        yield fleet.workers[0].url
    finally:
        fleet.stop_all()


@pytest.fixture(scope="module")
def simworker_url() -> Iterator[str]:
    config = SimWorkerConfig(name="conformance", model=MODEL_NAME, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                             max_model_len=MAX_MODEL_LEN, kv_events=None, time_scale=0.01,
                             default_max_tokens=8)
    server = ServerThread(create_app(config)).start()
    try:
        yield server.url
    finally:
        server.stop()


@dataclass(frozen=True)
class Answer:
    """What the comparison looks at in one answer."""

    status: int
    envelope: str | None = None        # "openai" or "anthropic" for an error
    error_keys: tuple[str, ...] = ()
    error_type: str | None = None
    param: str | None = None
    success: str | None = None         # for a 200: the answer's kind
    text: str = ""                     # for the failure message only

    def comparable(self, with_param: bool) -> tuple[Any, ...]:
        return (self.status, self.envelope, self.error_keys, self.error_type,
                self.param if with_param else None, self.success)


def _success_kind(response: httpx.Response, body: bytes) -> str:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [block for block in body.decode().split("\n\n") if block.strip()]
        names = []
        for block in events:
            lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
            if "event" in lines:
                names.append(lines["event"])
            else:
                data = lines.get("data", "")
                names.append("[DONE]" if data == "[DONE]" else json.loads(data).get("object", "?"))
        return f"stream {names[0]} … {names[-1]}" if names else "empty stream"
    payload = json.loads(body)
    return f"json {payload.get('object') or payload.get('type') or sorted(payload)}"


def ask(client: httpx.Client, base_url: str, case: Case) -> Answer:
    headers = {"content-type": case.content_type}
    content = case.raw if case.raw is not None else json.dumps(case.body).encode()
    with client.stream("POST", base_url + case.path, content=content, headers=headers) as response:
        body = response.read()
    text = body.decode(errors="replace")[:600]
    if response.status_code == 200:
        return Answer(200, success=_success_kind(response, body), text=text)
    try:
        payload = json.loads(body)
    except ValueError:
        return Answer(response.status_code, envelope="not JSON", text=text)
    if payload.get("type") == "error" and isinstance(payload.get("error"), dict):
        error = payload["error"]
        return Answer(response.status_code, "anthropic", tuple(sorted(error)), error.get("type"), None, text=text)
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return Answer(response.status_code, "openai", tuple(sorted(error)), error.get("type"), error.get("param"),
                      text=text)
    if isinstance(payload, dict) and set(payload) == {"detail"}:  # Starlette's own, for a route that is not there
        return Answer(response.status_code, "starlette", error_type=str(payload["detail"]), text=text)
    return Answer(response.status_code, f"unknown envelope {sorted(payload) if isinstance(payload, dict) else payload}",
                  text=text)


def test_the_simworker_answers_the_corpus_as_vllm_does(vllm_url, simworker_url):
    mismatches = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        for case in CASES:
            real, sim = ask(client, vllm_url, case), ask(client, simworker_url, case)
            if real.comparable(case.compare_param) != sim.comparable(case.compare_param):
                mismatches.append(f"{case.name} ({case.path}):\n  vLLM      {real.comparable(True)}\n"
                                  f"            {real.text[:300]!r}\n  simworker {sim.comparable(True)}\n"
                                  f"            {sim.text[:300]!r}")
    assert not mismatches, f"{len(mismatches)} of {len(CASES)} requests answered differently:\n" + \
        "\n".join(mismatches)


def test_the_documented_differences_hold(vllm_url, simworker_url):
    """Each departure is still what the corpus says; if vLLM or the simworker changes, the
    difference (and the docs that list it) must be revisited."""
    observed = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        for difference in DIFFERENCES:
            real = ask(client, vllm_url, difference.case)
            sim = ask(client, simworker_url, difference.case)
            observed.append((difference.case.name, real.status, sim.status))
    assert observed == [(d.case.name, d.vllm_status, d.simworker_status) for d in DIFFERENCES]
