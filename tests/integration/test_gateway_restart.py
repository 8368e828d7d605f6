"""A gateway that restarts rebuilds what it can observe (docs/architecture.md §8, "When a node dies").

Two simworkers publish KV events (with a replay socket) and run a few agent programs behind
a first gateway, which then stops. A second gateway, fresh, starts on the same workers: it
has no programs and no held calls, but its KV index is caught up from each worker's replay
socket before any call (the workers publish nothing meanwhile: every call they had came
through the first gateway), and each program's next call goes to the worker that still
holds its KV and is served from its cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from simworker.worker import SimWorkerConfig
from simworker.worker import create_app as create_simworker
from tests.support.gateway_harness import ServerThread, gateway, serve_config, wait_for

pytestmark = pytest.mark.slow

PROGRAMS = [f"agent-{i}" for i in range(8)]


@contextmanager
def fleet() -> Iterator[list[dict]]:
    """Two simworkers with KV events, replay and directives; their gateway entries."""
    with ExitStack() as stack:
        entries = []
        for i in range(2):
            app = create_simworker(SimWorkerConfig(
                name=f"sim{i}", num_blocks=1024, block_size=16, kv_events="tcp://127.0.0.1:*",
                replay="tcp://127.0.0.1:*", directives="tcp://127.0.0.1:*", time_scale=0.01,
                default_max_tokens=16, sampling_seed=i))
            server = ServerThread(app).start()
            stack.callback(server.stop)
            worker = app.state.worker
            entries.append({"name": f"sim{i}", "url": server.url, "kv_events": worker.kv_endpoint,
                            "replay": worker.replay_endpoint,
                            "directives": worker.directives.bound_endpoint})
        yield entries


def conversation(program: str, turns: int) -> list[dict]:
    """A program's conversation after ``turns`` turns: its own long system prompt (so its KV is
    its own), then user and assistant turns."""
    messages = [{"role": "system", "content": f"You are agent {program}, working on task "
                                              f"{program}. " * 60}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"step {turn}: run the tests of {program}"})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"ran step {turn} for {program}"})
    return messages


def turn(gw, program: str, turns: int) -> dict:
    answer = gw.client.post("/v1/chat/completions", headers={"x-session-id": program}, json={
        "model": "sluice-sim", "max_tokens": 16, "messages": conversation(program, turns)})
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]


def first_gateway_run(config) -> dict[str, str]:
    """A first gateway runs one turn of each program, then stops: each program's home."""
    with gateway(config) as first:
        for program in PROGRAMS:
            turn(first, program, 1)
        return {program: view["home_worker"] for program, view in first.programs().items()}


def test_a_restarted_gateway_sends_each_program_back_to_the_worker_holding_its_kv():
    with fleet() as entries:
        config = serve_config(entries, capacity_retry_s=0.05)
        homes = first_gateway_run(config)
        # the first gateway's programs were spread over both workers, or the test shows nothing
        assert set(homes) == set(PROGRAMS) and set(homes.values()) == {"sim0", "sim1"}, homes

        with gateway(config) as second:
            assert second.programs() == {}  # a new process: no programs, no held calls
            index = second.parts.admission.policy.index

            def caught_up() -> bool:
                return all(index.session_tokens(homes[p], p) > 0 for p in PROGRAMS)

            wait_for(caught_up, timeout=20, what="the second gateway's index caught up by replay")
            for program in PROGRAMS:
                usage = turn(second, program, 2)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                assert second.programs()[program]["home_worker"] == homes[program], program
                # the system prompt's blocks at least came from the worker's cache
                assert cached >= 512, (program, usage)
