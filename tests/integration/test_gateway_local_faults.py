"""What the gateway's own faults must not be blamed on, and must not leave behind.

- A removed worker leaves nothing running: its health checks and capacity probe end with it
  (the probe of a worker added without a capacity included), nothing of it is logged
  afterwards, and a loop that outlived its worker would end by itself rather than log a
  ``KeyError`` for ever.
- Running out of descriptors is the gateway's fault, not the worker's: a gateway in a
  subprocess is made to run out of descriptors (its ``RLIMIT_NOFILE`` lowered and every
  descriptor left taken); a call then gets a 503 that says so, the worker is not marked
  down, its health checks are not counted against it, a worker cannot be added meanwhile
  (503 too), and all of it works again once the descriptors are back.

Real servers on loopback; the test talks to the starved gateway over one connection opened
before the descriptors ran out (the gateway could not accept another).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from controller.admin_client import SluiceAdmin
from controller.gateway import create_app
from controller.serve_config import parse_serve_config
from tests.integration.test_membership_wiring import counted_fake, tasks_of
from tests.support.fake_vllm import FakeState, create_fake
from tests.support.gateway_harness import (
    ADMIN,
    ADMIN_TOKEN,
    Gateway,
    ServerThread,
    chat,
    gateway,
    serve_config,
    wait_for,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


# -- a removed worker's loops ---------------------------------------------------------------------


def _run_on_gateway(gw: Gateway, coroutine: Coroutine[Any, Any, Any], timeout_s: float) -> None:
    """Run ``coroutine`` on the gateway's event loop until it returns; AssertionError (and
    the coroutine cancelled) when it has not within ``timeout_s``."""
    loop = gw.server.server.servers[0].get_loop()
    future = asyncio.run_coroutine_threadsafe(coroutine, loop)
    try:
        future.result(timeout_s)
    except TimeoutError:
        future.cancel()
        raise AssertionError(f"still running after {timeout_s} s") from None


def _lines_naming(gw: Gateway, worker: str, since: int) -> list[str]:
    return [line for line in gw.log.lines()[since:] if f'"{worker}"' in line]


def test_a_removed_workers_health_and_capacity_loops_end_and_log_nothing_more():
    with counted_fake("witness") as (witness, witness_url), \
            counted_fake("gone") as (gone, gone_url):
        # Both fakes' /metrics never tell a capacity: each is probed until it leaves.
        config = serve_config([{"name": "witness", "url": witness_url}],
                              health_interval_s=0.05, capacity_retry_s=0.05)
        with gateway(config) as gw, SluiceAdmin(gw.url, ADMIN_TOKEN) as admin:
            admin.add_worker("gone", gone_url)  # no capacity_tokens: it is probed for one
            wait_for(lambda: gone.hits["/metrics"] >= 2 and gone.hits["/health"] >= 2,
                     timeout=10, what="gone's capacity probes and health checks")
            assert {"capacity probe of gone", "health checks of gone"} <= set(tasks_of(gw, "gone"))
            state = gw.parts.workers.states["gone"]
            admin.drain("gone")
            admin.remove("gone")
            removed_at = next(i for i, line in enumerate(gw.log.lines())
                              if "worker removed" in line and '"gone"' in line)
            assert tasks_of(gw, "gone") == []
            # The witness is probed and checked on gone's schedule: once it has been five
            # more times, gone would have been too (one of gone's may have been under way).
            start = witness.hits.copy()
            wait_for(lambda: witness.hits["/metrics"] > start["/metrics"],
                     what="a probe of the witness")
            gone_then, witness_then = gone.hits.copy(), witness.hits.copy()
            wait_for(lambda: witness.hits["/metrics"] >= witness_then["/metrics"] + 5
                     and witness.hits["/health"] >= witness_then["/health"] + 5,
                     timeout=10, what="five more probes and checks of the witness")
            assert gone.hits == gone_then
            assert _lines_naming(gw, "gone", removed_at + 1) == []

            # Were either loop left running (its task not stopped), it would end by itself
            # at its next round rather than probe a pool that has no such worker.
            registry = gw.parts.workers
            before = len(gw.log.lines())
            _run_on_gateway(gw, registry.learn_capacity(state), timeout_s=10)
            _run_on_gateway(gw, registry.watch_health(state), timeout_s=10)
            assert gone.hits == gone_then
            ended = _lines_naming(gw, "gone", before)
            assert [json.loads(line)["event"] for line in ended] == [
                "capacity probe of a removed worker ended",
                "health checks of a removed worker ended"]
            assert not any("Traceback" in line or "KeyError" in line for line in gw.log.lines())


# -- a gateway out of descriptors -----------------------------------------------------------------


def _say(line: str) -> None:
    print(line, flush=True)


class Starvation:
    """This process out of descriptors until :meth:`end`: its soft ``RLIMIT_NOFILE`` is
    lowered to a little above what it uses and every descriptor left is taken, so that the
    next socket anyone in it opens fails with EMFILE. A descriptor freed meanwhile (a
    connection that was closing) is taken too, within milliseconds."""

    def __init__(self) -> None:
        self.limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.taken: list[int] = []
        self._over = threading.Event()
        in_use = len(os.listdir("/proc/self/fd"))
        # the limit lowered first: filling a (often very high) limit would take ages
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(in_use + 16, self.limits[0]),
                                                    self.limits[1]))
        self._take_what_is_left()
        self._keeper = threading.Thread(target=self._keep_taking, daemon=True)
        self._keeper.start()

    def _take_what_is_left(self) -> None:
        while True:
            try:
                self.taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as err:
                if err.errno != errno.EMFILE:
                    raise
                return

    def _keep_taking(self) -> None:
        while not self._over.wait(0.005):
            self._take_what_is_left()

    def end(self) -> None:
        self._over.set()
        self._keeper.join(10)
        for fd in self.taken:
            os.close(fd)
        self.taken.clear()
        resource.setrlimit(resource.RLIMIT_NOFILE, self.limits)


def serve_starvable_gateway() -> None:
    """The subprocess: a gateway (config from the JSON file ``argv[1]``, JSON log lines to
    ``argv[2]``) whose descriptors run out on ``starve`` and come back on ``restore``, one
    command a line on stdin; it answers ``ready PORT``, ``starved N`` and ``restored``."""
    config_path, log_path = sys.argv[1], sys.argv[2]
    config = parse_serve_config(json.loads(Path(config_path).read_text()))
    starvation: Starvation | None = None
    with open(log_path, "w", buffering=1, encoding="utf-8") as log:
        app = create_app(config, log_stream=log)
        # a long keep-alive: the test's one connection must outlast the starved spell
        server = uvicorn.Server(uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
            lifespan="on", timeout_keep_alive=120, timeout_graceful_shutdown=1))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.01)
        _say(f"ready {server.servers[0].sockets[0].getsockname()[1]}")
        try:
            for line in sys.stdin:
                command = line.strip()
                if command == "starve" and starvation is None:
                    starvation = Starvation()
                    _say(f"starved {len(starvation.taken)}")
                elif command == "restore" and starvation is not None:
                    starvation.end()
                    starvation = None
                    _say("restored")
                elif command == "stop":
                    break
        finally:
            if starvation is not None:
                starvation.end()
            server.should_exit = True
            thread.join(10)


class StarvableGateway:
    """The parent's end of :func:`serve_starvable_gateway`."""

    def __init__(self, tmp_path: Path, config: dict[str, Any]) -> None:
        config_path = tmp_path / "gateway.json"
        config_path.write_text(json.dumps(config))
        self.log_path = tmp_path / "gateway.log"
        self._stderr = (tmp_path / "gateway.stderr").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from tests.integration.test_gateway_local_faults import "
             "serve_starvable_gateway; serve_starvable_gateway()", str(config_path),
             str(self.log_path)],
            cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True)
        self._answers: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_answers, daemon=True).start()
        port = self._expect("ready", timeout_s=60)
        # one connection, kept alive: the starved gateway could not accept a second
        self.client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=20, trust_env=False,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1,
                                keepalive_expiry=120))

    def _read_answers(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._answers.put(line.strip())

    def _expect(self, word: str, timeout_s: float = 20) -> str:
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"the gateway did not answer {word!r} within {timeout_s} s:"
                                 f"\n{self.stderr()}") from None
        said, _, rest = answer.partition(" ")
        assert said == word, (answer, self.stderr())
        return rest

    def command(self, command: str, answer: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._expect(answer)

    def workers(self) -> dict[str, dict]:
        r = self.client.get("/sluice/workers", headers=ADMIN)
        r.raise_for_status()
        return {w["name"]: w for w in r.json()["workers"]}

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line]

    def stderr(self) -> str:
        self._stderr.flush()
        return Path(self._stderr.name).read_text()[-4000:]

    def close(self) -> None:
        self.client.close()
        assert self.process.stdin is not None
        try:
            if self.process.poll() is None:
                self.process.stdin.write("stop\n")  # it stops without a word
                self.process.stdin.flush()
            self.process.wait(15)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()  # gone already (a broken pipe) or stuck: it must not linger
            self.process.wait(5)
        finally:
            self._stderr.close()


