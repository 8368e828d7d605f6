"""The gateway benchmark's fast upstream (bench/gateway.py): a raw asyncio HTTP/1.1 server on
uvloop with httptools' parser, OpenAI-shaped chat completions with no model, started as
``python -m bench.fast_upstream PORT``.

A non-streaming answer is one pre-encoded ``chat.completion`` body with usage. A stream
(chunked, as vLLM sends it) is the role chunk, ``max_tokens`` content chunks, the
``finish_reason`` chunk, the usage-only chunk when the request asks for it, then
``data: [DONE]``; each event is its own write, and with an ``x-bench-gap-ms`` header the events
are that far apart (each at its own time from the start of the stream), as an engine's tokens
are. ``GET /health`` answers 200 and ``GET /v1/models`` names the model, as vLLM does (the
gateway checks each call's model against that list). It is raw so that it costs little of the
core it shares with the load generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

from bench.common import run_loop

MODEL = "bench-fast"
_CREATED = 1_700_000_000


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": _CREATED,
            "model": MODEL, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}]}


_USAGE = {"prompt_tokens": 24, "completion_tokens": 6, "total_tokens": 30,
          "prompt_tokens_details": {"cached_tokens": 16}}
_WORDS = ("Hello", " from", " the", " fast", " upstream")
ROLE_EVENT = _sse(_chunk({"role": "assistant", "content": ""}))
WORD_EVENTS = tuple(_sse(_chunk({"content": word})) for word in _WORDS)
FINISH_EVENT = _sse(_chunk({}, "stop"))
USAGE_EVENT = _sse({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": _CREATED,
                    "model": MODEL, "choices": [], "usage": _USAGE})
DONE_EVENT = b"data: [DONE]\n\n"
WHOLE_BODY = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": _CREATED, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(_WORDS)},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": _USAGE,
}, separators=(",", ":")).encode()


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_WHOLE_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                   + str(len(WHOLE_BODY)).encode() + b"\r\n\r\n" + WHOLE_BODY)
_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
_HEALTH_RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
_MODELS_BODY = json.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": _CREATED, "owned_by": "bench"}]}).encode()
_MODELS_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                    + str(len(_MODELS_BODY)).encode() + b"\r\n\r\n" + _MODELS_BODY)
_NOT_FOUND_RESPONSE = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
_BAD_RESPONSE = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n"
_STREAM_ROLE = _http_chunk(ROLE_EVENT)
_STREAM_WORDS = tuple(_http_chunk(event) for event in WORD_EVENTS)
_STREAM_END = _http_chunk(FINISH_EVENT)
_STREAM_USAGE = _http_chunk(USAGE_EVENT)
_STREAM_DONE = _http_chunk(DONE_EVENT) + b"0\r\n\r\n"


class UpstreamProtocol(asyncio.Protocol):
    """One keep-alive connection to the fast upstream (requests answered in order)."""

    def __init__(self) -> None:
        import httptools

        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self._gap_s = 0.0
        self._header_name = b""
        self._queue: list[tuple[bytes, bytes, bytes, float]] = []
        self._busy = False

    def connection_made(self, transport: Any) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.write(_BAD_RESPONSE)
            self._transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url, self._body, self._gap_s = b"", [], 0.0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-bench-gap-ms":
            self._gap_s = float(value) / 1e3

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._queue.append((self._parser.get_method(), self._url, b"".join(self._body), self._gap_s))
        if not self._busy:
            self._busy = True
            asyncio.get_running_loop().create_task(self._answer_queued())

    async def _answer_queued(self) -> None:
        try:
            while self._queue:
                await self._answer(*self._queue.pop(0))
        finally:
            self._busy = False

    async def _answer(self, method: bytes, url: bytes, body: bytes, gap_s: float) -> None:
        transport = self._transport
        assert transport is not None
        if method == b"GET" and url == b"/health":
            transport.write(_HEALTH_RESPONSE)
            return
        if method == b"GET" and url == b"/v1/models":
            transport.write(_MODELS_RESPONSE)
            return
        if method != b"POST" or url != b"/v1/chat/completions":
            transport.write(_NOT_FOUND_RESPONSE)
            return
        try:
            request = json.loads(body)
        except ValueError:
            transport.write(_BAD_RESPONSE)
            return
        if request.get("stream") is not True:
            transport.write(_WHOLE_RESPONSE)
            return
        options = request.get("stream_options")
        with_usage = isinstance(options, dict) and options.get("include_usage") is True
        words = request.get("max_tokens") or len(_STREAM_WORDS)
        transport.write(_STREAM_HEAD + _STREAM_ROLE)
        # Each event at its own time from the start, as an engine's steps come: a late wake-up
        # (this process shares its core) delays one event, not every event after it.
        start = asyncio.get_running_loop().time()
        for i in range(words):
            if gap_s:
                await asyncio.sleep(start + (i + 1) * gap_s - asyncio.get_running_loop().time())
            if transport.is_closing():
                return  # the gateway went away mid-stream
            transport.write(_STREAM_WORDS[i % len(_STREAM_WORDS)])
        transport.write(_STREAM_END)
        if with_usage:
            transport.write(_STREAM_USAGE)
        transport.write(_STREAM_DONE)


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(UpstreamProtocol, "127.0.0.1", port,
                                                            backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m bench.fast_upstream PORT (the benchmark itself: "
                 "python -m bench --only gateway)")
    with contextlib.suppress(KeyboardInterrupt):
        run_loop(serve(int(sys.argv[1])))
