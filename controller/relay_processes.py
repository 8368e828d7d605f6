"""``sluice serve --relays N``: the policy in one process, N processes relaying HTTP in front of
it on one port, as vLLM's API servers front one engine core.

- **The policy process** runs the gateway's app exactly as ``sluice serve`` does — the
  policy, its ticks, the fleet (health checks, KV events, directives), the config watcher —
  without a listener of its own: its :class:`~controller.policy_service.PolicyService`
  answers the relays over a Unix socket.
- **Each relay process** (controller/relay_app.py) listens on the gateway's port with
  ``SO_REUSEPORT``, so the kernel spreads connections over the relays, and relays each call
  itself: reading, identity, the upstream request, the answer. Admission and the shared
  tables (conversations, Responses ids, client keys' sessions, the model list) are asks to
  the policy process; every other route is answered by it.
- **This process** (the supervisor) starts them, forwards SIGHUP (a config reload) to the
  policy process, restarts a relay that dies (its calls in the policy were aborted as its
  connection closed), and on SIGTERM or Ctrl-C drains: the relays first, each giving its
  calls ``shutdown_grace_s`` as the one-process gateway does, then the policy process. A
  policy process that dies ends the gateway (exit status 1): relays cannot admit without it.
  Children whose supervisor dies (even by SIGKILL) drain and stop on their own.

The policy's socket and the metrics files live in a directory only this user can enter
(``tempfile.mkdtemp``, mode 0700), removed at exit: nobody else can connect to the policy.
Processes are started with ``spawn`` so that each imports prometheus_client after
``PROMETHEUS_MULTIPROC_DIR`` is set (controller/metrics.py).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from controller.logs import make_logger

# How long the policy process may take to wire its fleet before the gateway gives up.
POLICY_START_TIMEOUT_S = 120.0
# Seconds between looks at the children while nothing happens.
WATCH_INTERVAL_S = 0.5
# A relay that dies this many times within RESTART_WINDOW_S is not started again: it fails
# for a reason a restart does not mend (its app cannot start), and the gateway stops (status 1).
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


def relay_name(index: int) -> str:
    return f"relay-{index}"


def shared_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other processes of this user may bind too
    (``SO_REUSEPORT``: the kernel spreads new connections over those that listen)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    sock = shared_socket(host, port)
    sock.listen(backlog)
    return sock


# -- the child processes --------------------------------------------------------------------


def _stop_when_orphaned() -> None:
    """SIGTERM to this process when its supervisor dies: its drain runs, as on a stop."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def run_policy_process(config_path: str, socket_path: str, metrics_dir: str,
                       ready: Any) -> None:
    """The policy process's main: the gateway's app without a listener, and its service."""
    # Ctrl-C reaches the whole process group; the supervisor decides when this one stops
    # (after the relays, which still report how their calls end).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _stop_when_orphaned()
    import uvloop  # a dependency; the relays' uvicorn runs on it too (controller/server.py)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_policy_main(config_path, socket_path, metrics_dir, ready))


async def _policy_main(config_path: str, socket_path: str, metrics_dir: str, ready: Any) -> None:
    from controller.gateway import create_app
    from controller.policy_service import PolicyService
    from controller.relay_wire import ASK_HEADROOM_BYTES
    from controller.serve_config import load_serve_config

    config = load_serve_config(Path(config_path))
    app = create_app(config, metrics_dir=metrics_dir)
    service = PolicyService(app.state.sluice, app.state.policy_link, app, socket_path,
                            config.max_body_bytes + ASK_HEADROOM_BYTES)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with app.router.lifespan_context(app):
        await service.start()
        ready.set()
        await stop.wait()
        await service.aclose()


def run_relay_process(index: int, config_path: str, host: str, port: int, socket_path: str,
                      metrics_dir: str) -> None:
    """A relay process's main: its app on its own SO_REUSEPORT socket until SIGTERM/SIGINT."""
    from controller.relay_app import RelayApp
    from controller.serve_config import load_serve_config
    from controller.server import run_gateway

    _stop_when_orphaned()
    config = load_serve_config(Path(config_path))
    app = RelayApp(config, relay_name(index), socket_path, metrics_dir)
    run_gateway(app, host, port, sockets=[listening_socket(host, port)])


# -- the supervisor -------------------------------------------------------------------------