@contextmanager
def starvable_gateway(tmp_path: Path, config: dict[str, Any]) -> Iterator[StarvableGateway]:
    gw = StarvableGateway(tmp_path, config)
    try:
        yield gw
    finally:
        gw.close()


class _ClosesConnections:
    """An ASGI app that answers every request with ``Connection: close``: each health check
    and call to it needs a new connection, hence a new descriptor."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def closing(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message,
                           "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)
        await self.app(scope, receive, closing if scope["type"] == "http" else send)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts descriptors in /proc")
def test_running_out_of_descriptors_is_the_gateways_fault_not_the_workers(tmp_path):
    worker = ServerThread(_ClosesConnections(create_fake(FakeState("w0")))).start()
    late = ServerThread(create_fake(FakeState("late"))).start()
    config = {"admin_token": ADMIN_TOKEN, "admin_token_env": None, "reload_poll_s": 0,
              # checks often enough that more than unhealthy_after of them fall in the
              # starved spell
              "health_interval_s": 0.5, "unhealthy_after": 3,
              "workers": [{"name": "w0", "url": worker.url, "capacity_tokens": 100_000}]}
    try:
        with starvable_gateway(tmp_path, config) as gw:
            call = {"json": chat("first"), "headers": {"x-session-id": "agent"}}
            late_entry = {"name": "late", "url": late.url, "capacity_tokens": 100_000}
            first = gw.client.post("/v1/chat/completions", **call)
            assert first.status_code == 200 and first.headers["x-worker"] == "w0", first.text

            assert int(gw.command("starve", "starved")) > 0

            def checks_missed_or_down() -> bool:
                # (down: what a gateway that blamed the worker for its own shortage does)
                w0 = gw.workers()["w0"]
                return w0.get("local_shortages", 0) > 3 or not w0["healthy"]

            # Its health checks cannot be made: they are not counted against it.
            wait_for(checks_missed_or_down, timeout=15, what="four health checks of w0 not made")
            w0 = gw.workers()["w0"]
            assert w0["healthy"] is True and "EMFILE" in w0["local_shortage"], w0
            # A call gets a 503 that blames the gateway, and the worker stays in.
            starved = gw.client.post("/v1/chat/completions", **call)
            assert starved.status_code == 503, starved.text
            error = starved.json()["error"]
            assert error["code"] == "gateway_out_of_resources", error
            assert "out of local resources (EMFILE" in error["message"], error
            assert "the worker is not at fault" in error["message"], error
            assert starved.headers["retry-after"] == "1"
            # Nor can a worker be added meanwhile: a 503 that says why, and no trace of it.
            added = gw.client.post("/sluice/workers", headers=ADMIN, json=late_entry)
            assert added.status_code == 503, added.text
            assert "out of local resources (EMFILE" in added.json()["error"]["message"]
            assert added.json()["error"]["type"] == "service_unavailable"
            assert set(gw.workers()) == {"w0"} and gw.workers()["w0"]["healthy"] is True

            gw.command("restore", "restored")
            wait_for(lambda: gw.workers()["w0"]["local_shortage"] is None, timeout=15,
                     what="w0's health checks made again")
            again = gw.client.post("/v1/chat/completions", **call)
            assert again.status_code == 200 and again.headers["x-worker"] == "w0", again.text
            added = gw.client.post("/sluice/workers", headers=ADMIN, json=late_entry)
            assert added.status_code == 201, added.text

            events = gw.events()
            names = [e["event"] for e in events]
            assert "worker unreachable" not in names, names
            assert not any(name.startswith("worker unhealthy") for name in names), names
            # logged once a spell (a check that found a descriptor just freed may split it)
            missed = [e for e in events if e["event"].startswith("check not made")]
            assert missed and {(e["worker"], e["check"]) for e in missed} == {("w0", "health check")}
            assert all("EMFILE" in e["problem"] for e in missed)
            assert any(e["event"].startswith("checks made again") for e in events)
            failed = [e for e in events if e["event"] == "upstream failed"]
            assert [e["status"] for e in failed] == [503]
            assert "out of local resources" in failed[0]["problem"]
            assert any(e["event"] == "worker not added: the gateway is out of local resources"
                       for e in events)
            assert not any(e.get("level") in ("error", "critical") for e in events), names
    finally:
        worker.stop()
        late.stop()
