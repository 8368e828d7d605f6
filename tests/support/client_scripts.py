"""Running an experiments/clients script as a user runs it (a subprocess that starts its own
simworkers and ``sluice serve``) and reading its PASS/FAIL lines, for tests/clients."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def skip_unless_importable(modules: dict[str, str]) -> None:
    """Skip, naming them, when a library of the ``clients`` extra cannot be imported."""
    missing = [name for name, module in modules.items() if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"cannot import {', '.join(missing)}: install the clients extra "
                    "(pip install -e '.[clients]')")


def passed_checks(script: str, names: list[str], timeout_s: float) -> dict[str, int]:
    """Run ``python -m <script>``; fail with its output unless it exits 0 with no FAIL line;
    the PASS lines it printed, per name."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    output = done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert done.returncode == 0 and not failed, output[-6000:]
    results = re.findall(r"^PASS ([\w-]+): ", done.stdout, re.MULTILINE)
    return {name: results.count(name) for name in names}