class RelayGroup:
    """The policy process and N relays, started, watched, drained (module docstring)."""

    def __init__(self, config_path: Path, host: str, port: int, relays: int,
                 log_level: str = "info") -> None:
        if relays < 1:
            raise ValueError(f"relays must be ≥ 1, got {relays}")
        self._config_path = str(config_path.resolve())
        self._host = host
        self._port = port
        self._count = relays
        self._log = make_logger(log_level).bind(process="supervisor")
        self._context = multiprocessing.get_context("spawn")
        self._runtime = Path(tempfile.mkdtemp(prefix="sluice-relays-"))  # mode 0700
        self._metrics_dir = self._runtime / "metrics"
        self._metrics_dir.mkdir()
        self._socket_path = str(self._runtime / "policy.sock")
        self._policy: Any = None
        self._relays: dict[int, Any] = {}
        self._restarts: dict[int, list[float]] = {}  # relay -> when it was started again
        self._placeholder: socket.socket | None = None
        self._stopping = False

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; the exit status (0 after a clean drain)."""
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self._metrics_dir)
        previous = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            return self._serve()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_all()
            if self._placeholder is not None:
                self._placeholder.close()
            shutil.rmtree(self._runtime, ignore_errors=True)

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            if self._policy is not None and self._policy.pid is not None:
                os.kill(self._policy.pid, signal.SIGHUP)  # the config watcher lives there
            return
        self._stopping = True

    def _serve(self) -> int:
        ready = self._context.Event()
        self._policy = self._context.Process(
            target=run_policy_process, name="sluice-policy",
            args=(self._config_path, self._socket_path, str(self._metrics_dir), ready))
        self._policy.start()
        while not ready.wait(WATCH_INTERVAL_S):
            if not self._policy.is_alive() or self._stopping:
                self._log.error("policy process did not start", exitcode=self._policy.exitcode)
                return 1
        # One port for all (with port 0 the kernel picks it for this socket). Bound and never
        # listening, it takes no connection; it holds the port while relays restart.
        self._placeholder = shared_socket(self._host, self._port)
        self._port = self._placeholder.getsockname()[1]
        for index in range(self._count):
            self._start_relay(index)
        self._log.info("gateway starting", host=self._host, port=self._port,
                       relays=self._count, policy_pid=self._policy.pid,
                       relay_pids=[p.pid for p in self._relays.values()])
        while not self._stopping:
            sentinels = [self._policy.sentinel, *(p.sentinel for p in self._relays.values())]
            multiprocessing.connection.wait(sentinels, timeout=WATCH_INTERVAL_S)
            if not self._policy.is_alive():
                self._log.error("policy process died; stopping the gateway",
                                exitcode=self._policy.exitcode)
                return 1
            for index, relay in list(self._relays.items()):
                if not relay.is_alive() and not self._stopping:
                    _mark_dead(relay.pid)
                    now = time.monotonic()
                    recent = [t for t in self._restarts.get(index, [])
                              if now - t < RESTART_WINDOW_S]
                    if len(recent) >= MAX_RESTARTS:
                        self._log.error("relay process keeps dying; stopping the gateway",
                                        relay=relay_name(index), exitcode=relay.exitcode,
                                        restarts=len(recent), window_s=RESTART_WINDOW_S)
                        self._stopping = True
                        self._drain()
                        return 1
                    self._log.error("relay process died; starting it again",
                                    relay=relay_name(index), exitcode=relay.exitcode)
                    self._restarts[index] = [*recent, now]
                    self._start_relay(index)
        self._log.info("gateway stopping", relays=self._count)
        return self._drain()

    def _start_relay(self, index: int) -> None:
        relay = self._context.Process(
            target=run_relay_process, name=f"sluice-{relay_name(index)}",
            args=(index, self._config_path, self._host, self._port, self._socket_path,
                  str(self._metrics_dir)))
        relay.start()
        self._relays[index] = relay

    def _drain(self) -> int:
        """The relays drain first (each its calls' grace); then the policy process stops."""
        for relay in self._relays.values():
            if relay.is_alive():
                os.kill(relay.pid, signal.SIGTERM)
        status = 0
        for index, relay in self._relays.items():
            relay.join()
            if relay.exitcode != 0:
                self._log.error("relay did not stop cleanly", relay=relay_name(index),
                                exitcode=relay.exitcode)
                status = 1
        if self._policy.is_alive():
            os.kill(self._policy.pid, signal.SIGTERM)
        self._policy.join()
        if self._policy.exitcode != 0:
            self._log.error("policy process did not stop cleanly", exitcode=self._policy.exitcode)
            status = 1
        self._log.info("gateway stopped", status=status)
        return status

    def _stop_all(self) -> None:
        """Whatever is still running when :meth:`run` leaves (an error): ended, not orphaned."""
        for process in [*self._relays.values(), self._policy]:
            if process is not None and process.is_alive():
                process.terminate()
                process.join(10)
                if process.is_alive():
                    process.kill()
                    process.join()


def _mark_dead(pid: int | None) -> None:
    """A dead relay's live gauges leave the sums (prometheus_client multiprocess mode)."""
    from prometheus_client import multiprocess

    if pid is not None:
        multiprocess.mark_process_dead(pid)
