"""``sluice demo``: the whole system on one machine, no GPU.

For each policy compared, from nothing: four simworkers (the engine model serving the OpenAI
API and vLLM-format KV events, time-scaled), the gateway in front of them, and a closed-loop
SWE-bench-style agent client at a concurrency that oversubscribes the fleet's KV (its agents
take turns speaking OpenAI chat completions, Anthropic Messages and OpenAI Responses). While it
runs, a line every few seconds shows each worker's utilization (the gateway's ledger) and
the programs by state; at the end, the same load's results under each policy side by side.
Every process is a real one (``sluice simworker``, ``sluice serve``) on loopback ports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import yaml

from entry.agent_client import APIS, AgentClient
from entry.ports import free_port, free_ports
from sim.step_time import DEFAULT_PRESET
from sim.workloads import LogNormal, SwebenchWorkload

ADMIN_TOKEN = "sluice-demo-admin-token"
DEFAULT_POLICIES = ("program_aware", "kv_aware")


@dataclass(frozen=True, slots=True)
class DemoSetup:
    workers: int = 4
    blocks: int = 512
    block_size: int = 16
    preset: str = DEFAULT_PRESET
    time_scale: float = 0.5
    concurrency: int = 32
    duration_s: float = 25.0
    drain_s: float = 10.0
    seed: int = 7
    report_every_s: float = 3.0
    # The demo's calls write ~64 tokens; the default reserve (512, sized for real agent
    # turns) would hold back a quarter of these small pools for calls in flight.
    growth_reserve_tokens: int = 128
    # The demo's prompts average 1.3k tokens, the SWE-bench workload's 22k (17.6×), and its
    # tool calls are a third longer (median 2.0 s vs 1.5 s); charging prompt tokens 20× keeps
    # a re-prefill's cost against a tool call where it is on an H100 (sim/step_time.py:
    # ~0.8 s for 22k tokens), so the demo shows what thrash costs on a GPU.
    prefill_scale: float = 20.0
    # more `sluice simworker` flags for every worker (e.g. --tool-call-turns for agent clients)
    simworker_args: tuple[str, ...] = ()

    @property
    def capacity_tokens(self) -> int:
        return (self.blocks - 1) * self.block_size

    def workload(self) -> SwebenchWorkload:
        """SWE-bench-shaped programs scaled down to the demo's small KV pools."""
        return SwebenchWorkload(
            seed=self.seed,
            shared_prefix_tokens=512,
            task_tokens=LogNormal(200, 0.5, 64, 1024),
            min_turns=6,
            max_turns=14,
            extra_turns=LogNormal(3, 0.8, 0, 100),
            output_tokens=LogNormal(64, 0.5, 16, 256),
            observation_tokens=LogNormal(150, 0.8, 16, 1024),
            tool_latency_s=LogNormal(2.0, 0.8, 0.2, 20.0),
            test_run_probability=0.05,
            test_run_latency_s=LogNormal(10.0, 0.5, 2.0, 30.0),
            max_context_tokens=self.capacity_tokens // 4,
        )


