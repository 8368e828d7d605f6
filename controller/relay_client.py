"""The relay's HTTP/1.1 client: keep-alive connections to one worker, on asyncio protocols
with httptools' response parser.

Why not httpx here: on the relay path httpx/httpcore cost ~1 ms of CPU per request (request
and URL models, the pool's scan of every connection, anyio streams, h11), more than the rest
of the gateway together. This client does only what the relay needs: POST/GET with a body
already in memory, the answer's status, raw headers and body chunks as they arrive, the
connection back to the pool when the answer was read to its end. (httpx stays for the
workers' health, capacity and model checks: rare calls, where its convenience is worth it.)

Stale connections. A server closes a keep-alive connection it finds idle (uvicorn after
5 s); if that close crosses a new request, the request is lost and the client sees the
connection end without an answer. So:

- idle connections expire after ``idle_expiry_s`` (below the servers' keep-alive), and one
  is never taken from the pool when its end is already known (the loop saw it close, or
  the socket is readable while idle: the server's FIN is waiting in the kernel);
- a connection found closed right before the request would have been written is dropped
  and the request goes out once more on a fresh connection: it provably was not sent.

Errors carry ``sent``: False when the request never left (refused or timed-out connect, no
connection free in time), so the caller may place the call elsewhere.

**Invariants** (cited where kept):

1. A request that may have reached the worker is never sent again (a POST is not
   idempotent): a connection that ends after the request was written is a
   :class:`Disconnected` error (:meth:`WorkerConnections.request`).
2. A connection goes back to the pool only when its answer was read to its end and it can
   carry another (:meth:`WorkerConnections.release`); otherwise it is closed.
3. ``WorkerConnections._open`` counts the pool's connections, those being made included,
   and never exceeds ``max_connections`` (:meth:`WorkerConnections._acquire`).
"""

from __future__ import annotations

import asyncio
import select
import ssl
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

# Reading from a worker pauses when this much of its answer waits unread (the client is slow).
READ_HIGH_WATER = 256 * 1024


class TransportError(Exception):
    """Talking to the worker failed. ``sent`` is False when the request provably never
    reached it; ``timeout`` when the failure was a time limit."""

    sent = True
    timeout = False


class ConnectError(TransportError):
    sent = False


class ConnectTimeout(TransportError):
    sent = False
    timeout = True


class PoolTimeout(TransportError):
    sent = False
    timeout = True


class ReadTimeout(TransportError):
    timeout = True


class WriteTimeout(TransportError):
    timeout = True


class Disconnected(TransportError):
    """The connection ended before the whole answer came."""


