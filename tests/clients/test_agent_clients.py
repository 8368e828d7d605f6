"""Agent frameworks without program identity through the gateway (issue 19): the openai-agents
SDK, mini-swe-agent and litellm, unchanged, each run twice at once on one task against
simworkers that answer with tool calls, as experiments/clients/run_agents.py does it (a
subprocess that starts the simworkers and ``sluice serve``). Two runs of one task must be two
programs, and each run's turns one program. Skipped, saying which, only when a framework of the
``clients`` extra cannot be imported."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FRAMEWORKS = {"agents": "agents", "mini-swe-agent": "minisweagent", "litellm": "litellm"}
EXPECTED_CHECKS = {"agents": 2, "mini-swe-agent": 1, "litellm": 2}


def test_two_runs_of_one_task_are_two_programs_and_each_runs_turns_one():
    missing = [name for name, module in FRAMEWORKS.items() if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"cannot import {', '.join(missing)}: install the clients extra "
                    "(pip install -e '.[clients]')")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "experiments.clients.run_agents"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    output = done.stdout + done.stderr
    results = re.findall(r"^(PASS|FAIL) ([\w-]+): ", done.stdout, re.MULTILINE)
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert done.returncode == 0 and not failed, output[-6000:]
    passed = {name: sum(1 for verdict, lib in results if lib == name and verdict == "PASS")
              for name in FRAMEWORKS}
    assert passed == EXPECTED_CHECKS, output[-6000:]
