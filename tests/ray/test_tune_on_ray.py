"""``sluice tune --executor ray``: the trials run as Ray tasks (a local Ray here) and the
study is the one the local processes find."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the `ray` extra is not installed: the Ray tier is skipped")

REPO = Path(__file__).resolve().parents[2]
COMMON = ("tune", "--workload", "swebench", "--concurrency", "16", "--duration", "60",
          "--trials", "3", "--workers", "2", "--batch", "2", "--jobs", "2")


def _tune(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "entry.cli", *COMMON, *extra,
                          "--out", str(tmp_path / f"{name}.yaml"),
                          "--json", str(tmp_path / f"{name}.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp_path / f"{name}.json").read_text())["trials"]


def test_trials_on_ray_tasks_give_the_same_study_as_local_processes(tmp_path):
    assert _tune(tmp_path, "ray", "--executor", "ray") == _tune(tmp_path, "local")
