"""A call in the simworker, and what each API it serves (its *shape*) implements.

:class:`Call` is one request in the engine as the API layer sees it; :func:`parse_params`
reads the fields every API shares (stream, output limit, sampling, priority, session id,
vLLM's extra args) from a body simworker/validation.py has checked, and refuses what vLLM's
handlers refuse; :class:`CallShape` is what an API provides: how a request body becomes a
prompt (a :class:`PromptPlan`), and how the call's progress becomes that API's body, stream
events and errors. The shapes are ``OpenAICompletions`` (simworker/openai_completions.py),
``AnthropicMessages`` (simworker/anthropic_messages.py) and ``OpenAIResponses``
(simworker/openai_responses.py).

Errors come in vLLM 0.32's two envelopes (``vllm/entrypoints/serve/exception_handling``,
``vllm/entrypoints/anthropic/api_router.py``): OpenAI's ``{"error": {"message", "type",
"param", "code"}}`` and, for a check vLLM's Anthropic handler makes, ``{"type": "error",
"error": {"type", "message"}}`` with the same ``type`` names ("BadRequestError",
"NotFoundError", …), not Anthropic's own. A refused parameter's message ends with vLLM's
``(parameter=…, value=…)``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import anyio
from starlette.responses import JSONResponse, Response

from sim.engine_request import EngineRequest
from sim.tokens import PseudoTokenizer
from simworker.tool_calls import NO_TOOL_CHOICE, ToolCallReply, ToolChoice, ToolSpec
from simworker.validation import InvalidRequest

SESSION_HEADER = "x-session-id"
# vLLM's ``type`` per status (``create_error_response``; 404 ``NotFoundError``, a dead
# engine ``ServiceUnavailableError``).
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 501: "NotImplementedError",
               503: "ServiceUnavailableError"}
# vLLM's ``_MAX_CACHE_SALT_LENGTH`` and forbidden characters (vllm/entrypoints/generate/base/protocol.py).
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


class BadRequest(ValueError):
    """A request refused by a check vLLM makes in its handler, in the route's envelope.
    ``error_type`` overrides the status's type name (the Responses API's 404 for an unknown
    ``previous_response_id`` says "invalid_request_error")."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.error_type = error_type or ERROR_TYPES.get(status, "InternalServerError")


def refused(message: str, param: str | None = None, value: Any = None) -> BadRequest:
    """vLLM's ``VLLMValidationError``: the message ends with ``(parameter=…, value=…)``
    for what is named."""
    extras = [f"{name}={v}" for name, v in (("parameter", param), ("value", value)) if v is not None]
    return BadRequest(f"{message} ({', '.join(extras)})" if extras else message, param)


def error_response(status: int, message: str, param: str | None = None,
                   error_type: str | None = None) -> JSONResponse:
    """vLLM's OpenAI error envelope."""
    kind = error_type or ERROR_TYPES.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def invalid_request_response(err: InvalidRequest) -> JSONResponse:
    """vLLM's refusal of a body its request validation rejects: OpenAI's envelope on every
    route, type "Bad Request"."""
    return error_response(400, str(err), err.param, error_type="Bad Request")


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
    temperature: float | None = None
    # the body's scheduling priority (lower first); 0 where the API has none
    priority: int = 0
    # The Anthropic and Responses APIs: the reply's own length is ``default_max_tokens`` and
    # ``max_tokens`` only cuts it (Anthropic requires one on every call, often 32k; taking it
    # as the length, as chat does, would make every such reply that long).
    max_is_limit: bool = False
    # the field named when the output limit exceeds the model length (vLLM names the one
    # it read: ``max_completion_tokens`` on the Anthropic route, whose handler sets both)
    max_tokens_param: str = "max_tokens"

    @property
    def reproducible(self) -> bool:
        """The reply is fixed by the prompt: a ``seed`` given, or greedy decoding."""
        return self.seed is not None or self.temperature == 0


