"""The faults, injected one every ``fault_every_s`` in a cycle: a worker killed, hung or
restarted, the gateway's policy reloaded, a burst of bad input."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from typing import Any

import anyio
import httpx

from bench.soak.bad_input import bad_input_burst
from bench.soak.config import ADMIN_HEADERS, SoakSetup
from bench.soak.fleet import (
    SimWorker,
    SoakFleet,
    gateway_workers,
    parse_metrics,
    wait_gateway_sees,
    wait_healthy,
)


class FaultInjector:
    def __init__(self, fleet: SoakFleet, setup: SoakSetup, started: float,
                 emit: Callable[[str], None]) -> None:
        self.fleet = fleet
        self.setup = setup
        self.started = started
        self.emit = emit
        self.log: list[dict[str, Any]] = []
        self._next_worker = 0

    def _worker(self) -> SimWorker:
        worker = self.fleet.workers[self._next_worker % len(self.fleet.workers)]
        self._next_worker += 1
        return worker

    def _now(self) -> float:
        return round(time.monotonic() - self.started, 2)

    async def run(self, stop: anyio.Event) -> None:
        setup = self.setup
        index = 0
        while True:
            at = (index + 1) * setup.fault_every_s
            # the last fault must be over before the sessions stop
            if at + setup.fault_span_s + 10 > setup.duration_s:
                return
            with anyio.move_on_after(max(0.0, self.started + at - time.monotonic())):
                await stop.wait()
            if stop.is_set():
                return
            kind = setup.faults[index % len(setup.faults)]
            record: dict[str, Any] = {"kind": kind, "at_s": self._now()}
            self.emit(f"[soak {record['at_s']:7.1f}s] fault {index + 1}: {kind}")
            async with httpx.AsyncClient(base_url=self.fleet.gateway_url, timeout=5.0) as http:
                await getattr(self, kind)(record, http)
            record["ended_s"] = self._now()
            self.log.append(record)
            self.emit(f"[soak {record['ended_s']:7.1f}s] fault {index + 1} over: "
                      + json.dumps({k: v for k, v in record.items() if k not in ("kind", "at_s", "ended_s")}))
            index += 1

    async def worker_kill(self, record: dict[str, Any], http: httpx.AsyncClient) -> None:
        worker = self._worker()
        record["worker"] = worker.name
        worker.process.signal(signal.SIGKILL)
        record["exit_status"] = await worker.process.wait_exit(10)
        record["gateway_saw_down_after_s"] = await wait_gateway_sees(
            http, worker.name, False, self.setup.fault_span_s)
        await anyio.sleep(max(0.0, self.setup.fault_span_s - (time.monotonic() - self.started - record["at_s"])))
        await self._restart(worker, record, http)

    async def worker_hang(self, record: dict[str, Any], http: httpx.AsyncClient) -> None:
        worker = self._worker()
        record["worker"] = worker.name
        worker.process.signal(signal.SIGSTOP)
        record["hung_for_s"] = self.setup.fault_span_s
        record["gateway_saw_down_after_s"] = await wait_gateway_sees(
            http, worker.name, False, self.setup.fault_span_s)
        await anyio.sleep(max(0.0, self.setup.fault_span_s - (time.monotonic() - self.started - record["at_s"])))
        worker.process.signal(signal.SIGCONT)
        record["gateway_saw_healthy_after_s"] = await wait_gateway_sees(http, worker.name, True, 60)

    async def worker_restart(self, record: dict[str, Any], http: httpx.AsyncClient) -> None:
        worker = self._worker()
        record["worker"] = worker.name
        worker.process.signal(signal.SIGTERM)
        status = await worker.process.wait_exit(15)
        if status is None:
            worker.process.signal(signal.SIGKILL)
            status = await worker.process.wait_exit(5)
            record["needed_sigkill"] = True
        record["exit_status"] = status
        await self._restart(worker, record, http)

    async def _restart(self, worker: SimWorker, record: dict[str, Any], http: httpx.AsyncClient) -> None:
        worker.process.start()
        record["worker_up_after_s"] = round(await wait_healthy(worker.url, 60), 2)
        record["gateway_saw_healthy_after_s"] = await wait_gateway_sees(http, worker.name, True, 60)

    async def gateway_reload(self, record: dict[str, Any], http: httpx.AsyncClient) -> None:
        before = await self._reloads_applied(http)
        record["policy_max_wait_s"] = self.fleet.rewrite_policy()
        assert self.fleet.gateway is not None
        self.fleet.gateway.signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while (applied := await self._reloads_applied(http)) <= before and time.monotonic() < deadline:
            await anyio.sleep(0.25)
        record["reloads_applied"] = applied - before
        config = (await http.get("/sluice/config", headers=ADMIN_HEADERS)).json()
        record["gateway_max_wait_s"] = _find_key(config, "max_wait_s")

    @staticmethod
    async def _reloads_applied(http: httpx.AsyncClient) -> float:
        metrics = parse_metrics((await http.get("/metrics")).text)
        return metrics.get('sluice_config_reloads_total{result="applied"}', 0.0)

    async def bad_input(self, record: dict[str, Any], http: httpx.AsyncClient) -> None:
        rounds = max(2, min(20, self.setup.sessions // 16))
        record.update(await bad_input_burst(self.fleet.gateway_url, rounds))
        # the gateway must still answer its workers' state after the burst
        record["workers_healthy_after"] = sum(w["healthy"] for w in (await gateway_workers(http)).values())


def _find_key(data: Any, key: str) -> Any:
    if isinstance(data, dict):
        if key in data:
            return data[key]
        for value in data.values():
            if (found := _find_key(value, key)) is not None:
                return found
    return None
