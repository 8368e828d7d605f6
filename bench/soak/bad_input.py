"""The bad-input fault: oversized and over-many headers, malformed and oversized bodies, and
slow clients, sent raw to the gateway; what each got, against the clear refusal expected."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio

from bench.soak.config import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_BODY_BYTES


async def raw_exchange(host: str, port: int, payload: bytes, wait_s: float) -> str:
    """Send ``payload`` on a fresh connection and read until the server closes it or
    ``wait_s`` passes: ``"STATUS"`` of its answer with ``+json`` when the body is a JSON
    error, else ``"closed"`` (closed without a byte), ``"reset"`` or ``"no answer"``."""
    received = b""
    ended = False
    try:
        async with await anyio.connect_tcp(host, port) as stream:
            if payload:
                await stream.send(payload)
            with anyio.move_on_after(wait_s):
                while not _complete_answer(received):
                    try:
                        received += await stream.receive(65536)
                    except anyio.EndOfStream:
                        ended = True
                        break
    except (ConnectionResetError, BrokenPipeError, anyio.BrokenResourceError):
        if not received:
            return "reset"
    if not received:
        return "closed" if ended else "no answer"
    status = re.match(rb"HTTP/1\.[01] (\d{3})", received)
    if status is None:
        return "garbled answer"
    body = received.partition(b"\r\n\r\n")[2]
    try:
        data = json.loads(body)
    except ValueError:
        return status.group(1).decode()
    return status.group(1).decode() + ("+json" if isinstance(data, dict) and "error" in data else "")


def _complete_answer(received: bytes) -> bool:
    head, separator, body = received.partition(b"\r\n\r\n")
    if not separator:
        return False
    length = re.search(rb"(?i)content-length:\s*(\d+)", head)
    return length is not None and len(body) >= int(length.group(1))


async def silent_connection(host: str, port: int, wait_s: float) -> str:
    """A client that connects and sends nothing: the gateway should close it."""
    started = time.monotonic()
    async with await anyio.connect_tcp(host, port) as stream:
        with anyio.move_on_after(wait_s):
            try:
                data = await stream.receive(65536)
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError,
                    ConnectionResetError):
                return f"closed after {time.monotonic() - started:.0f} s"
            return f"answered {data[:12]!r}"
    return "no answer"


def _request(path: str, body: bytes, extra_headers: str = "", content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra_headers}Connection: close\r\n\r\n").encode() + body


BAD_INPUT_EXPECTED = {
    "oversized header": {"431+json"},
    "too many headers": {"431+json"},
    "malformed JSON body": {"400+json"},
    "wrong field types": {"400+json"},
    "oversized body": {"413+json"},
    "bad session id": {"400+json"},
    "partial headers then silence": {"408+json"},
    "partial body then silence": {"408+json"},
}


async def bad_input_burst(gateway_url: str, rounds: int) -> dict[str, Any]:
    """Every kind of bad input ``rounds`` times at once; what each got, and which answers
    were not the expected clear refusal."""
    host, port_text = gateway_url.removeprefix("http://").split(":")
    port = int(port_text)
    chat = "/v1/chat/completions"
    valid = json.dumps({"model": "sluice-sim", "max_tokens": 8,
                        "messages": [{"role": "user", "content": "hello"}]}).encode()
    probes: dict[str, Callable[[], Any]] = {
        "oversized header": lambda: raw_exchange(
            host, port, _request(chat, valid, f"X-Padding: {'a' * 200_000}\r\n"), 30),
        "too many headers": lambda: raw_exchange(
            host, port, _request(chat, valid, "".join(f"X-H{i}: v\r\n" for i in range(300))), 30),
        "malformed JSON body": lambda: raw_exchange(host, port, _request(chat, b'{"model": "sluice-sim", "mess'), 30),
        "wrong field types": lambda: raw_exchange(
            host, port, _request(chat, b'{"model": 5, "messages": "not a list", "max_tokens": "x"}'), 30),
        "oversized body": lambda: raw_exchange(
            host, port, _request(chat, b'{"model": "sluice-sim", "pad": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}'), 30),
        "bad session id": lambda: raw_exchange(
            host, port, _request(chat, valid, f"x-session-id: {'s' * 5000}\r\n"), 30),
        "partial headers then silence": lambda: raw_exchange(
            host, port, f"POST {chat} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode(), HEADER_TIMEOUT_S + 15),
        "partial body then silence": lambda: raw_exchange(
            host, port, _request(chat, b'{"model": "slu', content_length=1000), BODY_TIMEOUT_S + HEADER_TIMEOUT_S + 15),
    }
    outcomes: dict[str, Counter[str]] = {name: Counter() for name in [*probes, "silent connection"]}

    async def one(name: str, probe: Callable[[], Any]) -> None:
        outcomes[name][await probe()] += 1

    async def silent() -> None:
        outcome = await silent_connection(host, port, HEADER_TIMEOUT_S + 15)
        outcomes["silent connection"]["closed" if outcome.startswith("closed") else outcome] += 1

    async with anyio.create_task_group() as tasks:
        for _ in range(rounds):
            for name, probe in probes.items():
                tasks.start_soon(one, name, probe)
            tasks.start_soon(silent)
    unexpected = {}
    for name, counts in outcomes.items():
        expected = BAD_INPUT_EXPECTED.get(name, {"closed"})
        wrong = {outcome: n for outcome, n in counts.items() if outcome not in expected}
        if wrong:
            unexpected[name] = wrong
    return {"rounds": rounds, "outcomes": {k: dict(v) for k, v in outcomes.items()},
            "unexpected": unexpected}
