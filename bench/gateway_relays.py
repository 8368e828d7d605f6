"""``sluice serve --relays 2`` against ``--relays 1``: requests per second and CPU per request
(run by ``python -m bench`` right after bench/gateway.py, whose module docstring has the setup).

The same fast upstream, gateway config and non-streaming load as ``gateway_req_per_s``
(``THROUGHPUT_CLIENTS`` closed-loop clients, each its own ``x-session-id``; a warm-up, then a
fixed window), but **nothing is pinned**: every gateway process, the upstream and the load
generator may run on every CPU, the same for both configurations. Pinning the gateway to one
core, as bench/gateway.py does, would leave a relay group nothing to gain; giving the group the
load generator's cores would starve the load instead. So on a 2-CPU machine the gateway, the
upstream and the load generator share both CPUs, and the figures say what ``--relays 2`` buys
there, not what it buys with cores to spare.

A fresh gateway is started for each round (``python -m entry.cli serve --relays N``, in its
own process group), waited on until ``/health`` answers and as many sockets listen on its port
as it has relays (``/proc/net/tcp``: the load's connections are opened only then, so the
kernel spreads them over every relay), measured, then stopped with SIGTERM; an exit status
other than 0 aborts the benchmark, and whatever is left of its process group is killed. The
rounds alternate A B B A (``--relays 1``, ``2``, ``2``, ``1``; twice over in the full run), so
a machine that gets busier or quieter during the run weighs on both alike.

- ``gateway_relays1_req_per_s`` / ``gateway_relays2_req_per_s`` — completed requests per
  second in the window, the median over the configuration's rounds (with two rounds: their
  mean).
- ``gateway_relays2_speedup`` — the ratio of those two medians.
- ``gateway_relays1_cpu_us_per_request`` / ``gateway_relays2_cpu_us_per_request`` — user +
  system CPU over the window (``/proc/PID/stat``) of every process of the gateway — for
  ``--relays 2`` the supervisor, the policy process, both relays and any other child
  (multiprocessing's resource tracker) — divided by the requests completed in it; the median
  over rounds. Stderr has each round's split by process and the connections each relay got.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import progress, result, run_loop
from bench.gateway import (THROUGHPUT_CLIENTS, _Child, _cpu_seconds, _gateway_config, _port,
                           _sigterm_exits, _start_upstream)
from bench.load_generator import Load, request_bytes, window
from entry.ports import free_port

# Seconds a gateway gets to drain and exit after SIGTERM (no call is in flight by then).
STOP_TIMEOUT_S = 30.0
# Seconds for its relays' sockets to listen once /health answers, and for its process group
# to empty once the supervisor has exited (multiprocessing's resource tracker ends just after).
SETTLE_TIMEOUT_S = 10.0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), from /proc."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except FileNotFoundError:
                continue
            found += kids
            todo += kids
    return found


def _tcp_sockets(port: int, state: str) -> list[str]:
    """Inodes of the TCP sockets on local ``port`` in ``state`` (0A: listening, 01: open)."""
    inodes = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == state and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.append(fields[9])
    return inodes


class _Gateway:
    """One ``sluice serve --relays N`` (its own process group) and the roles of its pids."""

    def __init__(self, workdir: Path, upstream_url: str, relays: int, label: str) -> None:
        self.relays = relays
        self.label = label
        self.port = free_port()
        config = workdir / f"{label}.yaml"
        config.write_text(_gateway_config(upstream_url, self.port), encoding="utf-8")
        argv = [sys.executable, "-m", "entry.cli", "serve", "--config", str(config),
                "--relays", str(relays)]
        # cpus=None: no affinity set, so it runs wherever this (unpinned) process may
        self.child = _Child(f"gateway ({label})", argv, workdir / f"{label}.log", None,
                            process_group=0)
        self.pid = self.child.proc.pid
        self.roles: dict[int, str] = {}

    def start(self) -> None:
        self.child.wait_ready(f"http://127.0.0.1:{self.port}/health")
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while len(_tcp_sockets(self.port, "0A")) < self.relays:
            if time.monotonic() > deadline or self.child.proc.poll() is not None:
                raise RuntimeError(f"{self.child.name}: {len(_tcp_sockets(self.port, '0A'))} of "
                                   f"{self.relays} relays listening:\n{self.child.log_tail()}")
            time.sleep(0.05)
        self.roles = self._roles()

    def _roles(self) -> dict[int, str]:
        roles = {self.pid: "gateway" if self.relays == 1 else "supervisor"}
        if self.relays > 1:
            starting = None
            for line in self.child.log_path.read_text("utf-8", "replace").splitlines():
                if '"gateway starting"' in line:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if record.get("event") == "gateway starting" and "policy_pid" in record:
                        starting = record
            if starting is None:
                raise RuntimeError(f"{self.child.name}: no 'gateway starting' line with the "
                                   f"pids in its log:\n{self.child.log_tail()}")
            roles[starting["policy_pid"]] = "policy"
            for index, pid in enumerate(starting["relay_pids"]):
                roles[pid] = f"relay-{index}"
        below = set(_descendants(self.pid))
        if set(roles) - {self.pid} - below:
            raise RuntimeError(f"{self.child.name}: logged pids {sorted(roles)} are not all its "
                               f"children {sorted(below)}")
        for pid in below:
            roles.setdefault(pid, "other")
        return roles

    def check_processes(self) -> None:
        """The same processes as at the start (a relay restarted mid-window would skew it)."""
        now = {self.pid, *_descendants(self.pid)}
        if now != set(self.roles):
            raise RuntimeError(f"{self.child.name}: its processes changed from "
                               f"{self.roles} to {sorted(now)}:\n{self.child.log_tail()}")

    def connections(self) -> dict[str, int]:
        """The load's open connections each process holds (which relay the kernel gave them)."""
        inodes = {f"socket:[{inode}]" for inode in _tcp_sockets(self.port, "01")}
        counts = {}
        for pid, role in self.roles.items():
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            held = 0
            for fd in fds:
                try:
                    held += os.readlink(f"/proc/{pid}/fd/{fd}") in inodes
                except OSError:
                    pass
            if held:
                counts[role] = held
        return counts

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self) -> int:
        """SIGTERM, the exit status (a drain that hangs is killed and reads as -9), and the
        process group emptied (anything left in it is killed and reported)."""
        proc = self.child.proc
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    progress(f"gateway relays: !! {self.child.name} did not exit within "
                             f"{STOP_TIMEOUT_S:.0f} s of SIGTERM; killing its process group")
                    os.killpg(self.pid, signal.SIGKILL)
                    proc.wait()
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while self._group_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._group_alive():
                progress(f"gateway relays: !! {self.child.name} exited but left processes "
                         f"behind; killing its process group")
                os.killpg(self.pid, signal.SIGKILL)
        finally:
            self.child.stop()  # closes its log (the process is gone by now)
        return proc.returncode

    def kill(self) -> None:
        """On the way out after an error: SIGTERM, then SIGKILL for the whole group."""
        try:
            if self.child.proc.poll() is None:
                self.child.proc.send_signal(signal.SIGTERM)
                try:
                    self.child.proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass
            if self._group_alive():
                os.killpg(self.pid, signal.SIGKILL)
            self.child.proc.wait()
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while self._group_alive() and time.monotonic() < deadline:
                time.sleep(0.05)  # the killed ones, until they are reaped
        finally:
            self.child.stop()


