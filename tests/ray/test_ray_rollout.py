"""The Ray tier: ray_fleet's rollout example as a user runs it (``python -m ray_fleet.rollout``
in a subprocess, which starts a local Ray on loopback, ``ray.init(_node_ip_address="127.0.0.1")``), the gateway and simworkers as
Ray actors and the agent programs as Ray tasks; and a gateway actor restarted by Ray. Skipped,
saying why, only when ``ray`` cannot be imported (``make test`` installs the ``ray`` extra
where a wheel exists)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("program_aware", "least_loaded")
STEPS = 2

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="cannot import ray: install the ray extra (pip install -e '.[ray]') to run the Ray tier")


def _env() -> dict[str, str]:
    # The repository on the path of the driver and so of the Ray workers it starts (they
    # import ray_fleet's task functions by name).
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def test_the_rollout_example_reports_per_step_throughput_and_makespan_for_both_policies(tmp_path):
    report_path = tmp_path / "rollout.json"
    done = subprocess.run(
        [sys.executable, "-m", "ray_fleet.rollout", "--policies", ",".join(POLICIES),
         "--steps", str(STEPS), "--prompts", "4", "--samples", "4", "--json", str(report_path)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]

    # What a user reads: a section per policy with one line per step, then the comparison.
    for policy in POLICIES:
        section = done.stdout.split(f"== {policy}:", 1)
        assert len(section) == 2, f"no section for {policy}:\n{done.stdout[-4000:]}"
        steps = re.findall(r"^  step (\d+)/\d+: makespan +([\d.]+) s +rollout +([\d.]+) output tokens/s",
                           section[1], re.MULTILINE)[:STEPS]
        assert [int(step) for step, _, _ in steps] == list(range(1, STEPS + 1)), done.stdout[-4000:]
        assert all(float(makespan) > 0 and float(rate) > 0 for _, makespan, rate in steps)
    assert re.search(r"^  rollout output tokens/s +[\d.]+ +[\d.]+$", done.stdout, re.MULTILINE), done.stdout

    results = {result["policy"]: result for result in json.loads(report_path.read_text())["results"]}
    assert set(results) == set(POLICIES)
    for policy, result in results.items():
        steps = result["steps"]
        assert len(steps) == STEPS
        for step in steps:
            assert step["failed_calls"] == 0, result["error_samples"]
            assert step["completed_programs"] == step["programs"] == 16
            assert step["makespan_s"] > 0 and step["output_tokens_per_s"] > 0
            assert step["calls"] >= 3 * step["programs"]  # every program plays ≥ 3 turns
        calls = sum(step["calls"] for step in steps)
        # The gateway actor's own /metrics counted every call the programs made, and nothing else.
        assert result["gateway_metrics"]["chat_ok"] == calls, (policy, result["gateway_metrics"])
        assert result["gateway_metrics"]["other_answers"] == 0, (policy, result["gateway_metrics"])
    # The same programs under each policy: the same calls and output tokens.
    totals = {policy: [(s["calls"], s["output_tokens"]) for s in result["steps"]]
              for policy, result in results.items()}
    assert totals[POLICIES[0]] == totals[POLICIES[1]], totals


def _chat(url: str, session: str) -> int:
    import httpx

    body = {"model": "sluice-sim", "messages": [{"role": "user", "content": "list the files"}],
            "max_tokens": 8}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": session},
                      timeout=30.0).status_code


def _answered(url: str) -> float:
    import httpx

    from ray_fleet.rollout import gateway_counts

    return gateway_counts(httpx.get(f"{url}/metrics", timeout=10.0).text)["chat_ok"]


def test_ray_restarts_a_dead_gateway_actor_which_starts_fresh_and_reports_its_new_url():
    import ray

    from ray_fleet.actors import NODE_ADDRESS_ENV, start_gateway, start_simworker

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": _env()["PYTHONPATH"],
                                       NODE_ADDRESS_ENV: "127.0.0.1"}})
    try:
        worker = start_simworker("w0", {"num_blocks": 128, "time_scale": 0.1})
        config = {"admin_token_env": None, "health_interval_s": 1.0, "capacity_retry_s": 0.2,
                  "reload_poll_s": 0, "log_level": "warning", "shutdown_grace_s": 1.0}
        gateway = start_gateway(config, [worker], max_restarts=1)
        ray.get(gateway.wait_ready.remote(30.0))
        first_url = ray.get(gateway.url.remote())
        assert _chat(first_url, "agent-1") == 200
        assert _answered(first_url) == 1

        ray.kill(gateway, no_restart=False)  # as if its process died: Ray starts it again

        ray.get(gateway.wait_ready.remote(30.0), timeout=120)
        second_url = ray.get(gateway.url.remote())
        # A new process: its metrics start over; the same program continues from its session id.
        assert _answered(second_url) == 0
        assert _chat(second_url, "agent-1") == 200
        assert _answered(second_url) == 1
        assert ray.get(gateway.endpoints.remote()) == [ray.get(worker.endpoint.remote())]
        ray.get([gateway.stop.remote(), worker.stop.remote()])
    finally:
        ray.shutdown()
