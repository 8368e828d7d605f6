"""A small real upstream for the gateway's tests: a Starlette app that speaks the OpenAI
(chat/completions, completions, responses) and Anthropic (messages) shapes, streaming and
not, and records what reached it.

It is not an engine model (that is ``simworker/``): answers are fixed filler, and the
test steers each call with request headers, which the gateway forwards like any other:

- ``x-test-status: N``       answer status N with a JSON error body
- ``x-test-delay-s: S``      wait S seconds before answering
- ``x-test-chunks: N``       content chunks in a stream (default 3)
- ``x-test-chunk-delay-s: S`` pause between stream chunks
- ``x-test-prompt-tokens: N`` the prompt_tokens it reports (default 10 per message)
- ``x-test-cached-tokens: N`` the cached tokens it reports (default 0)
- ``x-test-break-after: N``  cut the stream's connection after N events (a dying worker)

``POST /v1/messages/count_tokens`` answers ``{"input_tokens": 10 per message}`` and is
recorded in ``FakeState.counted`` (not ``seen``: it is not a call); ``serves_count_tokens``
False makes it a 404 like a vLLM without the route. ``models_status`` other than 200 makes
``GET /v1/models`` fail with that status.

Everything it saw and sent is on :class:`FakeState` (thread-safe enough for tests: lists
appended from the server thread, read from the test thread).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeState:
    name: str
    model: str = "fake-model"
    healthy: bool = True
    # None: /metrics says num_gpu_blocks="None" (not profiled yet)
    num_gpu_blocks: int | None = 1000
    block_size: int = 16
    seen: list[Seen] = field(default_factory=list)
    # request id -> the exact bytes of the stream sent
    streams: dict[str, bytes] = field(default_factory=dict)
    # session ids whose stream was cut by the client before it ended
    disconnects: list[str] = field(default_factory=list)
    disconnected: threading.Event = field(default_factory=threading.Event)
    completed: list[str] = field(default_factory=list)
    # count_tokens requests (headers and body) this worker answered
    counted: list[Seen] = field(default_factory=list)
    serves_count_tokens: bool = True
    models_status: int = 200

    def sessions(self) -> list[str]:
        return [s.body.get("session_id") for s in self.seen]


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _event(kind: str, obj: Any) -> bytes:
    return f"event: {kind}\n".encode() + _sse(obj)


def create_fake(state: FakeState) -> Starlette:
    async def complete(request: Request) -> Response:
        body = await request.json()
        headers = {k.lower(): v for k, v in request.headers.items()}
        state.seen.append(Seen(request.url.path, headers, body))
        delay = float(headers.get("x-test-delay-s", "0"))
        if delay:
            deadline = asyncio.get_running_loop().time() + delay
            while asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
                if await request.is_disconnected():
                    state.disconnects.append(body.get("session_id"))
                    state.disconnected.set()
                    return Response(status_code=499)
        status = int(headers.get("x-test-status", "200"))
        if status != 200:
            return JSONResponse({"error": {"message": f"fake {state.name} failed on purpose",
                                           "type": "fake", "code": status}}, status_code=status)
        n_messages = len(body.get("messages") or body.get("input") or [1])
        prompt = int(headers.get("x-test-prompt-tokens", str(10 * n_messages)))
        cached = int(headers.get("x-test-cached-tokens", "0"))
        completion = body.get("max_tokens") or body.get("max_completion_tokens") or 5
        rid = f"{state.name}-{uuid.uuid4().hex[:8]}"
        path = request.url.path
        extra = {"x-worker": state.name, "x-fake-request-id": rid}
        if body.get("stream"):
            chunks = int(headers.get("x-test-chunks", "3"))
            pause = float(headers.get("x-test-chunk-delay-s", "0"))
            maker = {"/v1/chat/completions": _chat_stream, "/v1/completions": _chat_stream,
                     "/v1/responses": _responses_stream, "/v1/messages": _messages_stream}[path]
            events = maker(state, rid, body, prompt, completion, cached, chunks)
            cut = int(headers.get("x-test-break-after", "0")) or None
            return StreamingResponse(_pace(state, rid, body, events, pause, cut),
                                     media_type="text/event-stream", headers=extra)
        maker = {"/v1/chat/completions": _chat_body, "/v1/completions": _chat_body,
                 "/v1/responses": _responses_body, "/v1/messages": _messages_body}[path]
        state.completed.append(rid)
        return JSONResponse(maker(state, rid, prompt, completion, cached), headers=extra)

    async def health(request: Request) -> Response:
        if state.healthy:
            return PlainTextResponse("")
        return PlainTextResponse("down", status_code=503)

    async def metrics(request: Request) -> Response:
        blocks = "None" if state.num_gpu_blocks is None else str(state.num_gpu_blocks)
        text = (
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{state.block_size}",cache_dtype="auto",'
            f'enable_prefix_caching="True",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{state.model}"}} 0.0\n'
        )
        return PlainTextResponse(text)

    async def count_tokens(request: Request) -> Response:
        if not state.serves_count_tokens:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await request.json()
        headers = {k.lower(): v for k, v in request.headers.items()}
        state.counted.append(Seen(request.url.path, headers, body))
        return JSONResponse({"input_tokens": 10 * len(body.get("messages") or [1])},
                            headers={"x-worker": state.name})

    async def models(request: Request) -> Response:
        if state.models_status != 200:
            return JSONResponse({"error": {"message": "models unavailable", "type": "fake",
                                           "code": state.models_status}},
                                status_code=state.models_status)
        return JSONResponse({"object": "list", "data": [
            {"id": state.model, "object": "model", "owned_by": state.name}]})

    return Starlette(routes=[
        Route("/v1/chat/completions", complete, methods=["POST"]),
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/responses", complete, methods=["POST"]),
        Route("/v1/messages", complete, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", models),
    ])


class WorkerDied(Exception):
    """Raised mid-stream on purpose: uvicorn then drops the connection unfinished."""


async def _pace(state: FakeState, rid: str, body: dict, events: list[bytes], pause: float,
                cut: int | None = None):
    sent = bytearray()
    finished = False
    try:
        for n, event in enumerate(events):
            if cut is not None and n == cut:
                raise WorkerDied(f"{state.name} cut the stream after {cut} events")
            if pause:
                await asyncio.sleep(pause)
            sent += event
            yield event
        finished = True
    finally:
        state.streams[rid] = bytes(sent)
        if finished:
            state.completed.append(rid)
        else:
            state.disconnects.append(body.get("session_id"))
            state.disconnected.set()


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def _chat_body(state: FakeState, rid: str, prompt: int, completion: int, cached: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": 1, "model": state.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x " * completion},
                         "finish_reason": "length"}],
            "usage": _usage(prompt, completion, cached)}


def _chat_stream(state, rid, body, prompt, completion, cached, chunks) -> list[bytes]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": 1, "model": state.model}
    events = [_sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})]
    for i in range(chunks):
        events.append(_sse({**base, "choices": [{"index": 0, "delta": {"content": f"tok{i} "},
                                                 "finish_reason": None}]}))
    events.append(_sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        events.append(_sse({**base, "choices": [], "usage": _usage(prompt, completion, cached)}))
    events.append(b"data: [DONE]\n\n")
    return events


def _responses_body(state, rid, prompt, completion, cached) -> dict:
    return {"id": f"resp_{rid}", "object": "response", "model": state.model, "status": "completed",
            "output": [{"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": "x"}]}],
            "usage": {"input_tokens": prompt, "output_tokens": completion,
                      "total_tokens": prompt + completion,
                      "input_tokens_details": {"cached_tokens": cached}}}


def _responses_stream(state, rid, body, prompt, completion, cached, chunks) -> list[bytes]:
    done = _responses_body(state, rid, prompt, completion, cached)
    created = {**done, "status": "in_progress", "usage": None, "output": []}
    events = [_event("response.created", {"type": "response.created", "response": created})]
    for i in range(chunks):
        events.append(_event("response.output_text.delta",
                             {"type": "response.output_text.delta", "delta": f"tok{i} "}))
    events.append(_event("response.completed", {"type": "response.completed", "response": done}))
    return events


def _messages_body(state, rid, prompt, completion, cached) -> dict:
    return {"id": f"msg_{rid}", "type": "message", "role": "assistant", "model": state.model,
            "content": [{"type": "text", "text": "x"}], "stop_reason": "max_tokens",
            "usage": {"input_tokens": prompt - cached, "output_tokens": completion,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}


def _messages_stream(state, rid, body, prompt, completion, cached, chunks) -> list[bytes]:
    message = {**_messages_body(state, rid, prompt, completion, cached), "content": []}
    message["usage"] = {**message["usage"], "output_tokens": 1}
    events = [_event("message_start", {"type": "message_start", "message": message})]
    for i in range(chunks):
        events.append(_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                     "delta": {"type": "text_delta", "text": f"t{i}"}}))
    events.append(_event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": "max_tokens"},
                                           "usage": {"output_tokens": completion}}))
    events.append(_event("message_stop", {"type": "message_stop"}))
    return events
