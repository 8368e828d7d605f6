"""``sluice top --once`` against a running gateway: one screen with the workers, the programs
by state and the largest programs, read through the admin API; a wrong token is a clear
error, not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.gateway_harness import ADMIN_TOKEN, chat, fakes, gateway, serve_config

REPO = Path(__file__).resolve().parents[2]


def _top(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "entry.cli", "top", "--url", url, "--once", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)


def test_top_once_shows_workers_programs_and_held_calls():
    with fakes("w0", "w1") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 100_000} for f, s in started]
        with gateway(serve_config(workers)) as gw:
            for session in ("alpha", "beta"):
                gw.client.post("/v1/chat/completions", json=chat(), headers={"x-session-id": session})
            shown = _top(gw.url, "--token", ADMIN_TOKEN)
    assert shown.returncode == 0, shown.stderr
    screen = shown.stdout
    assert "w0" in screen and "w1" in screen and "up" in screen
    assert "programs 2: active+acting 2" in screen
    assert "calls held 0" in screen and "200: 2" in screen
    assert "alpha" in screen and "beta" in screen


def test_top_with_a_wrong_token_says_so_and_exits_2():
    with fakes("w0") as started:
        _, server = started[0]
        with gateway(serve_config([{"name": "w0", "url": server.url, "capacity_tokens": 1000}])) as gw:
            shown = _top(gw.url, "--token", "not-the-token")
    assert shown.returncode == 2
    assert "refused the admin token" in shown.stderr and "Traceback" not in shown.stderr