class _Meter:
    """The gateway's CPU seconds, all its processes together, for ``window``; it keeps each
    reading per process, and the connections each held when the window opened."""

    def __init__(self, gateway: _Gateway) -> None:
        self.gateway = gateway
        self.readings: list[dict[int, float]] = []
        self.connections: dict[str, int] = {}

    def __call__(self) -> float:
        self.gateway.check_processes()
        if not self.readings:
            self.connections = self.gateway.connections()
        reading = {pid: _cpu_seconds(pid) for pid in self.gateway.roles}
        self.readings.append(reading)
        return sum(reading.values())

    def split(self) -> dict[str, float]:
        """CPU seconds over the window by role."""
        first, last = self.readings[0], self.readings[-1]
        out: dict[str, float] = {}
        for pid, role in self.gateway.roles.items():
            out[role] = out.get(role, 0.0) + last[pid] - first[pid]
        return out


def _requests(port: int) -> list[bytes]:
    return [request_bytes(port, f"bench-whole-{i:03d}", stream=False)
            for i in range(THROUGHPUT_CLIENTS)]


async def _load_window(port: int, warmup_s: float, window_s: float,
                       meter: _Meter | None) -> tuple[float, float | None, int, str]:
    load = Load(port)
    try:
        rate, cpu = await window(load, _requests(port), False, warmup_s, window_s, meter)
    finally:
        load.close()
    return rate, cpu, load.failed, load.failures()


def _log_problems(gateway: _Gateway) -> int:
    """Warnings and errors in the gateway's log (all its processes write to it): reported."""
    problems = [line for line in gateway.child.log_path.read_text("utf-8", "replace").splitlines()
                if any(f'"level":{sep}"{level}"' in line for sep in ("", " ")
                       for level in ("warning", "error", "critical")) or "Traceback" in line]
    if problems:
        progress(f"gateway relays: !! {gateway.child.name} logged {len(problems)} "
                 f"warnings/errors; the first: {problems[0]}")
    return len(problems)


def _split_text(us: dict[str, float], connections: dict[str, int]) -> str:
    relays = sorted(role for role in us if role.startswith("relay-"))
    each = ", ".join(f"{role} {us[role]:,.0f} [{connections.get(role, 0)} conns]"
                     for role in relays)
    return (f"policy {us.get('policy', 0.0):,.0f} + relays {sum(us[r] for r in relays):,.0f} "
            f"({each}) + supervisor {us.get('supervisor', 0.0):,.1f} + other "
            f"{us.get('other', 0.0):,.1f}")


