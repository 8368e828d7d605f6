"""The parity harness's server processes (tests/support/parity.py): simworkers, or the gateway
on the simworkers' scaled clock, each process serving on one event loop.

``python -m tests.support.parity_servers simworkers CONFIGS_JSON`` builds one simworker app
(simworker/worker.py) per :class:`simworker.worker.SimWorkerConfig` in the JSON list (its keys
are the config's fields) and serves them all on one event loop.

``python -m tests.support.parity_servers gateway CONFIG_JSON TIME_SCALE`` builds the gateway
(``controller.gateway.create_app``) from a ``sluice serve`` config given as JSON, on the clock
:class:`VirtualClock` keeps (wall seconds over ``TIME_SCALE``: the simworkers' time), so its
policy counts in the same seconds as the simulator's.

Either serves with uvicorn (uvloop, httptools: what ``sluice serve`` and ``sluice simworker``
run) on loopback ports the kernel picks, prints one JSON line with its endpoints on stdout, and
serves until its standard input closes (the parent's signal to stop, also when the parent
dies). Meanwhile it measures how late its event loop wakes (:class:`LoopLag`), and prints that
and the CPU seconds it used as a last JSON line on exit. Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from typing import Any

import structlog
import uvicorn
import uvloop

LAG_PROBE_PERIOD_S = 0.01


class VirtualClock:
    """The simworkers' time: wall seconds since the start, over ``time_scale``."""

    def __init__(self, time_scale: float) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.time_scale = time_scale
        self.start = time.monotonic()

    def __call__(self) -> float:
        return (time.monotonic() - self.start) / self.time_scale

    def wall_s(self, virtual_s: float) -> float:
        return virtual_s * self.time_scale


class LoopLag:
    """How late an event loop wakes from a short sleep: the time its other work holds it."""

    def __init__(self, period_s: float = LAG_PROBE_PERIOD_S) -> None:
        self.period_s = period_s
        self.lags_s: list[float] = []

    async def run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.period_s)
            self.lags_s.append(max(0.0, time.monotonic() - before - self.period_s))

    def summary(self) -> dict[str, float]:
        lags = sorted(self.lags_s)
        if not lags:
            return {"samples": 0}

        def quantile(q: float) -> float:
            return lags[min(len(lags) - 1, int(q * len(lags)))]

        return {"samples": len(lags), "p50_s": round(quantile(0.5), 5), "p99_s": round(quantile(0.99), 5),
                "max_s": round(lags[-1], 5), "mean_s": round(sum(lags) / len(lags), 6)}


def _server(app: Any) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                         access_log=False, lifespan="on",
                                         timeout_graceful_shutdown=1))


def _url(server: uvicorn.Server) -> str:
    return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


async def _serve(apps: list[Any], describe: Any) -> None:
    """Serve ``apps`` until stdin closes; ``describe(servers)`` is the line printed once all
    serve."""
    servers = [_server(app) for app in apps]
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    while not all(server.started for server in servers):
        for task in tasks:
            if task.done():
                task.result()  # raises what stopped it
                raise RuntimeError("a server stopped before it started serving")
        await asyncio.sleep(0.01)
    lag = LoopLag()
    probe = asyncio.create_task(lag.run())
    print(json.dumps(describe(servers)), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    probe.cancel()
    for server in servers:
        server.should_exit = True
    await asyncio.gather(*tasks)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"loop_lag": lag.summary(), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)}),
          flush=True)


def serve_simworkers(configs_json: str) -> None:
    from simworker.worker import SimWorkerConfig, create_app

    configs = [SimWorkerConfig(**fields) for fields in json.loads(configs_json)]
    apps = [create_app(config) for config in configs]

    def describe(servers: list[uvicorn.Server]) -> list[dict[str, Any]]:
        endpoints = []
        for config, app, server in zip(configs, apps, servers):
            worker = app.state.worker
            endpoints.append({"name": config.name, "url": _url(server), "kv_events": worker.kv_endpoint,
                              "replay": worker.replay_endpoint,
                              "directives": worker.directives.bound_endpoint if worker.directives else None})
        return endpoints

    uvloop.run(_serve(apps, describe))


def serve_gateway(config_json: str, time_scale: float) -> None:
    from controller.gateway import create_app
    from controller.serve_config import parse_serve_config

    app = create_app(parse_serve_config(json.loads(config_json)), clock=VirtualClock(time_scale))
    uvloop.run(_serve([app], lambda servers: {"url": _url(servers[0])}))


def simworker_configs_json(configs: list[Any]) -> str:
    """The argument ``simworkers`` reads back into these :class:`SimWorkerConfig` objects."""
    return json.dumps([{name: getattr(config, name) for name in type(config).__dataclass_fields__}
                       for config in configs])


def main(argv: list[str]) -> None:
    # stdout carries the endpoints and the lag; the servers' logs go to stderr
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    if len(argv) == 2 and argv[0] == "simworkers":
        serve_simworkers(argv[1])
    elif len(argv) == 3 and argv[0] == "gateway":
        serve_gateway(argv[1], float(argv[2]))
    else:
        raise SystemExit("usage: python -m tests.support.parity_servers simworkers CONFIGS_JSON\n"
                         "       python -m tests.support.parity_servers gateway CONFIG_JSON TIME_SCALE")


if __name__ == "__main__":
    main(sys.argv[1:])
