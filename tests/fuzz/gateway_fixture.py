"""One gateway in process, in front of a real simworker on loopback, for the HTTP targets.

The gateway runs under Starlette's TestClient (its lifespan included: ticks, fleet, health
checks and directive sender all run, on the TestClient's event-loop thread), so an input
costs no socket on the client side; its worker is a simworker (simworker/worker.py) served
by uvicorn on 127.0.0.1, because it checks bodies as vLLM does and answers bad ones with
vLLM's 400s, so that every answer the gateway relays is a real engine's answer.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from starlette.testclient import TestClient
from tests.support.gateway_harness import ADMIN, ServerThread, serve_config

from controller.gateway import create_app as create_gateway
from simworker.worker import SimWorkerConfig
from simworker.worker import create_app as create_simworker

WORKER = "sim0"


def path_segment(value: str) -> str:
    """``value`` as one segment of a path sent through Starlette's TestClient, so that the
    route's path parameter reads ``value`` again. The TestClient decodes a path twice (its
    ``scope["path"]`` is ``unquote`` of httpx's already-decoded path; uvicorn decodes once), so
    the segment is quoted twice: quoted once, a session id such as ``2,%bd`` reached the admin
    API as ``2,\ufffd`` and could not be released (found by the proxied-routes target; a
    real server answers the once-quoted path right, tests/integration/test_gateway_proxy.py
    test_operator_release)."""
    once = quote(value, safe="")
    if once in (".", ".."):
        # a dot segment: every client removes it from the path (RFC 3986 §5.2.4), so a
        # program named "." is released as %2E (found by the proxied target too)
        once = once.replace(".", "%2E")
    return quote(once, safe="")


class RecentLog(io.TextIOBase):
    """The gateway's log, its last lines only: a long run writes a line or more per input,
    and a failure needs only what led up to it."""

    def __init__(self, keep: int = 200) -> None:
        self.recent: deque[str] = deque(maxlen=keep)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.recent.extend(line for line in text.splitlines() if line)
        return len(text)

    def tail(self) -> str:
        return "\n".join(self.recent)


@dataclass
class FuzzGateway:
    client: TestClient
    app: Any
    worker_url: str
    worker_entry: dict
    log: RecentLog

    @property
    def admission(self):
        return self.app.state.sluice.admission

    def on_loop(self, fn, *args):
        """Run ``fn`` on the gateway's event-loop thread (its state is that thread's)."""
        assert self.client.portal is not None
        return self.client.portal.call(fn, *args)

    def programs(self) -> list[dict]:
        r = self.client.get("/sluice/programs", headers=ADMIN)
        assert r.status_code == 200, r.text
        return r.json()["programs"]

    def workers(self) -> dict[str, dict]:
        r = self.client.get("/sluice/workers", headers=ADMIN)
        assert r.status_code == 200, r.text
        return {w["name"]: w for w in r.json()["workers"]}

    def release_all(self, programs: list[dict] | None = None) -> None:
        """End every program (``programs``, as :meth:`programs` listed them, or all listed
        now), through the admin API, so one input's programs do not pile up over a long run
        (they would reach limits.max_programs)."""
        for program in self.programs() if programs is None else programs:
            session = program["session_id"]
            r = self.client.post(f"/sluice/programs/{path_segment(session)}/release",
                                 headers=ADMIN)
            # a program the admin API lists, it can release
            assert r.status_code == 200, (session, r.status_code, r.text)

    def nothing_held(self) -> list[str]:
        """What is left held or in flight now, in the admission shell and in the policy
        (empty when nothing is)."""
        def look() -> list[str]:
            admission = self.admission
            left = [f"{admission.held} calls held"] if admission.held else []
            left += admission.disagreements()
            left += [f"{rid} tracked on {worker}" for rid, worker in
                     admission.policy.call_workers().items()]
            left += [f"{name}: {admission.calls_on(name)} calls in flight"
                     for name in self.workers_in_policy() if admission.calls_on(name)]
            return left
        return self.on_loop(look)

    def workers_in_policy(self) -> list[str]:
        return [w.name for w in self.admission.snapshot(with_programs=False).workers]


@contextmanager
def simworker() -> Iterator[tuple[ServerThread, Any]]:
    # a small pool and a short model length, so that no input can ask for a long run; a fast
    # clock, so that a valid call takes milliseconds
    app = create_simworker(SimWorkerConfig(name=WORKER, num_blocks=512, block_size=16,
                                           kv_events=None, directives="tcp://127.0.0.1:*",
                                           time_scale=0.002, max_model_len=2048,
                                           default_max_tokens=8, sampling_seed=1))
    server = ServerThread(app).start()
    try:
        yield server, app.state.worker
    finally:
        server.stop()


@contextmanager
def fuzz_gateway(server: ServerThread, worker: Any, **overrides: Any) -> Iterator[FuzzGateway]:
    entry = {"name": WORKER, "url": server.url,
             "directives": worker.directives.bound_endpoint, "capacity_tokens": 8192}
    # Health checked rarely: on a loaded machine a slow /health must not mark the worker
    # down in the middle of a run (that is not what is under test here).
    config = serve_config([entry], health_interval_s=3600.0, **overrides)
    log = RecentLog()
    app = create_gateway(config, log_stream=log)
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=True) as client:
        yield FuzzGateway(client, app, server.url, entry, log)
