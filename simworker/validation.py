"""Request bodies checked as vLLM 0.32 checks them, before anything is rendered.

vLLM (FastAPI) parses each body into a pydantic model; a body that does not fit never reaches
the handler and is refused by vLLM's ``RequestValidationError`` handler
(``vllm/entrypoints/serve/exception_handling/handlers/validation.py``): 400, always in
OpenAI's envelope, even on ``/v1/messages``::

    {"error": {"message": "1 validation error:\\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', ...}",
               "type": "Bad Request", "param": "body.max_tokens", "code": 400}}

(at most 10 errors listed, each with its ``input`` summarised and its ``loc`` dotted without
pydantic's union-branch markers; ``param`` is the first error's ``loc``). The same goes for a
body that is not JSON (``json_invalid`` at ``body.<offset>``) and for a request whose
content type is not ``application/json``. :class:`InvalidRequest` is that refusal here.

The models below declare the fields vLLM declares for each route, with vLLM's types, so
pydantic's lax coercions are vLLM's (``"5"`` is a valid ``max_tokens``, ``"yes"`` a valid
``stream``; ``3.5`` and ``"x"`` are not); fields the simworker does not act on are declared
too, so a wrong type is refused as vLLM refuses it. Unknown fields are allowed on the OpenAI
routes (vLLM's ``OpenAIBaseModel``: ``extra="allow"``) and ignored on the Anthropic ones
(plain pydantic models). What the models leave out, compared with vLLM's: the exact shapes of
chat content parts and of Responses items other than messages and function calls (checked
by the API modules' renderers, simworker/openai_completions.py, anthropic_messages.py and
openai_responses.py, or not at all), so a malformed one may be refused with another message or
param than vLLM's, or accepted.

Checks vLLM makes in its handlers (sampling parameters, tools against ``tool_choice``, an
unknown model, the context length) come as ``BadRequestError`` in the route's own envelope:
simworker/calls.py ``BadRequest``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
XArgValue = str | int | float | list[str | int | float]

# vLLM's validation handler lists at most this many errors and cuts each rendered one and
# each echoed input at these lengths (handlers/validation.py).
MAX_REPORTED_ERRORS = 10
MAX_ERROR_INPUT_CHARS = 200
MAX_ERROR_CHARS = 1000
# pydantic's schema-kind names that vLLM drops from an error's dotted ``loc`` (besides any
# segment with brackets or parentheses), from the same module.
_INTERNAL_LOC_SEGMENTS = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
    "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call",
    "arguments", "is-instance", "is-subclass", "callable", "str", "int", "float", "bool",
    "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset", "complex", "none",
    "nonetype",
})


class InvalidRequest(ValueError):
    """A body vLLM's request validation refuses: 400 in OpenAI's envelope with type
    "Bad Request" on every route (simworker/calls.py ``invalid_request_response``)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _summarise_input(value: Any) -> Any:
    if isinstance(value, str):
        return value if len(value) <= MAX_ERROR_INPUT_CHARS else value[:MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= MAX_ERROR_INPUT_CHARS else text[:MAX_ERROR_INPUT_CHARS] + "...[truncated]"


def _dotted(loc: tuple[Any, ...]) -> str:
    kept = [str(part) for part in loc
            if not (any(c in str(part) for c in "[]{}()") or str(part).lower() in _INTERNAL_LOC_SEGMENTS)]
    return ".".join(kept) if kept else ".".join(str(part) for part in loc)


def invalid_from_errors(errors: list[dict[str, Any]]) -> InvalidRequest:
    """vLLM's refusal of a body with these pydantic errors (``loc`` already under "body")."""
    param = _dotted(tuple(errors[0]["loc"])) if errors and errors[0].get("loc") else None
    lines = []
    for error in errors[:MAX_REPORTED_ERRORS]:
        shown = dict(error)
        if "input" in shown:
            shown["input"] = _summarise_input(shown["input"])
        shown["loc"] = _dotted(tuple(shown["loc"]))
        text = str(shown)
        lines.append(text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "...[truncated]")
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {line}\n" for line in lines)
    if len(errors) > MAX_REPORTED_ERRORS:
        message += f"  ...and {len(errors) - MAX_REPORTED_ERRORS} more {label}\n"
    return InvalidRequest(message.rstrip(), param)


def check_media_type(content_type: str | None) -> None:
    """vLLM accepts only ``application/json`` bodies (``validate_json_request``)."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise InvalidRequest("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                             None)


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or vLLM's ``json_invalid`` refusal at ``body.<offset>``."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as err:
        raise invalid_from_errors([{"type": "json_invalid", "loc": ("body", err.pos), "msg": "JSON decode error",
                                    "input": {}, "ctx": {"error": err.msg}}]) from None
    except (UnicodeDecodeError, RecursionError) as err:
        raise invalid_from_errors([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                    "input": {}, "ctx": {"error": str(err)}}]) from None


# -- OpenAI chat and completions (vllm/entrypoints/openai/*/protocol.py) ----------------------


class _OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class FunctionDefinition(_OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(_OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatToolCallFunction(_OpenAIModel):
    name: str
    arguments: str


class ChatToolCall(_OpenAIModel):
    id: str
    type: Literal["function"]
    function: ChatToolCallFunction


class ChatMessage(_OpenAIModel):
    """Any role (vLLM accepts custom roles); content a string or parts, absent, or null
    from the assistant (or a legacy function message) only."""

    role: str
    # parts are checked when the prompt is rendered, as vLLM checks them (a lazy iterator)
    content: str | list[Any] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ChatToolCall] | None = None

    @model_validator(mode="after")
    def _content_null_only_from_the_assistant(self) -> ChatMessage:
        if "content" in self.model_fields_set and self.content is None and self.role not in ("assistant", "function"):
            raise ValueError(f"a {self.role} message's content must be a string or a list of parts, not null")
        return self


class _SamplingFields(_OpenAIModel):
    """The sampling and vLLM-extra fields chat and completions share."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    priority: Int64 = 0
    request_id: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    vllm_xargs: dict[str, XArgValue] | None = None
    response_format: dict[str, Any] | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = "none"
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    suffix: str | None = None
    add_special_tokens: bool = True


# -- OpenAI Responses (vllm/entrypoints/openai/responses/protocol.py) --------------------------

# The ``type`` of every item the openai SDK vLLM 0.32 ships (3.57) accepts in ``input``
# (``ResponseInputItemParam`` and ``ResponseOutputItem``).
RESPONSE_ITEM_TYPES = frozenset({
    "message", "file_search_call", "computer_call", "computer_call_output", "web_search_call",
    "function_call", "function_call_output", "tool_search_call", "tool_search_output",
    "additional_tools", "configuration_update", "reasoning", "compaction", "image_generation_call",
    "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call",
    "shell_call_output", "apply_patch_call", "apply_patch_call_output", "mcp_list_tools",
    "mcp_approval_request", "mcp_approval_response", "mcp_call", "custom_tool_call_output",
    "custom_tool_call", "compaction_trigger", "item_reference", "program", "program_output",
})
RESPONSE_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
# The ``type`` of every tool the same SDK accepts in ``tools`` (``openai.types.responses.Tool``).
RESPONSE_TOOL_TYPES = frozenset({
    "function", "file_search", "computer", "computer_use_preview", "web_search",
    "web_search_2025_08_26", "mcp", "code_interpreter", "programmatic_tool_calling",
    "image_generation", "local_shell", "shell", "custom", "namespace", "tool_search",
    "web_search_preview", "web_search_preview_2025_03_11", "apply_patch",
})


class ResponseMessageItem(_OpenAIModel):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    type: Literal["message"] | None = None


class ResponseFunctionCallItem(_OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class ResponseFunctionTool(_OpenAIModel):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


def _check_response_item(item: Any) -> None:
    """A message or function call checked field by field, another item by its type."""
    if not isinstance(item, dict):
        raise ValueError("Input should be a valid dictionary")
    kind = item.get("type", "message")
    model = {"message": ResponseMessageItem, "function_call": ResponseFunctionCallItem}.get(kind)
    if model is not None:
        try:
            model.model_validate(item)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            raise ValueError(f"{kind} item: {_dotted(tuple(first['loc']))}: {first['msg']}") from None
    elif kind not in RESPONSE_ITEM_TYPES:
        raise ValueError(f"Input tag '{kind}' found using 'type' does not match any of the expected tags")


def _check_response_tool(tool: Any) -> None:
    if not isinstance(tool, dict) or tool.get("type") not in RESPONSE_TOOL_TYPES:
        raise ValueError("a tool must be an object whose type is a Responses tool type")
    if tool["type"] == "function":
        try:
            ResponseFunctionTool.model_validate(tool)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            raise ValueError(f"function tool: {_dotted(tuple(first['loc']))}: {first['msg']}") from None


class ResponsesRequest(_OpenAIModel):
    background: bool | None = False
    include: list[str] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    store: bool | None = True
    stream: bool | None = False
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = 0
    top_p: float | None = None
    top_k: int | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    prompt_cache_key: str | None = None
    request_id: str | None = None
    session_id: str | None = None
    priority: Int64 = 0
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    vllm_xargs: dict[str, XArgValue] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _a_mapping_is_its_keys(cls, value: Any) -> Any:
        # vLLM's input type takes any iterable but a string for its list, so an object
        # stands for the list of its keys (``{}`` is an empty conversation)
        return list(value) if isinstance(value, dict) else value

    @field_validator("input")
    @classmethod
    def _items_known(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        for item in value if isinstance(value, list) else ():
            _check_response_item(item)
        return value

    @field_validator("tools")
    @classmethod
    def _tools_known(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for tool in value:
            _check_response_tool(tool)
        return value


# -- Anthropic Messages (vllm/entrypoints/anthropic/protocol.py) -------------------------------

ANTHROPIC_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                         "redacted_thinking", "tool_addition", "tool_removal")


class AnthropicBlock(BaseModel):
    type: Literal["text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                  "redacted_thinking", "tool_addition", "tool_removal"]
    text: str | None = None
    source: dict[str, Any] | None = None
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    tool_name: str | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    tool: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_change_needs_a_tool(self) -> AnthropicBlock:
        if self.type in ("tool_addition", "tool_removal") and self.tool is None:
            raise ValueError(f"tool is required for {self.type} blocks")
        return self


def _no_tool_changes(content: Any) -> None:
    for block in content if isinstance(content, list) else ():
        if block.type in ("tool_addition", "tool_removal"):
            raise ValueError(f'{block.type} blocks are only allowed in messages with role "system"')


class AnthropicMessage(BaseModel):
    """``system`` is accepted among the messages, as vLLM 0.32 accepts Claude Code's
    mid-conversation system messages (beta ``mid-conversation-system-2026-04-07``)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[AnthropicBlock]

    @model_validator(mode="after")
    def _tool_changes_only_in_system(self) -> AnthropicMessage:
        if self.role != "system":
            _no_tool_changes(self.content)
        return self


class AnthropicTool(BaseModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None


class AnthropicToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named_needs_a_name(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice.name is required when type is 'tool'")
        return self


class ThinkingEnabled(BaseModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: Literal["summarized", "omitted", "updates"] | None = None


class ThinkingDisabled(BaseModel):
    type: Literal["disabled"]


class ThinkingAdaptive(BaseModel):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted", "updates"] | None = None


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")]


class OutputFormat(BaseModel):
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    type: Literal["json_schema"] = "json_schema"


class OutputConfig(BaseModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class _AnthropicPrompt(BaseModel):
    model: str
    messages: list[AnthropicMessage]
    output_config: OutputConfig | None = None
    system: str | list[AnthropicBlock] | None = None
    thinking: Thinking | None = None
    tool_choice: AnthropicToolChoice | None = None
    tools: list[AnthropicTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("model")
    @classmethod
    def _model_named(cls, value: str) -> str:
        if not value:
            raise ValueError("Model is required")
        return value

    @field_validator("system")
    @classmethod
    def _system_tool_changes(cls, value: Any) -> Any:
        _no_tool_changes(value)
        return value


class AnthropicCountTokensRequest(_AnthropicPrompt):
    pass


class AnthropicMessagesRequest(_AnthropicPrompt):
    max_tokens: int
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    vllm_xargs: dict[str, XArgValue] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("max_tokens must be positive")
        return value

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> AnthropicMessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self


REQUEST_MODELS: Mapping[str, type[BaseModel]] = {
    "chat": ChatRequest,
    "completion": CompletionRequest,
    "responses": ResponsesRequest,
    "messages": AnthropicMessagesRequest,
    "count_tokens": AnthropicCountTokensRequest,
}


def validate_body(kind: str, body: Any) -> dict[str, Any]:
    """``body`` checked against the route's model (``kind``: a key of REQUEST_MODELS); returns
    the body with every declared top-level scalar field as pydantic coerced it (``"5"`` →
    5), nested values as sent. Raises InvalidRequest."""
    model = REQUEST_MODELS[kind]
    try:
        parsed = model.model_validate(body)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        for error in errors:
            error["loc"] = ("body", *error["loc"])
        raise invalid_from_errors(errors) from None
    coerced = dict(body)
    for name in parsed.model_fields_set:
        value = getattr(parsed, name)
        if value is None or isinstance(value, (bool, int, float, str)):
            coerced[name] = value
    if isinstance(parsed, (ChatRequest, CompletionRequest)) and parsed.stream_options is not None:
        coerced["stream_options"] = parsed.stream_options.model_dump()
    return coerced
