"""ray_fleet's actor classes and agent program without Ray: the classes are plain (Ray wraps
them in ``start_gateway`` / ``start_simworker``), so here they run in this process on
loopback — a simworker actor's endpoint is what the gateway actor needs, the gateway serves
it at the URL it reports, and one agent program plays all its turns through it with the
openai SDK. tests/ray runs the same under Ray."""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from ray_fleet.actors import GatewayActor, SimWorkerActor, discover_endpoints
from ray_fleet.rollout import RolloutSetup, agent_programs, gateway_counts, play_agent_program

LOOPBACK = "127.0.0.1"


@pytest.fixture
def fleet():
    worker = SimWorkerActor("w0", {"num_blocks": 256, "time_scale": 0.05}, host=LOOPBACK)
    setup = RolloutSetup()
    gateway = GatewayActor(setup.gateway_config("program_aware", simulated=True),
                           [worker.endpoint()], host=LOOPBACK)
    try:
        yield worker, gateway
    finally:
        assert gateway.stop()
        assert worker.stop()


def test_the_simworker_actor_reports_every_socket_at_its_address_and_the_gateway_reads_them(fleet):
    worker, gateway = fleet
    endpoint = worker.endpoint()
    assert set(endpoint) == {"name", "url", "kv_events", "replay", "directives"}
    assert endpoint["url"].startswith(f"http://{LOOPBACK}:")
    assert all(endpoint[key].startswith(f"tcp://{LOOPBACK}:") for key in ("kv_events", "replay", "directives"))
    assert gateway.wait_ready(20.0) == {"w0": 4080}  # 256 blocks of 16, less the null block
    assert gateway.endpoints() == [endpoint]
    assert httpx.get(f"{gateway.url()}/health", timeout=5.0).status_code == 200


def test_one_agent_program_plays_every_turn_through_the_gateway_actor_with_the_openai_sdk(fleet):
    if importlib.util.find_spec("openai") is None:
        pytest.skip("cannot import openai: install the clients extra")
    _, gateway = fleet
    gateway.wait_ready(20.0)
    program = agent_programs(RolloutSetup(), 0)[0]
    outcome = play_agent_program(gateway.url(), program, model="sluice-sim", time_scale=0.01,
                                 client_retries=0, call_timeout_s=30.0)
    assert outcome.errors == [] and outcome.completed
    assert outcome.calls == len(program.turns)
    assert outcome.output_tokens == sum(turn.output_tokens for turn in program.turns)
    assert outcome.cached_tokens > 0  # each turn extends the last one's prompt
    counts = gateway_counts(httpx.get(f"{gateway.url()}/metrics", timeout=5.0).text)
    assert counts["chat_ok"] == outcome.calls and counts["other_answers"] == 0


def test_the_gateway_actor_sets_its_own_listen_address_and_workers():
    for key in ("listen", "workers"):
        with pytest.raises(ValueError, match=key):
            GatewayActor({key: {}}, [{"name": "w0", "url": "http://127.0.0.1:1"}], host=LOOPBACK)


def test_engine_names_must_be_distinct():
    with pytest.raises(ValueError, match="distinct"):
        discover_endpoints([{"name": "w0", "url": "http://a:1"}, {"name": "w0", "url": "http://b:1"}])


def test_a_step_is_tasks_times_samples_and_a_tasks_samples_share_its_prompt():
    setup = RolloutSetup(prompts=3, samples=4)
    programs = agent_programs(setup, 1)
    assert len(programs) == 12
    assert len({p.session_id for p in programs}) == 12
    assert agent_programs(setup, 1) == programs  # the same programs under every policy
    for task in range(3):
        group = programs[task * 4:(task + 1) * 4]
        assert len({(p.task_key, p.task_tokens) for p in group}) == 1
    assert len({p.task_key for p in programs}) == 3
    assert {p.session_id for p in programs}.isdisjoint(p.session_id for p in agent_programs(setup, 0))
    for program in programs:
        assert setup.min_turns <= len(program.turns) <= setup.max_turns
        first, *later = program.turns
        assert first.observation_tokens == 0 and first.tool_s == 0.0
        assert all(turn.observation_tokens > 0 and turn.tool_s > 0 for turn in later)
