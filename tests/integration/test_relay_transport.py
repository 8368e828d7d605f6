"""The relay's transport against real sockets on loopback: connections are reused,
an idle one the worker has closed is never sent a request (the stale keep-alive fault), idle
ones expire before the worker's keep-alive does, and a refused connection is told apart from
a failure after the request was sent (:class:`controller.upstream.WorkerUnreachable`)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from controller.errors import GatewayError
from controller.relay_client import Disconnected, Limits, ReadTimeout, WorkerConnections
from controller.serve_config import UpstreamConfig, WorkerConfig
from controller.upstream import UpstreamPool, WorkerUnreachable, open_upstream
from entry.ports import free_port
from tests.support.fake_vllm import FakeState, create_fake
from tests.support.gateway_harness import ServerThread, chat, fakes, gateway, serve_config, wait_for

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
# A stream that sends one event and then nothing more.
STALLED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           b"d\r\ndata: first\n\n\r\n")


def _limits(idle_expiry_s: float = 30.0) -> Limits:
    return Limits(connect_timeout_s=2, read_timeout_s=2, write_timeout_s=2, pool_timeout_s=2,
                  max_connections=8, max_idle_connections=8, idle_expiry_s=idle_expiry_s)


class TinyServer:
    """Blocking sockets in threads: answers every request with ``ANSWER`` on a keep-alive
    connection; :meth:`close_idle` shuts its connections at once (FIN sent before it returns),
    as a server whose keep-alive ran out does. ``mode="hang_up"`` reads a request and closes
    without answering; ``mode="stall"`` starts a stream and never goes on."""

    def __init__(self, mode: str = "answer") -> None:
        self.mode = mode
        self.connections: list[socket.socket] = []
        self.requests = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                self.connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        try:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buffer += data
                while b"\r\n\r\n" in buffer:
                    head, _, rest = buffer.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    if len(rest) < length:
                        break
                    buffer = rest[length:]
                    with self._lock:
                        self.requests += 1
                    if self.mode == "hang_up":
                        conn.close()
                        return
                    conn.sendall(STALLED if self.mode == "stall" else ANSWER)
        except OSError:
            return  # closed by close_idle or the client

    def close_idle(self) -> None:
        with self._lock:
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by the client
                conn.close()

    def stop(self) -> None:
        self._listener.close()
        self.close_idle()


@pytest.fixture
def tiny():
    server = TinyServer()
    yield server
    server.stop()


async def _get(pool: WorkerConnections) -> bytes:
    response = await pool.request(b"GET", b"/health", [])
    try:
        return await response.aread()
    finally:
        await response.aclose()


def test_connections_are_kept_alive_and_reused(tiny):
    async def main() -> None:
        pool = WorkerConnections(tiny.url, _limits())
        for _ in range(5):
            assert await _get(pool) == b"ok"
        await pool.aclose()

    asyncio.run(main())
    assert tiny.requests == 5 and len(tiny.connections) == 1


def test_an_idle_connection_the_worker_closed_is_not_sent_a_request(tiny):
    """The stale keep-alive fault: the worker's close has reached this machine but the event
    loop has not run since, so the pooled connection still looks open. Writing the request
    on it would lose it (a 502); the pool sees the close waiting on the socket and uses a
    fresh connection."""

    async def main() -> None:
        pool = WorkerConnections(tiny.url, _limits())
        assert await _get(pool) == b"ok"
        tiny.close_idle()
        time.sleep(0.1)  # blocks the loop: the FIN waits in the kernel, unseen by asyncio
        assert await _get(pool) == b"ok"
        await pool.aclose()

    asyncio.run(main())
    assert tiny.requests == 2 and len(tiny.connections) == 2


def test_idle_connections_expire_before_the_workers_keep_alive(tiny):
    async def main() -> None:
        pool = WorkerConnections(tiny.url, _limits(idle_expiry_s=0.1))
        assert await _get(pool) == b"ok"
        await asyncio.sleep(0.25)
        assert await _get(pool) == b"ok"
        await pool.aclose()

    asyncio.run(main())
    assert tiny.requests == 2 and len(tiny.connections) == 2


def test_the_default_idle_expiry_is_below_uvicorns_keep_alive():
    pool = UpstreamPool([WorkerConfig(name="w0", url="http://127.0.0.1:1")], UpstreamConfig())
    assert pool.relay("w0").limits.idle_expiry_s < 5.0


def test_a_refused_connection_is_worker_unreachable_naming_the_worker():
    async def main() -> None:
        pool = UpstreamPool([WorkerConfig(name="gone", url=f"http://127.0.0.1:{free_port()}")],
                            UpstreamConfig(connect_timeout_s=2))
        with pytest.raises(WorkerUnreachable) as caught:
            await open_upstream(pool, "gone", b"/v1/chat/completions", b"{}", [])
        assert caught.value.worker == "gone"
        assert caught.value.status == 502 and "cannot reach worker gone" in caught.value.message
        await pool.aclose()

    asyncio.run(main())


def test_a_request_lost_after_it_was_sent_is_not_worker_unreachable():
    """The worker read the request and hung up: it may have run it, so the call must not be
    placed again (nor sent again by the transport)."""
    server = TinyServer(mode="hang_up")

    async def main() -> None:
        pool = UpstreamPool([WorkerConfig(name="w0", url=server.url)], UpstreamConfig())
        with pytest.raises(GatewayError) as caught:
            await open_upstream(pool, "w0", b"/v1/chat/completions", b"{}", [])
        assert not isinstance(caught.value, WorkerUnreachable)
        assert caught.value.status == 502
        await pool.aclose()

    try:
        asyncio.run(main())
    finally:
        server.stop()
    assert server.requests == 1  # sent once, never again


def test_a_hang_up_surfaces_as_disconnected_from_the_pool():
    server = TinyServer(mode="hang_up")

    async def main() -> None:
        pool = WorkerConnections(server.url, _limits())
        with pytest.raises(Disconnected):
            await _get(pool)
        await pool.aclose()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_a_stream_that_stops_sending_times_out_between_chunks():
    """The read timeout counts from the last chunk, on a timer the connection moves forward
    lazily (so it must still fire)."""
    server = TinyServer(mode="stall")

    async def main() -> None:
        limits = Limits(connect_timeout_s=2, read_timeout_s=0.3, write_timeout_s=2, pool_timeout_s=2,
                        max_connections=8, max_idle_connections=8, idle_expiry_s=30)
        pool = WorkerConnections(server.url, limits)
        response = await pool.request(b"POST", b"/v1/chat/completions", [], b"{}")
        chunks = []
        started = time.monotonic()
        with pytest.raises(ReadTimeout):
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
        assert chunks == [b"data: first\n\n"]
        assert 0.25 < time.monotonic() - started < 2.0
        await response.aclose()
        await pool.aclose()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_a_client_leaving_during_its_upload_is_a_499_not_an_unhandled_error():
    with fakes("w0") as started:
        workers = [{"name": f.name, "url": s.url, "capacity_tokens": 1_000_000} for f, s in started]
        with gateway(serve_config(workers)) as gw:
            with socket.create_connection(("127.0.0.1", gw.server.port)) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                             b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                             b'{"model": "fake-model",')
                time.sleep(0.1)
            lines = wait_for(lambda: [line for line in gw.log.lines() if '"client disconnected"' in line],
                             what="the disconnect logged")
            assert '"stage": "upload"' in lines[0] or '"stage":"upload"' in lines[0]
            assert "unhandled error" not in gw.log.getvalue()
            metrics = gw.client.get("/metrics").text
            assert 'sluice_requests_total{route="/v1/chat/completions",status="499"} 1.0' in metrics


def test_gateway_survives_a_worker_closing_idle_connections_before_the_gateway_does():
    """The worker's keep-alive (0.2 s) is shorter than the gateway's idle expiry: every call
    after a pause finds its pooled connection closed by the worker, and must still get 200."""
    fake = FakeState("w0")
    server = ServerThread(create_fake(fake))
    server.server.config.timeout_keep_alive = 0.2
    server.start()
    try:
        config = serve_config([{"name": "w0", "url": server.url, "capacity_tokens": 1_000_000}])
        with gateway(config) as gw:
            for i in range(3):
                r = gw.client.post("/v1/chat/completions", json=chat(f"call {i}"),
                                   headers={"x-session-id": "stale"})
                assert r.status_code == 200, r.text
                time.sleep(0.5)
            stream = gw.client.post("/v1/chat/completions", json=chat("last", stream=True),
                                    headers={"x-session-id": "stale"})
            assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    finally:
        server.stop()


def test_gateway_logs_a_refused_worker_as_unreachable_with_its_name():
    with fakes("w0"):
        dead = f"http://127.0.0.1:{free_port()}"
        config = serve_config([{"name": "dead", "url": dead, "capacity_tokens": 1_000_000}])
        with gateway(config) as gw:
            r = gw.client.post("/v1/chat/completions", json=chat(), headers={"x-session-id": "s"})
            assert r.status_code == 502 and "cannot reach worker dead" in r.json()["error"]["message"]
            assert any('"worker unreachable"' in line and '"worker":"dead"' in line.replace(" ", "")
                       for line in gw.log.lines())