class RemoteProtocolError(TransportError):
    """The worker's answer was not valid HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class Limits:
    connect_timeout_s: float
    read_timeout_s: float
    write_timeout_s: float
    pool_timeout_s: float
    max_connections: int
    max_idle_connections: int
    idle_expiry_s: float


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one exchange at a time. The answer's parts are kept on the
    connection (no per-request objects beyond the list of headers and the body chunks)."""

    def __init__(self, pool: WorkerConnections) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.in_exchange = False
        self.idle_since = 0.0
        self.exchanges = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.until_close = False
        self.keep_alive = False
        self.error: TransportError | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.reading_paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.drained: asyncio.Future[None] | None = None
        self.loop = asyncio.get_running_loop()
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.in_exchange:
            self.close()  # bytes nobody asked for: the connection cannot be trusted
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(RemoteProtocolError(f"invalid HTTP from the worker: {err}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.pool.forget(self)
        if self.head_done and self.until_close and exc is None and not self.complete:
            self.complete = True  # a body delimited by the end of the connection
        elif not self.complete:
            detail = f"{type(exc).__name__}: {exc}" if exc else "the worker closed the connection"
            self._fail(Disconnected(detail))
        self._wake()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    # -- httptools callbacks ----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:
            # 1xx: an interim answer (we never send Expect, but a server may); the real
            # head follows and the parser starts a new message for it.
            self.headers = []
            return
        self.head_done = True
        # Read now: after the message completes the parser no longer knows.
        self.keep_alive = self.parser.should_keep_alive()
        delimited = False
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
                delimited = True
                break
        self.until_close = not delimited and self.status not in (204, 304)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > READ_HIGH_WATER and not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True
            self._wake()

    # -- the exchange -----------------------------------------------------------------

    def _fail(self, error: TransportError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def begin(self) -> None:
        self.status = 0
        self.headers = []
        self.head_done = self.complete = self.until_close = self.keep_alive = False
        self.error = None
        self.chunks.clear()
        self.buffered = 0
        self.exchanges += 1
        self.in_exchange = True

    async def wait(self, timeout_s: float, what: str) -> None:
        """Until the parser has news (or the connection ends), at most ``timeout_s``.

        One timer per connection, moved forward lazily: a stream waits once per chunk, and a
        timer made and cancelled per wait would cost more than the rest of the wait."""
        loop = self.loop
        waiter = self.waiter = loop.create_future()
        self.deadline = loop.time() + timeout_s
        if self.timer is None:
            self.timer = loop.call_at(self.deadline, self._check_deadline)
        try:
            await waiter
        except asyncio.TimeoutError:
            raise ReadTimeout(f"no {what} within {timeout_s:g} s") from None
        finally:
            self.waiter = None

    def _check_deadline(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait sets a timer again
        if self.loop.time() >= self.deadline:
            waiter.set_exception(asyncio.TimeoutError())
        else:
            self.timer = self.loop.call_at(self.deadline, self._check_deadline)

    async def drain(self, timeout_s: float) -> None:
        drained = self.drained
        if drained is None:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(drained)
        except TimeoutError:
            raise WriteTimeout(f"the request was not written within {timeout_s:g} s") from None

    def take(self) -> bytes:
        """The body received so far (and reading resumed if it was paused)."""
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return (self.complete and self.keep_alive and not self.closed and not self.chunks
                and self.error is None)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def _readable(conn: _Connection) -> bool:
    """An idle connection with something to read has been closed by the server (or it sent
    bytes nobody asked for): either way it must not carry a request."""
    sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
    if sock is None:
        return False
    poller = select.poll()  # not select.select: it cannot take descriptors above 1023
    try:
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True  # no usable descriptor: treat as gone


class RelayResponse:
    """An answer being received. Read it with :meth:`aread` or :meth:`aiter_raw`, then
    :meth:`aclose` (always): the connection goes back to the pool if the answer was read to
    its end, and is closed otherwise (a client that left mid-stream stops the worker)."""

    __slots__ = ("status_code", "headers", "_conn", "_read_timeout_s")

    def __init__(self, conn: _Connection, read_timeout_s: float) -> None:
        self._conn: _Connection | None = conn
        self.status_code = conn.status
        self.headers = conn.headers
        self._read_timeout_s = read_timeout_s

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        conn = self._conn
        assert conn is not None
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._read_timeout_s, "body bytes")

    async def aread(self) -> bytes:
        parts = [chunk async for chunk in self.aiter_raw()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """What :meth:`aclose` does; it never waits, so it also runs where a cancellation
        is pending (a client that left) without being cut short."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.pool.release(conn)

    async def aclose(self) -> None:
        self.close()


class WorkerConnections:
    """The keep-alive pool of one worker (at most ``max_connections`` open at once).
    ``authorization``: the value of the ``Authorization`` header every request to this worker
    carries (its API key), in place of any the caller passes; None: none is added."""

    def __init__(self, url: str, limits: Limits, authorization: str | None = None) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/").encode()
        default_port = 443 if self.tls else 80
        self.host_header = (self.host if self.port == default_port else f"{self.host}:{self.port}").encode()
        self.limits = limits
        self._authorization = (b"authorization: %s\r\n" % authorization.encode("latin-1")
                               if authorization is not None else None)
        self._ssl = ssl.create_default_context() if self.tls else None
        self._idle: list[_Connection] = []
        self._open = 0
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._closing = False

    # -- connections ------------------------------------------------------------------

    async def _acquire(self) -> tuple[_Connection, bool]:
        """A connection for one exchange: (it, whether it was used before)."""
        loop = asyncio.get_running_loop()
        expiry = self.limits.idle_expiry_s
        while True:
            now = loop.time()
            while self._idle:
                conn = self._idle.pop()  # the most recently used: least likely to be stale
                if conn.closed or now - conn.idle_since > expiry or _readable(conn):
                    conn.close()
                    continue
                return conn, True
            if self._open < self.limits.max_connections:  # invariant 3
                return await self._connect(), False
            await self._wait_for_slot()

    async def _wait_for_slot(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            async with asyncio.timeout(self.limits.pool_timeout_s):
                await waiter
        except TimeoutError:
            raise PoolTimeout(f"no free connection within {self.limits.pool_timeout_s:g} s "
                              f"({self.limits.max_connections} in use)") from None
        finally:
            if waiter in self._slot_waiters:
                self._slot_waiters.remove(waiter)

    def _free_slot(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        self._open += 1
        try:
            # asyncio.timeout, not wait_for: a connection made just as the wait ends must not
            # be lost with the inner task (its socket would stay open, uncounted).
            async with asyncio.timeout(self.limits.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(self), self.host,
                                                       self.port, ssl=self._ssl)
        except TimeoutError:
            self._open -= 1
            self._free_slot()
            raise ConnectTimeout(f"no connection within {self.limits.connect_timeout_s:g} s") from None
        except OSError as err:
            self._open -= 1
            self._free_slot()
            raise ConnectError(f"{type(err).__name__}: {err.strerror or err}") from None
        except BaseException:
            self._open -= 1
            self._free_slot()
            raise
        return conn

    def forget(self, conn: _Connection) -> None:
        """``conn`` has closed (called once, from its ``connection_lost``)."""
        self._open -= 1
        if conn in self._idle:
            self._idle.remove(conn)
        self._free_slot()

    def release(self, conn: _Connection) -> None:
        """The exchange on ``conn`` is over: back to the pool, or closed (invariant 2)."""
        conn.in_exchange = False
        if self._closing or not conn.reusable() or len(self._idle) >= self.limits.max_idle_connections:
            conn.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.append(conn)
        self._free_slot()

    async def aclose(self) -> None:
        self._closing = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- requests ---------------------------------------------------------------------

    async def request(self, method: bytes, path: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes = b"") -> RelayResponse:
        """Send one request and wait for the head of its answer."""
        lines = [b"%s %s%s HTTP/1.1\r\nhost: %s\r\n" % (method, self.prefix, path, self.host_header)]
        authorization = self._authorization
        for name, value in headers:
            if authorization is not None and name.lower() == b"authorization":
                continue  # the worker's own key goes instead (a client's is never its to see)
            lines.append(b"%s: %s\r\n" % (name, value))
        if authorization is not None:
            lines.append(authorization)
        lines.append(b"content-length: %d\r\n\r\n" % len(body))
        lines.append(body)
        data = b"".join(lines)
        fresh_tries = 0
        while True:
            conn, reused = await self._acquire()
            transport = conn.transport
            if conn.closed or transport is None or transport.is_closing():
                # Found dead before a byte of the request was written: it provably was not
                # sent, so it may go out on another connection (once on a fresh one;
                # invariant 1).
                conn.close()
                if not reused:
                    fresh_tries += 1
                    if fresh_tries > 1:
                        raise Disconnected("the worker closed a new connection at once")
                continue
            break
        try:
            conn.begin()
            transport.write(data)
            if conn.drained is not None:
                await conn.drain(self.limits.write_timeout_s)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self.limits.read_timeout_s, "answer")
        except BaseException:
            conn.close()
            raise
        return RelayResponse(conn, self.limits.read_timeout_s)