def run(*, quick: bool = False) -> dict[str, float]:
    warmup_s, window_s = (0.5, 2.0) if quick else (1.5, 6.0)
    order = (1, 2, 2, 1) * (1 if quick else 2)
    started = time.perf_counter()
    rates: dict[int, list[float]] = {1: [], 2: []}
    cpus: dict[int, list[float]] = {1: [], 2: []}
    splits: list[dict[str, float]] = []  # --relays 2: us per request by role, each round
    failed = problems = 0
    gateways: list[_Gateway] = []
    upstream = None
    with _sigterm_exits(), tempfile.TemporaryDirectory(prefix="sluice-bench-relays-") as tmp:
        workdir = Path(tmp)
        try:
            upstream, upstream_url = _start_upstream(workdir, None)
            upstream.wait_ready(upstream_url + "/health")
            ceiling, _, direct_failed, direct_failures = run_loop(
                _load_window(_port(upstream_url), warmup_s / 2, window_s / 2, None))
            failed += direct_failed
            progress(f"gateway relays: nothing pinned (CPUs {sorted(os.sched_getaffinity(0))}); "
                     f"{ceiling:,.0f} req/s straight to the upstream at c={THROUGHPUT_CLIENTS} "
                     f"({direct_failures}): the upstream + load generator ceiling on all CPUs")
            for index, relays in enumerate(order):
                gateway = _Gateway(workdir, upstream_url, relays,
                                   f"relays{relays}-round{index + 1}")
                gateways.append(gateway)
                gateway.start()
                meter = _Meter(gateway)
                rate, per_request, round_failed, failures = run_loop(
                    _load_window(gateway.port, warmup_s, window_s, meter))
                status = gateway.stop()
                gateways.remove(gateway)
                if status != 0:
                    raise RuntimeError(f"{gateway.child.name} exited with status {status} after "
                                       f"SIGTERM (expected 0):\n{gateway.child.log_tail()}")
                problems += _log_problems(gateway)
                failed += round_failed
                assert per_request is not None
                rates[relays].append(rate)
                cpus[relays].append(per_request)
                split = meter.split()
                total = sum(split.values())
                # each process's share of the CPU per request (they add up to it)
                us = {role: per_request * 1e6 * cpu / total if total else 0.0
                      for role, cpu in split.items()}
                text = (f"gateway relays: round {index + 1}/{len(order)} --relays {relays}: "
                        f"{rate:,.0f} req/s, {per_request * 1e6:,.0f} us CPU per request")
                if relays > 1:
                    splits.append(us)
                    text += f" = {_split_text(us, meter.connections)}"
                busy = total / window_s
                text += (f"; gateway {busy:.2f} CPUs busy; load average "
                         f"{os.getloadavg()[0]:.2f}; {failures}; exit status {status}")
                progress(text if round_failed == 0 else f"!! {text}")
        finally:
            for gateway in gateways:
                gateway.kill()
            if upstream is not None:
                upstream.stop()
    numbers = {f"relays{n}_{what}": statistics.median(values[n])
               for n in (1, 2) for what, values in (("req_per_s", rates), ("cpu", cpus))}
    numbers["speedup"] = numbers["relays2_req_per_s"] / numbers["relays1_req_per_s"]
    pairs = ", ".join(f"{two / one:.2f}" for one, two in zip(rates[1], rates[2]))
    median_split = {role: statistics.median(s[role] for s in splits) for role in splits[0]}
    relay_roles = sorted(role for role in median_split if role.startswith("relay-"))
    progress(f"gateway relays: --relays 2 CPU per request, median of {len(splits)} rounds by "
             f"process: policy {median_split.get('policy', 0.0):,.0f} us, relays "
             f"{sum(median_split[r] for r in relay_roles):,.0f} us ("
             + ", ".join(f"{r} {median_split[r]:,.0f}" for r in relay_roles)
             + f"), supervisor {median_split.get('supervisor', 0.0):,.1f} us, other "
             f"{median_split.get('other', 0.0):,.1f} us; --relays 1: "
             f"{numbers['relays1_cpu'] * 1e6:,.0f} us; speedup per A-B pair: {pairs}")
    if failed or problems:
        progress(f"gateway relays: !! {failed} requests failed and the gateways logged "
                 f"{problems} warnings/errors (see the lines above)")
    result("gateway_relays1_req_per_s", numbers["relays1_req_per_s"], "req/s")
    result("gateway_relays2_req_per_s", numbers["relays2_req_per_s"], "req/s")
    result("gateway_relays2_speedup", numbers["speedup"], "x")
    result("gateway_relays1_cpu_us_per_request", numbers["relays1_cpu"] * 1e6, "us")
    result("gateway_relays2_cpu_us_per_request", numbers["relays2_cpu"] * 1e6, "us")
    progress(f"gateway relays: took {time.perf_counter() - started:.1f} s")
    return numbers
