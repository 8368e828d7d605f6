"""The real-clients tier: experiments/clients/run_clients.py as a user runs it (a
subprocess that starts simworkers and ``sluice serve``), the official ``openai`` and
``anthropic`` SDKs and ``litellm`` through the gateway. Skipped, saying which, only when a
library of the ``clients`` extra cannot be imported."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARIES = ("openai", "anthropic", "litellm")
# What each library's checks must report (a check that silently stopped running fails here).
EXPECTED_CHECKS = {"openai": 7, "anthropic": 4, "litellm": 4}


def test_the_openai_anthropic_and_litellm_clients_pass_every_check_through_the_gateway():
    missing = [name for name in LIBRARIES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"cannot import {', '.join(missing)}: install the clients extra "
                    "(pip install -e '.[clients]')")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "experiments.clients.run_clients"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    results = re.findall(r"^(PASS|FAIL) (\w+): ", done.stdout, re.MULTILINE)
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert done.returncode == 0 and not failed, output[-6000:]
    passed = {library: sum(1 for verdict, name in results if name == library and verdict == "PASS")
              for library in LIBRARIES}
    assert passed == EXPECTED_CHECKS, output[-6000:]
