"""One soak from start to end: the fleet up, the sessions, faults and monitor at once, then
the settle, the drain and the report."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from bench.soak.calls import CallLedger, SoakAgentClient
from bench.soak.config import SoakSetup
from bench.soak.faults import FaultInjector
from bench.soak.fleet import SoakFleet, drain_gateway, wait_fleet_ready
from bench.soak.monitoring import monitor, settle_and_inspect
from bench.soak.report import build_summary, write_results
from entry.agent_client import APIS
from entry.live_demo import DemoSetup


async def run_soak_async(setup: SoakSetup, out: Path, emit: Callable[[str], None]) -> dict[str, Any]:
    setup.validate()
    out.mkdir(parents=True, exist_ok=True)
    # ipc socket paths must stay short (a Unix socket address), so the run's sockets and
    # logs live in a private temporary folder; the gateway's log is copied to --out
    workdir = Path(tempfile.mkdtemp(prefix="sluice-soak-"))
    fleet = SoakFleet(setup, workdir, workdir)
    emit(f"[soak] {setup.workers} simworkers, {setup.sessions} sessions, {setup.duration_s:.0f} s, "
         f"a fault every {setup.fault_every_s:.0f} s ({', '.join(setup.faults)}); work folder {workdir}")
    fleet.start()
    try:
        await wait_fleet_ready(fleet)
        started = time.monotonic()
        ledger = CallLedger(started=started)
        workload = DemoSetup(blocks=setup.blocks, block_size=setup.block_size, seed=setup.seed).workload()
        client = SoakAgentClient(
            fleet.gateway_url, workload.make_program, concurrency=setup.sessions,
            duration_s=setup.duration_s, time_scale=setup.time_scale, apis=APIS,
            timeout_s=setup.call_timeout_s, ledger=ledger,
            # sessions end at their next turn boundary after duration_s; this only bounds a
            # run whose calls would all hang, and is past every call's own timeout
            drain_s=setup.call_timeout_s + 60.0)
        faults = FaultInjector(fleet, setup, started, emit)
        stop = anyio.Event()
        rss: list[tuple[float, int]] = []

        async def play() -> None:
            await client.run()
            stop.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(monitor, fleet, setup, ledger, faults, started, stop, rss, emit)
            tasks.start_soon(faults.run, stop)
            tasks.start_soon(play)
        sessions_ended_s = round(time.monotonic() - started, 2)
        emit(f"[soak {sessions_ended_s:7.1f}s] sessions stopped; checking nothing is held, then draining")
        before_drain = await settle_and_inspect(fleet)
        drain = await drain_gateway(fleet)
        shutil.copy(fleet.gateway.log, out / "gateway.log")  # type: ignore[union-attr]
        summary = build_summary(setup, ledger, client, faults.log, rss, before_drain, drain,
                                sessions_ended_s, workdir)
    finally:
        fleet.stop()
    write_results(out, summary, rss)
    if summary["acceptance"]["passed"]:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        emit(f"[soak] acceptance failed; worker logs kept in {workdir}")
    return summary


def run_soak(setup: SoakSetup, out: Path, emit: Callable[[str], None] | None = None) -> dict[str, Any]:
    def print_line(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    return anyio.run(run_soak_async, setup, out, emit or print_line)
