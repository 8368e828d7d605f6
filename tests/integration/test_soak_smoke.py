"""A minute of `make soak`: real simworkers and a real gateway, a few agent sessions, a worker
killed and started again, then a config reload. No call may be lost, and after the sessions
stop nothing may be held or in flight and the gateway must drain cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak.config import SoakSetup
from bench.soak.run import run_soak

pytestmark = pytest.mark.slow


def test_mini_soak_loses_no_call_and_leaves_nothing_held(tmp_path: Path) -> None:
    setup = SoakSetup(duration_s=75.0, sessions=6, workers=2, fault_every_s=25.0,
                      faults=("worker_kill", "gateway_reload"), call_timeout_s=120.0)
    lines: list[str] = []
    summary = run_soak(setup, tmp_path, emit=lines.append)
    progress = "\n".join(lines)

    calls = summary["calls"]
    assert calls["succeeded"] > 0, progress
    assert calls["lost"] == 0, calls
    assert calls["unclear"] == 0, calls

    kinds = [fault["kind"] for fault in summary["faults"]]
    assert kinds == ["worker_kill", "gateway_reload"], summary["faults"]
    kill, reload = summary["faults"]
    assert kill["gateway_saw_healthy_after_s"] is not None, kill
    assert reload["reloads_applied"] >= 1, reload

    before = summary["before_drain"]
    assert before["settled"], before
    assert before["calls_held"] == 0 and before["calls_in_flight"] == 0, before
    assert not any(before["worker_calls_in_flight"].values()), before

    drain = summary["drain"]
    assert drain["exit_status"] == 0, drain
    assert drain["log_tracebacks"] == 0, drain
    for name in ("summary.json", "summary.md", "rss.csv", "gateway.log"):
        assert (tmp_path / name).is_file(), name
