"""The processes a soak starts: its simworkers and the gateway in front of them, each a
``sluice`` subprocess that can be killed, hung, restarted and drained; and the gateway's
answers about them (workers, metrics)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import yaml

from bench.soak.config import (
    ADMIN_HEADERS,
    ADMIN_TOKEN,
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    MAX_BODY_BYTES,
    SHUTDOWN_GRACE_S,
    SoakSetup,
)
from entry.ports import free_ports


class ManagedProcess:
    """One ``sluice`` subprocess that can be killed, hung and started again with the same
    arguments; its output is appended to one log across restarts."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name = name
        self.args = args
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        with self.log.open("ab") as handle:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "entry.cli", *self.args], stdout=handle,
                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.starts += 1

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    async def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status, or None if it is still running after ``timeout_s``."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                return None
            await anyio.sleep(0.1)
        return self.process.returncode

    def stop(self) -> None:
        """End it at the close of the run (a hung one is woken first so SIGTERM can land)."""
        if not self.alive():
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass(slots=True)
class SimWorker:
    name: str
    url: str
    process: ManagedProcess


class SoakFleet:
    """The simworkers and the gateway of one soak, with the gateway's config file (which the
    reload fault rewrites)."""

    def __init__(self, setup: SoakSetup, workdir: Path, logdir: Path) -> None:
        self.setup = setup
        self.workdir = workdir
        self.logdir = logdir
        self.workers: list[SimWorker] = []
        self.gateway: ManagedProcess | None = None
        self.gateway_url = ""
        self.config_path = workdir / "sluice.yaml"
        self.config: dict[str, Any] = {}
        self.reloads_written = 0

    def start(self) -> None:
        setup = self.setup
        worker_entries = []
        ports = free_ports(setup.workers + 1)
        for i in range(setup.workers):
            name, port = f"w{i}", ports[i]
            # ipc:// sockets in the run's private folder: no port to collide and nothing
            # bound beyond this machine's user
            kv_events = f"ipc://{self.workdir / f'{name}-kv'}"
            directives = f"ipc://{self.workdir / f'{name}-directives'}"
            args = ["simworker", "--port", str(port), "--name", name,
                    "--blocks", str(setup.blocks), "--block-size", str(setup.block_size),
                    "--time-scale", str(setup.time_scale), "--kv-events", kv_events,
                    "--directives", directives, "--scheduling-policy", "priority"]
            process = ManagedProcess(name, args, self.logdir / f"{name}.log")
            process.start()
            url = f"http://127.0.0.1:{port}"
            self.workers.append(SimWorker(name, url, process))
            worker_entries.append({"name": name, "url": url, "kv_events": kv_events,
                                   "directives": directives, "scheduling_policy": "priority"})
        gateway_port = ports[-1]
        self.config = {
            "listen": {"host": "127.0.0.1", "port": gateway_port},
            "admin_token": ADMIN_TOKEN,
            "admin_token_env": None,
            "health_interval_s": 1.0,
            "unhealthy_after": 2,
            "capacity_retry_s": 0.5,
            # the reload fault sends SIGHUP; polling stays on too, as in production
            "reload_poll_s": 2.0,
            "log_level": "warning",
            "max_body_bytes": MAX_BODY_BYTES,
            "shutdown_grace_s": SHUTDOWN_GRACE_S,
            "http": {"header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S},
            # a held call gets a 503 well before the client would call it lost
            "limits": {"max_hold_s": 120.0},
            "workers": worker_entries,
            "policy": {"name": "program_aware", "growth_reserve_tokens": 128,
                       "max_wait_s": setup.scaled_max_wait_s},
        }
        self._write_config()
        self.gateway = ManagedProcess("gateway", ["serve", "--config", str(self.config_path)],
                                      self.logdir / "gateway.log")
        self.gateway.start()
        self.gateway_url = f"http://127.0.0.1:{gateway_port}"

    def _write_config(self) -> None:
        # written aside and renamed, so the gateway's poll never reads half a file
        scratch = self.config_path.with_suffix(".tmp")
        scratch.write_text(yaml.safe_dump(self.config, sort_keys=False))
        scratch.replace(self.config_path)

    def rewrite_policy(self) -> float:
        """Flip a policy threshold (the hot-reloadable section); the new max_wait_s."""
        self.reloads_written += 1
        full = self.setup.scaled_max_wait_s
        max_wait = full if self.reloads_written % 2 == 0 else round(full * 5 / 6, 3)
        self.config["policy"]["max_wait_s"] = max_wait
        self._write_config()
        return max_wait

    def check_alive(self) -> None:
        assert self.gateway is not None
        if not self.gateway.alive():
            tail = self.gateway.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the gateway exited during the soak:\n{tail}")

    def stop(self) -> None:
        for worker in self.workers:
            worker.process.stop()
        if self.gateway is not None:
            self.gateway.stop()


async def wait_healthy(url: str, timeout_s: float) -> float:
    """Seconds until ``url``/health answers 200."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=2.0) as http:
        while True:
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass  # not up yet: that is what is being waited for
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"{url} did not answer /health within {timeout_s:.0f} s")
            await anyio.sleep(0.2)


async def gateway_workers(http: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    response = await http.get("/sluice/workers", headers=ADMIN_HEADERS)
    response.raise_for_status()
    return {w["name"]: w for w in response.json()["workers"]}


async def wait_gateway_sees(http: httpx.AsyncClient, name: str, healthy: bool,
                            timeout_s: float) -> float | None:
    """Seconds until the gateway reports worker ``name`` healthy (or down); None: not within
    ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if (await gateway_workers(http)).get(name, {}).get("healthy") == healthy:
            return round(time.monotonic() - started, 2)
        await anyio.sleep(0.25)
    return None


async def wait_fleet_ready(fleet: SoakFleet, timeout_s: float = 90.0) -> None:
    for worker in fleet.workers:
        await wait_healthy(worker.url, timeout_s)
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=2.0) as http:
        while True:
            fleet.check_alive()
            try:
                workers = await gateway_workers(http)
                if workers and all(w["capacity_tokens"] and w["healthy"] for w in workers.values()):
                    return
            except httpx.HTTPError:
                pass  # the gateway is still starting
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not see every worker within {timeout_s:.0f} s")
            await anyio.sleep(0.3)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {name{labels}: value}."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue  # a line this reader does not need (no plain value at its end)
    return values


async def drain_gateway(fleet: SoakFleet) -> dict[str, Any]:
    assert fleet.gateway is not None
    started = time.monotonic()
    fleet.gateway.signal(signal.SIGTERM)
    status = await fleet.gateway.wait_exit(SHUTDOWN_GRACE_S + 30)
    result: dict[str, Any] = {"exit_status": status, "drain_s": round(time.monotonic() - started, 2)}
    if status is None:
        result["note"] = "still running after the grace; killed"
        fleet.gateway.signal(signal.SIGKILL)
        await fleet.gateway.wait_exit(10)
    log = fleet.gateway.log.read_text(errors="replace")
    result["log_tracebacks"] = log.count("Traceback")
    levels: Counter[str] = Counter()
    events: Counter[str] = Counter()
    for line in log.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # uvicorn's own plain lines
        if isinstance(entry, dict):
            levels[str(entry.get("level"))] += 1
            if entry.get("level") in ("error", "critical"):
                events[str(entry.get("event"))[:120]] += 1
    result["log_lines_by_level"] = dict(levels)
    result["log_error_events"] = dict(events.most_common(20))
    return result
