"""Real servers on loopback for the integration tests (imported by the test modules): each app runs in uvicorn on a free
port in a thread of its own (its own event loop), and tests talk to it with real httpx
clients."""

from __future__ import annotations

import asyncio
import io
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

from controller.gateway import create_app
from controller.serve_config import ServeConfig, parse_serve_config
from scheduler.config import ConfigError
from tests.support.fake_vllm import FakeState, create_fake

ADMIN_TOKEN = "test-admin-token-123"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class ServerThread:
    def __init__(self, app: Any, port: int = 0) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                access_log=False, lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.port = 0

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.005)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class LogSink(io.StringIO):
    """Collects the gateway's JSON log lines."""

    def lines(self) -> list[str]:
        return self.getvalue().splitlines()


@contextmanager
def fakes(*names: str, **state: Any) -> Iterator[list[tuple[FakeState, ServerThread]]]:
    started = []
    try:
        for name in names:
            fake = FakeState(name, **state)
            started.append((fake, ServerThread(create_fake(fake)).start()))
        yield started
    finally:
        for _, server in started:
            server.stop()


def serve_config(workers: list[dict], **overrides: Any) -> ServeConfig:
    data: dict[str, Any] = {
        "admin_token": ADMIN_TOKEN,
        "admin_token_env": None,
        "health_interval_s": 30.0,
        "capacity_retry_s": 0.1,
        "reload_poll_s": 0,
        # the fake workers are steered by x-test-* headers, which a gateway forwards only when
        # its config names them
        "forward_client_headers": ["x-test-*"],
        "workers": workers,
    }
    data.update(overrides)
    return parse_serve_config(data)


class Gateway:
    def __init__(self, server: ServerThread, app: Any, log: LogSink) -> None:
        self.server = server
        self.app = app
        self.log = log
        self.client = httpx.Client(base_url=server.url, timeout=10, trust_env=False)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def parts(self):
        return self.app.state.sluice

    def programs(self) -> dict[str, dict]:
        r = self.client.get("/sluice/programs", headers=ADMIN)
        r.raise_for_status()
        return {p["session_id"]: p for p in r.json()["programs"]}

    def workers(self) -> dict[str, dict]:
        r = self.client.get("/sluice/workers", headers=ADMIN)
        r.raise_for_status()
        return {w["name"]: w for w in r.json()["workers"]}

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@contextmanager
def gateway(config: ServeConfig, port: int = 0) -> Iterator[Gateway]:
    log = LogSink()
    app = create_app(config, log_stream=log)
    server = ServerThread(app, port).start()
    gw = Gateway(server, app, log)
    try:
        yield gw
    finally:
        gw.close()


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def read_http_answer(sock: socket.socket) -> bytes:
    """One HTTP/1.1 answer of known length (head and Content-Length body) off a kept-alive
    connection: what came before the connection closed (b"" if it closed first)."""
    received = bytearray()
    while b"\r\n\r\n" not in received:
        data = sock.recv(65536)
        if not data:
            return bytes(received)
        received += data
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        data = sock.recv(65536)
        if not data:
            break
        body += data
    return head + b"\r\n\r\n" + body


def chat(content: str = "hello", **extra: Any) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **extra}


@contextmanager
def applier_stalled(gw: "Gateway", release_timeout_s: float = 5.0) -> Iterator[None]:
    """Stall the gateway's KV-event applier while the block runs: hold the admission lock on
    the gateway's own event loop (batches are read and queued, none applied)."""
    loop = gw.server.server.servers[0].get_loop()
    release = threading.Event()

    async def hold_lock() -> None:
        async with gw.parts.admission._lock:
            while not release.is_set():
                await asyncio.sleep(0.01)

    held = asyncio.run_coroutine_threadsafe(hold_lock(), loop)
    try:
        yield
    finally:
        release.set()
        held.result(release_timeout_s)


def startup_error(config: ServeConfig) -> str:
    """The ConfigError that stops ``config``'s gateway from starting (its lifespan run alone,
    no listener)."""
    app = create_app(config, log_stream=LogSink())

    async def start() -> None:
        async with app.router.lifespan_context(app):
            pass

    with pytest.raises(BaseException) as failed:
        anyio.run(start)
    found = failed.value
    while isinstance(found, BaseExceptionGroup):
        found = found.exceptions[0]
    assert isinstance(found, ConfigError), repr(failed.value)
    return str(found)