class Fleet:
    """The processes of one run; stopped (and their logs kept) on exit."""

    def __init__(self, setup: DemoSetup, policy: str, workdir: Path) -> None:
        self.setup = setup
        self.policy = policy
        self.workdir = workdir
        self.processes: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.gateway_url = ""

    def _spawn(self, name: str, args: list[str]) -> None:
        log = self.workdir / f"{self.policy}-{name}.log"
        handle = log.open("wb")
        process = subprocess.Popen([sys.executable, "-m", "entry.cli", *args],
                                   stdout=handle, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.processes.append((name, process, log))

    def start(self) -> None:
        setup = self.setup
        workers = []
        for i in range(setup.workers):
            port, events, directives = free_ports(3)
            self._spawn(f"w{i}", [
                "simworker", "--port", str(port), "--preset", setup.preset,
                "--blocks", str(setup.blocks), "--block-size", str(setup.block_size),
                "--kv-events", f"tcp://*:{events}", "--time-scale", str(setup.time_scale),
                "--prefill-scale", str(setup.prefill_scale),
                "--directives", f"tcp://*:{directives}",
                # a fixed port binds on every interface (vLLM's rule: only "*" binds); the
                # demo's sockets carry simulated sessions only, so no keys are made for it
                "--allow-insecure-bind",
                # the engine queue ordered by the policy's priority, as the simulator orders it
                "--scheduling-policy", "priority",
                "--name", f"w{i}", *setup.simworker_args,
            ])
            workers.append({"name": f"w{i}", "url": f"http://127.0.0.1:{port}",
                            "kv_events": f"tcp://127.0.0.1:{events}",
                            "directives": f"tcp://127.0.0.1:{directives}",
                            "scheduling_policy": "priority"})
        gateway_port = free_port()
        config = {
            "listen": {"host": "127.0.0.1", "port": gateway_port},
            "admin_token": ADMIN_TOKEN,
            "health_interval_s": 1.0,
            "capacity_retry_s": 0.5,
            "log_level": "warning",
            "workers": workers,
            "policy": {"name": self.policy, "growth_reserve_tokens": setup.growth_reserve_tokens},
        }
        path = self.workdir / f"{self.policy}-sluice.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self._spawn("gateway", ["serve", "--config", str(path)])
        self.gateway_url = f"http://127.0.0.1:{gateway_port}"
        self.worker_urls = [w["url"] for w in workers]

    def check_alive(self) -> None:
        for name, process, log in self.processes:
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.policy}: {name} exited with {process.returncode}:\n{tail}")

    def stop(self) -> None:
        for _, process, _ in self.processes:
            if process.poll() is None:
                process.terminate()
        for _, process, _ in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def wait_ready(fleet: Fleet, timeout_s: float = 60.0) -> None:
    """Until every worker answers and the gateway knows every worker's capacity."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(timeout=2.0) as http:
        while True:
            fleet.check_alive()
            try:
                for url in fleet.worker_urls:
                    (await http.get(f"{url}/health")).raise_for_status()
                response = await http.get(f"{fleet.gateway_url}/sluice/workers", headers=headers)
                response.raise_for_status()
                if all(w["capacity_tokens"] for w in response.json()["workers"]):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{fleet.policy}: the fleet did not come up within {timeout_s:.0f} s")
            await anyio.sleep(0.3)


async def _monitor(fleet: Fleet, started: float, emit: Callable[[str], None],
                   every_s: float, stop: anyio.Event, peaks: dict[str, float]) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=fleet.gateway_url, headers=headers, timeout=5.0) as http:
        while not stop.is_set():
            with anyio.move_on_after(every_s):
                await stop.wait()
            try:
                workers = (await http.get("/sluice/workers")).json()["workers"]
                programs = (await http.get("/sluice/programs")).json()["programs"]
            except (httpx.HTTPError, ValueError, KeyError) as err:
                emit(f"  (monitor: {type(err).__name__}: {err})")
                continue
            states = Counter(
                "paused" if p["lifecycle"] == "paused" else
                "queued" if p["lifecycle"] == "pending" else p["phase"]
                for p in programs
            )
            utils = []
            for worker in workers:
                u = worker["utilization"] or 0.0
                peaks[worker["name"]] = max(peaks.get(worker["name"], 0.0), u)
                utils.append(f"{worker['name']} {u:4.2f}")
            emit(f"  t={time.monotonic() - started:5.1f}s  U: {'  '.join(utils)}  |  "
                 f"reasoning {states['reasoning']:3d}  acting {states['acting']:3d}  "
                 f"paused {states['paused']:3d}  queued {states['queued']:3d}")


async def _gateway_counters(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=5.0) as http:
        text = (await http.get(f"{url}/metrics")).text
    wanted = {"sluice_pauses_total": "pauses", "sluice_resumes_total": "resumes",
              "sluice_marks_total": "marks", "sluice_holds_total": "holds"}
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[wanted[name]] = float(value)
    return found


async def _run_one(setup: DemoSetup, policy: str, workdir: Path, emit: Callable[[str], None]) -> dict[str, Any]:
    fleet = Fleet(setup, policy, workdir)
    fleet.start()
    try:
        await wait_ready(fleet)
        emit(f"\n== {policy}: {setup.workers} simworkers x {setup.capacity_tokens:,} tokens of KV, "
             f"{setup.concurrency} agents, {setup.duration_s:.0f} s + up to {setup.drain_s:.0f} s to finish "
             f"(time scale {setup.time_scale})")
        workload = setup.workload()
        client = AgentClient(fleet.gateway_url, workload.make_program, concurrency=setup.concurrency,
                             duration_s=setup.duration_s, drain_s=setup.drain_s,
                             time_scale=setup.time_scale, apis=APIS)
        stop = anyio.Event()
        peaks: dict[str, float] = {}
        started = time.monotonic()
        result = None

        async def play() -> None:
            nonlocal result
            result = await client.run()
            stop.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_monitor, fleet, started, emit, setup.report_every_s, stop, peaks)
            tasks.start_soon(play)
        assert result is not None
        emit(f"  agents by API: {_by_api(result.agents_by_api)}; calls answered: "
             f"{_by_api(result.calls_by_api)}")
        counters = await _gateway_counters(fleet.gateway_url)
        row = {"policy": policy, **result.summary(), **counters,
               "peak_utilization": {k: round(v, 3) for k, v in sorted(peaks.items())}}
        if result.error_samples:
            row["error_samples"] = result.error_samples
        return row
    finally:
        fleet.stop()


def _by_api(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{api} {counts.get(api, 0)}" for api in APIS)


def format_comparison(rows: list[dict[str, Any]]) -> list[str]:
    keys = [("output_tokens_per_s", "output tokens/s", "{:.0f}"), ("steps_per_min", "calls/min", "{:.0f}"),
            ("hit_rate", "prefix-cache hit rate", "{:.1%}"), ("p50_call_s", "call latency p50 (s)", "{:.2f}"),
            ("p99_call_s", "call latency p99 (s)", "{:.2f}"), ("calls", "calls completed", "{}"),
            ("errors", "failed calls", "{}"), ("pauses", "pauses", "{:.0f}"),
            ("resumes", "resumes", "{:.0f}"), ("holds", "calls held on arrival", "{:.0f}")]
    lines = ["", "summary (the same agents, fleet and duration under each policy):",
             f"  {'':<24}" + "".join(f"{row['policy']:>16}" for row in rows)]
    for key, label, fmt in keys:
        cells = "".join(f"{fmt.format(row.get(key, 0)):>16}" for row in rows)
        lines.append(f"  {label:<24}{cells}")
    cells = "".join(f"{'/'.join(str(row.get('agents_by_api', {}).get(api, 0)) for api in APIS):>16}"
                    for row in rows)
    lines.append(f"  {'agents chat/msg/resp':<24}{cells}")
    return lines


def run_demo(policies: tuple[str, ...], setup: DemoSetup, emit: Callable[[str], None],
             json_path: Path | None = None) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="sluice-demo-") as tmp:
        rows = [anyio.run(_run_one, setup, policy, Path(tmp), emit) for policy in policies]
    for line in format_comparison(rows):
        emit(line)
    if json_path is not None:
        payload = {"results": rows, "config": {
            "workers": setup.workers, "blocks": setup.blocks, "block_size": setup.block_size,
            "preset": setup.preset, "time_scale": setup.time_scale,
            "prefill_scale": setup.prefill_scale, "concurrency": setup.concurrency,
            "duration_s": setup.duration_s, "seed": setup.seed}}
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
        emit(f"\nwrote {json_path}")
    return rows
