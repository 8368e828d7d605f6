"""A call in the simworker, and what each API it serves (its *shape*) implements.

:class:`Call` is one request in the engine as the API layer sees it; :func:`parse_params`
reads the fields every API shares (stream, output limit, session id, vLLM's extra args);
:class:`CallShape` is what an API provides: how a request body becomes a prompt, and how
the call's progress becomes that API's body, stream events and errors. The shapes are
``OpenAICompletions`` (simworker/worker.py) and those of simworker/apis.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
from starlette.responses import JSONResponse, Response

from sim.engine import EngineRequest
from sim.tokens import PseudoTokenizer

SESSION_HEADER = "x-session-id"


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
        status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


@dataclass(frozen=True, slots=True)
class CallParams:
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int | None
    session_id: str | None
    continuation_id: str | None
    report_full: bool
    cache_salt: str | None
    seed: int | None
    model: str | None
    # The Anthropic and Responses APIs: the reply's own length is ``default_max_tokens`` and
    # ``max_tokens`` only cuts it (Anthropic requires one on every call, often 32k; taking it
    # as the length, as chat does, would make every such reply that long).
    max_is_limit: bool = False


# Per API: the fields that bound the output, in the order they are read.
_MAX_TOKEN_KEYS = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completion": ("max_tokens",),
    "messages": ("max_tokens",),
    "responses": ("max_output_tokens",),
}


def _opt(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"'{key}' must be {what}", key)
    return value


def parse_params(kind: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> CallParams:
    """The request fields the simworker acts on (``kind``: "chat", "completion", "messages"
    or "responses")."""
    stream = _opt(body, "stream", bool, "a boolean") or False
    openai_stream = kind in ("chat", "completion")  # the others always report usage
    options = (_opt(body, "stream_options", dict, "an object") or {}) if openai_stream else {}
    include_usage = bool(options.get("include_usage")) and stream
    continuous = bool(options.get("continuous_usage_stats")) and stream
    max_tokens = None
    for key in _MAX_TOKEN_KEYS[kind]:
        value = _opt(body, key, int, "an integer ≥ 1")
        if value is not None:
            if value < 1:
                raise BadRequest(f"'{key}' must be ≥ 1, got {value}", key)
            max_tokens = value
            break
    if kind == "messages" and max_tokens is None:
        raise BadRequest("max_tokens: Field required", "max_tokens")
    n = _opt(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise BadRequest("the simworker serves n=1 only", "n")
    xargs = _opt(body, "vllm_xargs", dict, "an object") or {}
    session_id = _opt(body, "session_id", str, "a string")
    if not session_id:
        session_id = headers.get(SESSION_HEADER) or None
    if not session_id:
        value = xargs.get("session_id")
        session_id = value if isinstance(value, str) and value else None
    continuation = xargs.get("continuation_id")
    if continuation is not None and not isinstance(continuation, str):
        raise BadRequest("'vllm_xargs.continuation_id' must be a string", "vllm_xargs.continuation_id")
    return CallParams(
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens=max_tokens,
        session_id=session_id,
        continuation_id=continuation or None,
        report_full=xargs.get("kv_cache_report_mode") == "full",
        cache_salt=_opt(body, "cache_salt", str, "a string"),
        seed=_opt(body, "seed", int, "an integer"),
        model=_opt(body, "model", str, "a string"),
        max_is_limit=kind in ("messages", "responses"),
    )


@dataclass(eq=False, slots=True)
class Call:
    """One request in the engine, as its API shape sees it. ``finish_reason`` is "stop"
    (the reply's own length) or "length" (cut by the client's limit); ``echo`` holds the
    request fields the API's answer repeats."""

    kind: str
    response_id: str
    model: str
    created: int
    params: CallParams
    request: EngineRequest
    pieces: list[str]
    finish_reason: str
    echo: Mapping[str, Any] = field(default_factory=dict)
    changed: anyio.Event = field(default_factory=anyio.Event)
    seen: int = 0
    error: str | None = None

    @property
    def over(self) -> bool:
        return self.request.finished or self.error is not None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt tokens, of which served from the prefix cache, output tokens so far)."""
        request = self.request
        cached = max(0, min(request.cached_tokens, request.prompt_tokens))
        return request.prompt_tokens, cached, min(request.num_output, request.output_tokens)


class CallFailed(RuntimeError):
    """The engine failed a call in flight (its loop died, or the call was aborted)."""


class CallShape(Protocol):
    """One API's view of a call: how a request becomes a prompt, and how the call's
    progress becomes the API's body, stream and errors."""

    kind: str         # the key of parse_params and _MAX_TOKEN_KEYS
    id_prefix: str    # of the response id, which is also the engine's request id
    prompt_param: str  # the field named when the prompt does not fit

    def error(self, status: int, message: str, param: str | None = None) -> Response: ...

    def renderer(self, body: Mapping[str, Any]) -> Callable[[PseudoTokenizer], list[int]]:
        """Validate what is cheap to check, and return what renders the prompt (it runs
        in a worker thread). Raises BadRequest or PromptError."""
        ...

    def echo(self, body: Mapping[str, Any]) -> Mapping[str, Any]: ...

    def body(self, call: Call) -> dict[str, Any]: ...

    def events(self, call: Call, progress: AsyncIterator[tuple[str, bool]]) -> AsyncIterator[bytes]:
        """The SSE stream: ``progress`` yields (new text, finished) and raises CallFailed."""
        ...
