"""Agent frameworks without program identity through the gateway: the openai-agents
SDK, mini-swe-agent and litellm, unchanged, each run twice at once on one task against
simworkers that answer with tool calls, as experiments/clients/run_agents.py does it (a
subprocess that starts the simworkers and ``sluice serve``). Two runs of one task must be two
programs, and each run's turns one program. Skipped, saying which, only when a framework of the
``clients`` extra cannot be imported."""

from __future__ import annotations

from tests.support.client_scripts import passed_checks, skip_unless_importable

FRAMEWORKS = {"agents": "agents", "mini-swe-agent": "minisweagent", "litellm": "litellm"}
EXPECTED_CHECKS = {"agents": 2, "mini-swe-agent": 1, "litellm": 2}


def test_two_runs_of_one_task_are_two_programs_and_each_runs_turns_one():
    skip_unless_importable(FRAMEWORKS)
    passed = passed_checks("experiments.clients.run_agents", list(FRAMEWORKS), timeout_s=400)
    assert passed == EXPECTED_CHECKS
