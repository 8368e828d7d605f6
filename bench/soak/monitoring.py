"""Watching the gateway: its RSS every 10 s and a line of progress every minute during the
run; what it still holds or has in flight once the sessions have stopped."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx

from bench.soak.calls import CallLedger
from bench.soak.config import ADMIN_HEADERS, SoakSetup
from bench.soak.faults import FaultInjector
from bench.soak.fleet import SoakFleet, gateway_workers, parse_metrics

RSS_SAMPLE_EVERY_S = 10.0
PROGRESS_EVERY_S = 60.0


def rss_bytes(pid: int) -> int:
    """Resident set size from /proc (no psutil needed)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


async def monitor(fleet: SoakFleet, setup: SoakSetup, ledger: CallLedger, faults: FaultInjector,
                  started: float, stop: anyio.Event, rss: list[tuple[float, int]],
                  emit: Callable[[str], None]) -> None:
    """RSS every 10 s, a line of progress every minute."""
    assert fleet.gateway is not None
    next_progress = started + PROGRESS_EVERY_S
    while not stop.is_set():
        fleet.check_alive()
        rss.append((round(time.monotonic() - started, 1), rss_bytes(fleet.gateway.pid)))
        if time.monotonic() >= next_progress:
            next_progress += PROGRESS_EVERY_S
            emit(f"[soak {time.monotonic() - started:7.1f}s] calls {ledger.sent:,} ok {ledger.succeeded:,} "
                 f"errors {sum(ledger.errors.values())} unclear {sum(ledger.unclear.values())} "
                 f"lost {sum(ledger.lost.values())} | gateway RSS {rss[-1][1] / 2**20:.1f} MiB | "
                 f"faults {len(faults.log)}")
        with anyio.move_on_after(RSS_SAMPLE_EVERY_S):
            await stop.wait()


async def settle_and_inspect(fleet: SoakFleet, timeout_s: float = 60.0) -> dict[str, Any]:
    """Once the sessions have stopped: wait until nothing is held or in flight, and report
    what the gateway still tracks."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=fleet.gateway_url, timeout=10.0) as http:
        while True:
            programs = (await http.get("/sluice/programs", headers=ADMIN_HEADERS)).json()["programs"]
            workers = await gateway_workers(http)
            metrics = parse_metrics((await http.get("/metrics")).text)
            state = {
                "programs_tracked": len(programs),
                "calls_in_flight": sum(p["in_flight"] for p in programs),
                "calls_waiting": sum(p["waiting"] for p in programs),
                "calls_held": metrics.get("sluice_calls_held", -1.0),
                "worker_calls_in_flight": {n: w["calls_in_flight"] for n, w in workers.items()},
                "workers_healthy": sum(w["healthy"] for w in workers.values()),
                "programs_by_state": dict(Counter(f"{p['lifecycle']}/{p['phase']}" for p in programs)),
                "requests_by_status": {k.partition("{")[2].rstrip("}"): v for k, v in metrics.items()
                                       if k.startswith("sluice_requests_total{")},
                "core_errors": sum(v for k, v in metrics.items() if k.startswith("sluice_core_errors_total")),
            }
            busy = (state["calls_in_flight"] or state["calls_waiting"] or state["calls_held"]
                    or any(state["worker_calls_in_flight"].values()))
            if not busy or time.monotonic() > deadline:
                state["settled"] = not busy
                return state
            await anyio.sleep(0.5)
