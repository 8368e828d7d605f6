"""The gateway benchmark's load generator (bench/gateway.py): raw keep-alive HTTP/1.1
connections on uvloop with httptools' parser, one per closed-loop client, each client its own
``x-session-id`` (so its own program). An httpx client costs more CPU per request than the
gateway being measured and would be the bottleneck.

A request that fails (an error status, a stream cut short) is counted and reported, not timed;
more than ``MAX_FAILURES`` in one phase abort the benchmark.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

from bench.fast_upstream import DONE_EVENT, MODEL

# Failed requests (a 502, a broken stream) are counted, reported and left out of the
# timings; more than this many in one phase abort the benchmark.
MAX_FAILURES = 20


def request_bytes(port: int, session: str, *, stream: bool, usage: bool = True, words: int = 5,
             gap_ms: float = 0.0) -> bytes:
    """One pre-encoded HTTP/1.1 request (sent again and again by its closed-loop client)."""
    body: dict = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are the benchmark's agent. Answer briefly."},
            {"role": "user", "content": f"Say hello to {session}."},
        ],
        "max_tokens": words,
    }
    if stream:
        body["stream"] = True
        if usage:
            body["stream_options"] = {"include_usage": True}
    encoded = json.dumps(body, separators=(",", ":")).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(encoded)}\r\n"
            f"x-session-id: {session}\r\nauthorization: Bearer bench\r\n")
    if gap_ms:
        head += f"x-bench-gap-ms: {gap_ms}\r\n"
    return head.encode() + b"\r\n" + encoded


class RequestFailed(Exception):
    pass


class LoadConnection(asyncio.Protocol):
    """One keep-alive client connection: send a request, wait for the whole response."""

    def __init__(self) -> None:
        import httptools

        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future[tuple[int, bytes]] | None = None
        self._body: list[bytes] = []
        self.first_byte_at = 0.0

    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        import httptools

        if not self.first_byte_at:
            self.first_byte_at = time.perf_counter()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(RequestFailed(f"bad response: {err}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RequestFailed(f"connection closed: {exc}"))

    def _fail(self, err: Exception) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(err)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result((self._parser.get_status_code(), b"".join(self._body)))

    async def request(self, data: bytes) -> tuple[int, bytes]:
        assert self._transport is not None
        if self._transport.is_closing():
            raise RequestFailed("connection closed")
        self._body = []
        self.first_byte_at = 0.0
        self._done = asyncio.get_running_loop().create_future()
        self._transport.write(data)
        return await self._done

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class Load:
    """Closed-loop clients against one target, each on its own connection."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conns: list[LoadConnection] = []
        self.failed = 0
        self.first_failure: str | None = None

    async def connect(self, count: int) -> None:
        loop = asyncio.get_running_loop()
        while len(self.conns) < count:
            _, conn = await loop.create_connection(LoadConnection, "127.0.0.1", self.port)
            self.conns.append(conn)

    async def reconnect(self) -> None:
        """Fresh connections: a server closes idle keep-alive ones (uvicorn after 5 s), and
        the other path's round may have left these idle that long."""
        count = len(self.conns)
        self.close()
        self.conns = []
        await self.connect(count)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()

    async def call(self, i: int, data: bytes, stream: bool) -> tuple[float, float] | None:
        """One request on connection ``i``: (latency, time to first byte) in seconds, or None
        when it failed (counted; too many abort). A failed connection is replaced."""
        start = time.perf_counter()
        try:
            status, body = await self.conns[i].request(data)
            if status != 200 or (stream and not body.endswith(DONE_EVENT)):
                raise RequestFailed(f"answered {status}: {body[-300:]!r}")
        except RequestFailed as err:
            self.failed += 1
            if self.first_failure is None:
                self.first_failure = str(err)
            if self.failed > MAX_FAILURES:
                raise RuntimeError(f"more than {MAX_FAILURES} requests failed; the first: "
                                   f"{self.first_failure}") from err
            self.conns[i].close()
            _, self.conns[i] = await asyncio.get_running_loop().create_connection(
                LoadConnection, "127.0.0.1", self.port)
            return None
        end = time.perf_counter()
        return end - start, self.conns[i].first_byte_at - start

    def failures(self) -> str:
        return f"{self.failed} failed (first: {self.first_failure})" if self.failed else "none failed"


async def window(load: Load, requests: list[bytes], stream: bool, warmup_s: float, window_s: float,
                  meter: Callable[[], float] | None) -> tuple[float, float | None]:
    """Closed loop, one client per request in ``requests``: (completed per second inside the
    window, ``meter``'s CPU seconds per completed request inside it)."""
    await load.connect(len(requests))
    await load.reconnect()
    counting = False
    stop = False
    done = 0

    async def loop(i: int) -> None:
        nonlocal done
        while not stop:
            if await load.call(i, requests[i], stream) is not None and counting:
                done += 1

    async with asyncio.TaskGroup() as tg:
        for i in range(len(requests)):
            tg.create_task(loop(i))
        await asyncio.sleep(warmup_s)
        cpu_before = meter() if meter else 0.0
        counting, start = True, time.perf_counter()
        await asyncio.sleep(window_s)
        counting, elapsed = False, time.perf_counter() - start
        cpu = (meter() - cpu_before) / done if meter and done else None
        stop = True
    return done / elapsed, cpu


async def rounds(load: Load, requests: list[bytes], count: int, think_s: float,
                  seed: int) -> list[tuple[float, float]]:
    """``count`` streams from ``len(requests)`` closed-loop clients, each waiting a random
    time in [0, 2 ``think_s``] before each request: (latency, ttfb) of each stream. Each
    client's first stream of the round is not timed: it opens the connections (the load
    generator's, and the gateway's to the upstream, whose idle ones expired while the other
    path's round ran) — a cost of the round's start, not of a call."""
    await load.connect(len(requests))
    await load.reconnect()
    timings: list[tuple[float, float]] = []
    left = count
    rng = random.Random(seed)

    async def loop(i: int) -> None:
        nonlocal left
        await load.call(i, requests[i], True)
        while left > 0:
            left -= 1
            await asyncio.sleep(rng.uniform(0, 2 * think_s))
            timing = await load.call(i, requests[i], True)
            if timing is not None:
                timings.append(timing)

    async with asyncio.TaskGroup() as tg:
        for i in range(len(requests)):
            tg.create_task(loop(i))
    return timings