# Per API: the fields that bound the output, in the order they are read.
_MAX_TOKEN_KEYS = {
    "chat": ("max_completion_tokens", "max_tokens"),
    "completion": ("max_tokens",),
    "messages": ("max_tokens",),
    "responses": ("max_output_tokens",),
}
# vLLM's completions API writes 16 tokens when the client sets no limit (the OpenAI default).
COMPLETION_DEFAULT_MAX_TOKENS = 16


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _check_sampling(kind: str, body: Mapping[str, Any]) -> tuple[float | None, int | None]:
    """vLLM's ``SamplingParams`` checks (vllm/sampling_params.py ``_verify_args``), in its
    order; returns (temperature, seed)."""
    if kind in ("chat", "completion"):
        n = body.get("n", 1)
        if isinstance(n, int) and n < 1:
            raise refused(f"n must be at least 1, got {n}.")
        if isinstance(n, int) and n > 1:
            raise BadRequest("the simworker serves n=1 only", "n")
    for key in ("presence_penalty", "frequency_penalty"):
        value = _number(body, key)
        if value is not None and not -2.0 <= value <= 2.0:
            raise refused(f"{key} must be in [-2, 2], got {value}.")
    temperature = _number(body, "temperature")
    if temperature is not None:
        if not math.isfinite(temperature):
            raise refused(f"temperature must be a finite number, got {temperature}.", "temperature", temperature)
        if temperature < 0.0:
            raise refused(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
        if temperature > 2.0:
            raise refused(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    top_p = _number(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise refused(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = body.get("top_k")
    if isinstance(top_k, int) and top_k < -1:
        raise refused(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = _number(body, "min_p")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise refused(f"min_p must be in [0, 1], got {min_p}.")
    seed = body.get("seed")
    return temperature, seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def check_openai_preconditions(kind: str, body: Any) -> None:
    """What vLLM's OpenAI request models check of the raw body before their fields (their
    ``mode="before"`` validators raise ``VLLMValidationError``, which is not turned into a
    validation error): ``cache_salt`` (chat, completions, Responses), ``stream_options``
    without ``stream`` (chat, completions), and chat's ``tools`` against ``tool_choice``."""
    if not isinstance(body, dict) or kind not in ("chat", "completion", "responses"):
        return
    if kind != "responses" and body.get("stream_options") and not body.get("stream"):
        raise refused("Stream options can only be defined when `stream=True`.", "stream_options")
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise refused("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        if len(salt) > MAX_CACHE_SALT_CHARS or any(c in CACHE_SALT_FORBIDDEN for c in salt):
            raise refused("Parameter 'cache_salt' must be at most 128 characters and must not contain "
                          "'@', '/', '\\\\', or NUL.", "cache_salt")
    if kind != "chat":
        return
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise refused("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    tools = body.get("tools")
    if tools == []:
        raise refused("`tools` must not be an empty array. Either provide at least one tool or omit the "
                      "field entirely.", "tools")
    choice = body.get("tool_choice", "auto" if tools else None)
    if choice is None or choice == "none":
        return
    if tools is None:
        raise refused("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise refused(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                      '"required" are supported.', "tool_choice")
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if not isinstance(function, dict):
            raise refused(f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                          "tool_choice.function")
        if "name" not in function:
            raise refused(f"Expected field `name` in `function` in `tool_choice`! {usage}",
                          "tool_choice.function.name")
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise refused(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                          "tool_choice.function.name")
        names = [t.get("function", {}).get("name") for t in tools if isinstance(t, dict)
                 and isinstance(t.get("function"), dict)]
        if name not in names:
            raise refused("The tool specified in `tool_choice` does not match any of the specified `tools`",
                          "tool_choice")


def parse_params(kind: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> CallParams:
    """The request fields the simworker acts on (``kind``: "chat", "completion", "messages"
    or "responses"), from a body simworker/validation.py has checked and coerced; refuses
    what vLLM's handlers refuse of them."""
    stream = bool(body.get("stream"))
    openai_stream = kind in ("chat", "completion")  # the others always report usage
    options = (body.get("stream_options") or {}) if openai_stream else {}
    include_usage = bool(options.get("include_usage")) and stream
    continuous = bool(options.get("continuous_usage_stats")) and stream
    max_tokens = None
    max_tokens_param = "max_tokens"
    for key in _MAX_TOKEN_KEYS[kind]:
        value = body.get(key)
        if value is not None:
            max_tokens, max_tokens_param = value, key
            break
    if kind == "completion" and max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    if max_tokens is not None and max_tokens < 1:
        # vLLM's SamplingParams names its own field, whichever the client set
        raise refused(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    temperature, seed = _check_sampling(kind, body)
    xargs = body.get("vllm_xargs") or {}
    session_id = body.get("session_id")
    if not session_id:
        session_id = headers.get(SESSION_HEADER) or None
    if not session_id:
        value = xargs.get("session_id")
        session_id = value if isinstance(value, str) and value else None
    continuation = xargs.get("continuation_id")
    return CallParams(
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        max_tokens=max_tokens,
        session_id=session_id,
        continuation_id=str(continuation) if continuation not in (None, "") else None,
        report_full=xargs.get("kv_cache_report_mode") == "full",
        cache_salt=body.get("cache_salt"),
        seed=seed,
        model=body.get("model") or None,
        temperature=temperature,
        # vLLM's Anthropic route has no ``priority``: its requests all run at 0
        priority=body.get("priority", 0) if kind != "messages" else 0,
        max_is_limit=kind in ("messages", "responses"),
        max_tokens_param="max_completion_tokens" if kind == "messages" else max_tokens_param,
    )


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """What a shape makes of a request before it runs: how to render the prompt (in a
    worker thread), the tools offered (function tools only), the ``tool_choice``, and the
    tool results the conversation holds (for ``tool_call_turns``); ``token_ids``: the prompt
    is the client's token ids, so its length is known exactly (vLLM then says so when it
    refuses it)."""

    render: Callable[[PseudoTokenizer], list[int]]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = NO_TOOL_CHOICE
    tool_results: int = 0
    token_ids: bool = False


class Progress(NamedTuple):
    """A step of a call's output: the new text, how many output tokens there are so far,
    and whether the call has finished (the last step may carry no text)."""

    text: str
    produced: int
    finished: bool


@dataclass(eq=False, slots=True)
class Call:
    """One request in the engine, as its API shape sees it. ``finish_reason`` is "stop"
    (the reply's own length), "length" (cut by the client's limit or the model length) or
    "tool_calls"; ``tool_call`` is the reply's tool call (its ``pieces`` are then the call's
    rendering); ``echo`` holds the request fields the API's answer repeats; ``rng`` is the
    call's random source (simworker/worker.py)."""

    kind: str
    response_id: str
    model: str
    created: int
    params: CallParams
    request: EngineRequest
    pieces: list[str]
    finish_reason: str
    echo: Mapping[str, Any] = field(default_factory=dict)
    tool_call: ToolCallReply | None = None
    tool_results: int = 0
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

    def arguments_through(self, produced: int) -> str:
        """The tool call's arguments as far as ``produced`` of its tokens go (all of them
        once every token is out): how a stream spreads the arguments over the decode."""
        assert self.tool_call is not None
        arguments = self.tool_call.arguments
        total = len(self.pieces)
        if produced >= total:
            return arguments
        return arguments[:len(arguments) * produced // total]


class CallFailed(RuntimeError):
    """The engine failed a call in flight (its loop died, or the call was aborted)."""


class CallShape(Protocol):
    """One API's view of a call: how a request becomes a prompt, and how the call's
    progress becomes the API's body, stream and errors."""

    kind: str         # the key of parse_params and _MAX_TOKEN_KEYS
    validation: str   # the key of simworker/validation.py's REQUEST_MODELS

    def response_id(self) -> str:
        """A fresh id for a call's answer (also the engine's request id)."""
        ...

    def error(self, err: BadRequest) -> Response: ...

    def plan(self, body: Mapping[str, Any]) -> PromptPlan:
        """Check what vLLM's handler checks of the prompt, and return the plan whose
        ``render`` makes it (run in a worker thread). Raises BadRequest or PromptError."""
        ...

    def echo(self, body: Mapping[str, Any]) -> Mapping[str, Any]: ...

    def body(self, call: Call) -> dict[str, Any]: ...

    def events(self, call: Call, progress: AsyncIterator[Progress]) -> AsyncIterator[bytes]:
        """The SSE stream: ``progress`` yields each step of the output and raises
        CallFailed."""
        ...
