"""What the sharded-gateway tiers share (nginx in tests/integration/test_proxy_shards.py, Ray
Serve in tests/ray/test_serve_shards.py): the simworkers of a shard, and the programs sent
through the ingress — plain sessions, sub-agents that name their parent, and Claude Code runs
of two agents — with the headers of each call."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import httpx

from simworker.worker import SimWorkerConfig
from simworker.worker import create_app as create_simworker
from tests.support.gateway_harness import ServerThread

ROOTS = [f"prog-{i:02d}" for i in range(48)]
CHILDREN = {f"child-{i:02d}": f"prog-{i:02d}" for i in range(8)}
CLAUDE_RUNS = [f"claude-run-{i}" for i in range(8)]


def program_headers() -> dict[str, list[dict[str, str]]]:
    """Each shard key (a root) with the headers of every call made under it."""
    calls: dict[str, list[dict[str, str]]] = {root: [{"x-session-id": root}] * 3 for root in ROOTS}
    for child, parent in CHILDREN.items():
        calls[parent] += [{"x-session-id": child, "x-parent-session-id": parent}] * 2
    for run in CLAUDE_RUNS:
        calls[run] = [{"x-claude-code-session-id": run},
                      {"x-claude-code-session-id": run, "x-claude-code-agent-id": f"{run}-agent"}] * 2
    return calls


def root_headers() -> dict[str, dict[str, str]]:
    """The headers of one call of each root program."""
    headers = {root: {"x-session-id": root} for root in ROOTS}
    headers.update({run: {"x-claude-code-session-id": run} for run in CLAUDE_RUNS})
    return headers


def call(client: httpx.Client, headers: dict[str, str], stream: bool = False,
         max_tokens: int = 4) -> httpx.Response:
    body = {"model": "sluice-sim", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": f"a turn of {sorted(headers.items())}"}]}
    return client.post("/v1/chat/completions", json=body, headers=headers)


def simworker_entries(stack: ExitStack, names: list[str], time_scale: float = 0.002) -> list[dict[str, Any]]:
    """Simworkers on loopback (stopped when ``stack`` closes), as the gateway's worker entries."""
    entries = []
    for i, name in enumerate(names):
        app = create_simworker(SimWorkerConfig(
            name=name, num_blocks=512, block_size=16, kv_events=None,
            directives="tcp://127.0.0.1:*", time_scale=time_scale, max_model_len=4096,
            default_max_tokens=4, sampling_seed=i))
        server = ServerThread(app).start()
        stack.callback(server.stop)
        entries.append({"name": name, "url": server.url, "capacity_tokens": 8192,
                        "directives": app.state.worker.directives.bound_endpoint})
    return entries


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def send_every_call(client: httpx.Client, calls: Mapping[str, list[dict[str, str]]]) -> None:
    """Every call of :func:`program_headers`, then one streamed call of the first root; each
    must be answered in full."""
    for key, headers_list in calls.items():
        for headers in headers_list:
            answer = call(client, headers)
            assert answer.status_code == 200, (key, answer.status_code, answer.text[:300])
    streamed = call(client, {"x-session-id": ROOTS[0]}, stream=True)
    assert streamed.status_code == 200, streamed.text[:300]
    assert streamed.text.rstrip().endswith("data: [DONE]"), streamed.text[-300:]


def assert_held_by_owners(held: Mapping[Any, set[str]] | Sequence[set[str]], owner: Mapping[str, Any]) -> None:
    """Each program lives on its root's owner (``held[owner[root]]``), a sub-agent with its
    parent, a Claude Code run's agents with the run, and no program on two shards."""
    for root in ROOTS:
        assert root in held[owner[root]], (root, owner[root])
    for child, parent in CHILDREN.items():
        assert child in held[owner[parent]], (child, parent)
    for run in CLAUDE_RUNS:  # the run's main agent and its sub-agent (a program of its own)
        assert {run, f"{run}-agent"} <= held[owner[run]], (run, owner[run])
    shards = list(held.values()) if isinstance(held, Mapping) else list(held)
    for i, one in enumerate(shards):
        for other in shards[i + 1:]:
            assert not one & other, f"programs on two shards: {one & other}"
