"""The simworker's Anthropic Messages and OpenAI Responses APIs: their requests as prompts,
their answers, streams and errors.

Both drive the same engine model as chat completions (simworker/worker.py): the request is
turned into chat-template messages and rendered by the same pseudo-tokenizer, so a reply
sent back verbatim hits the prefix cache through the reply, exactly as in chat.

Messages (``POST /v1/messages``, ``POST /v1/messages/count_tokens``): ``system`` (a string
or text blocks) becomes a system message; each message's content is a string or blocks —
a text block is its text, any other block (tool_use, tool_result, image, …) stands in as
its canonical JSON; ``cache_control`` markers are dropped (they move from turn to turn and
are no tokens). ``tools`` are rendered like chat's. A final assistant message is continued
(Anthropic's prefill). ``usage.input_tokens`` excludes the prefix-cache reads, which come as
``cache_read_input_tokens`` (Anthropic's convention); cache writes are always 0.

Responses (``POST /v1/responses``): ``input`` is a string (one user message) or items —
messages (``input_text``/``output_text`` parts are their text), ``function_call`` (an
assistant tool call), ``function_call_output`` (a tool message), anything else as its JSON
under its type as role. ``instructions`` open the conversation as a system message.
``previous_response_id`` continues a stored answer: the prompt is that answer's whole token
sequence (its prompt and its reply), then the new input, so it hits the cache through the
previous turn; instructions already in that context are not repeated (different ones are
appended as a system message). Answers are stored unless ``store`` is false, the newest
``responses_kept``. ``usage.input_tokens`` includes the cached tokens
(``input_tokens_details.cached_tokens``), as OpenAI counts them.

Output length, both APIs: the reply's own length is the worker's ``default_max_tokens``;
``max_tokens`` / ``max_output_tokens`` cut it (Anthropic ``stop_reason`` "max_tokens",
Responses ``status`` "incomplete" with ``incomplete_details.reason`` "max_output_tokens"),
otherwise it ends by itself ("end_turn", "completed").
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.responses import JSONResponse, Response

from simworker.calls import BadRequest, Call, CallFailed, error_response
from sim.tokens import END, PromptError, PseudoTokenizer, canonical_json

_encode = msgspec.json.Encoder().encode


def sse_event(name: str, data: Mapping[str, Any]) -> bytes:
    """One server-sent event with an ``event:`` line, as both APIs send them."""
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


def _without_cache_control(block: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in block.items() if key != "cache_control"}


# -- Anthropic Messages ---------------------------------------------------------------------

_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                          403: "permission_error", 404: "not_found_error",
                          413: "request_too_large", 429: "rate_limit_error",
                          503: "overloaded_error"}
_ANTHROPIC_ROLES = ("user", "assistant")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _anthropic_blocks(content: Any, param: str) -> str | list[Any]:
    """Anthropic content as chat content: text blocks as text parts, other blocks as
    themselves (the tokenizer renders them as JSON), ``cache_control`` dropped."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError(f"{param}: must be a string or a list of content blocks", param)
    parts: list[Any] = []
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise PromptError(f"{param}.{index}: must be a content block with a type",
                              f"{param}.{index}")
        if block["type"] == "text":
            if not isinstance(block.get("text"), str):
                raise PromptError(f"{param}.{index}.text: must be a string", f"{param}.{index}.text")
            parts.append({"type": "text", "text": block["text"]})
        else:
            parts.append(_without_cache_control(block))
    return parts


def anthropic_chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` of a Messages request as chat-template messages."""
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _anthropic_blocks(system, "system")})
    messages = body.get("messages")
    if messages is None:
        raise PromptError("messages: Field required", "messages")
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages: must be a non-empty list of messages", "messages")
    for index, message in enumerate(messages):
        param = f"messages.{index}"
        if not isinstance(message, dict):
            raise PromptError(f"{param}: must be an object", param)
        role = message.get("role")
        if role not in _ANTHROPIC_ROLES:
            raise PromptError(f"{param}.role: must be 'user' or 'assistant', got {role!r}",
                              f"{param}.role")
        chat.append({"role": role,
                     "content": _anthropic_blocks(message.get("content"), f"{param}.content")})
    return chat


def _anthropic_tools(body: Mapping[str, Any]) -> list[Any] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise PromptError("tools: must be a list of tool definitions", "tools")
    return [_without_cache_control(tool) if isinstance(tool, dict) else tool for tool in tools]


class AnthropicMessages:
    """``POST /v1/messages`` (and the prompt of ``/v1/messages/count_tokens``)."""

    kind = "messages"
    id_prefix = "msg_"
    prompt_param = "messages"

    def error(self, status: int, message: str, param: str | None = None) -> Response:
        return JSONResponse(anthropic_error(status, message), status_code=status)

    def renderer(self, body: Mapping[str, Any]) -> Callable[[PseudoTokenizer], list[int]]:
        messages = anthropic_chat_messages(body)
        tools = _anthropic_tools(body)
        prefill = messages[-1]["role"] == "assistant"
        return lambda tokenizer: tokenizer.render_chat(messages, tools,
                                                       continue_final_message=prefill)

    def echo(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return {}

    @staticmethod
    def usage(call: Call) -> dict[str, Any]:
        prompt, cached, output = call.usage_counts()
        return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": output}

    @staticmethod
    def stop_reason(call: Call) -> str:
        return "max_tokens" if call.finish_reason == "length" else "end_turn"

    def _message(self, call: Call, content: list[Any], stop_reason: str | None,
                 usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": call.response_id, "type": "message", "role": "assistant", "model": call.model,
                "content": content, "stop_reason": stop_reason, "stop_sequence": None,
                "usage": usage}

    def body(self, call: Call) -> dict[str, Any]:
        return self._message(call, [{"type": "text", "text": call.text}], self.stop_reason(call),
                             self.usage(call))

    async def events(self, call: Call, progress: AsyncIterator[tuple[str, bool]]) -> AsyncIterator[bytes]:
        started = False
        try:
            async for text, _finished in progress:
                if not started:
                    # Sent with the first tokens: only then does the engine know the cache hit.
                    started = True
                    usage = {**self.usage(call), "output_tokens": 1}
                    yield sse_event("message_start", {"type": "message_start",
                                                      "message": self._message(call, [], None, usage)})
                    yield sse_event("content_block_start", {
                        "type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}})
                    yield sse_event("ping", {"type": "ping"})
                if text:
                    yield sse_event("content_block_delta", {
                        "type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": text}})
        except CallFailed as err:
            yield sse_event("error", anthropic_error(500, str(err)))
            return
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason(call), "stop_sequence": None},
            "usage": {"output_tokens": self.usage(call)["output_tokens"]}})
        yield sse_event("message_stop", {"type": "message_stop"})


# -- OpenAI Responses -----------------------------------------------------------------------

_RESPONSE_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})


@dataclass(frozen=True, slots=True)
class StoredResponse:
    tokens: array  # the answer's prompt and reply, as the engine saw them
    instructions: str | None


class ResponseStore:
    """The newest ``limit`` stored answers, for ``previous_response_id``."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._answers: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._answers.get(response_id)

    def put(self, response_id: str, answer: StoredResponse) -> None:
        if self._limit < 1:
            return
        self._answers[response_id] = answer
        self._answers.move_to_end(response_id)
        while len(self._answers) > self._limit:
            self._answers.popitem(last=False)

    def __len__(self) -> int:
        return len(self._answers)


def _response_content(content: Any, param: str) -> str | list[Any] | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError(f"'{param}' must be a string or a list of content parts", param)
    parts: list[Any] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            parts.append(part)
    return parts


def response_chat_messages(items: Any) -> list[dict[str, Any]]:
    """A Responses ``input`` as chat-template messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise PromptError("'input' must be a string or a non-empty list of items", "input")
    chat: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise PromptError(f"'{param}' must be an object", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _RESPONSE_ROLES:
                raise PromptError(f"'{param}.role' must be one of {sorted(_RESPONSE_ROLES)}, got {role!r}",
                                  f"{param}.role")
            chat.append({"role": role, "content": _response_content(item.get("content"),
                                                                    f"{param}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            chat.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _response_content(output, f"{param}.output")})
        elif isinstance(kind, str) and kind:
            chat.append({"role": kind, "content": canonical_json(item)})
        else:
            raise PromptError(f"'{param}.type' must be a non-empty string", f"{param}.type")
    return chat


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"'{key}' must be a string", key)
    return value


class OpenAIResponses:
    """``POST /v1/responses``, with its own store of answers for ``previous_response_id``."""

    kind = "responses"
    id_prefix = "resp_"
    prompt_param = "input"

    def __init__(self, responses_kept: int) -> None:
        self.store = ResponseStore(responses_kept)

    def error(self, status: int, message: str, param: str | None = None) -> Response:
        return error_response(status, message, param)

    def renderer(self, body: Mapping[str, Any]) -> Callable[[PseudoTokenizer], list[int]]:
        instructions = _optional_str(body, "instructions")
        previous_id = _optional_str(body, "previous_response_id")
        previous = None
        if previous_id is not None:
            previous = self.store.get(previous_id)
            if previous is None:
                raise BadRequest(f"Response with id '{previous_id}' not found.",
                                 "previous_response_id", status=404)
        messages = response_chat_messages(body.get("input"))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("'tools' must be a list of tool definitions", "tools")
        if instructions is not None and (previous is None or instructions != previous.instructions):
            messages = [{"role": "system", "content": instructions}, *messages]

        def render(tokenizer: PseudoTokenizer) -> list[int]:
            if previous is None:
                return tokenizer.render_chat(messages, tools, param="input")
            # The previous reply's assistant message is still open: close it, then go on.
            tokens = list(previous.tokens)
            tokens.append(END)
            tokens += tokenizer.render_chat(messages, opening=False, param="input")
            return tokens

        return render

    def echo(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return {
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "max_output_tokens": body.get("max_output_tokens"),
            "tools": body.get("tools") or [],
            "store": body.get("store") is not False,
            "metadata": body.get("metadata") or {},
        }

    @staticmethod
    def usage(call: Call) -> dict[str, Any]:
        prompt, cached, output = call.usage_counts()
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output}

    @staticmethod
    def _status(call: Call) -> str:
        return "incomplete" if call.finish_reason == "length" else "completed"

    @staticmethod
    def _message_id(call: Call) -> str:
        return "msg_" + call.response_id.removeprefix("resp_")

    def _item(self, call: Call, status: str, content: list[Any]) -> dict[str, Any]:
        return {"id": self._message_id(call), "type": "message", "status": status,
                "role": "assistant", "content": content}

    @staticmethod
    def _text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _response(self, call: Call, status: str, output: list[Any],
                  usage: dict[str, Any] | None) -> dict[str, Any]:
        echo = call.echo
        return {
            "id": call.response_id, "object": "response", "created_at": call.created,
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": echo.get("instructions"), "max_output_tokens": echo.get("max_output_tokens"),
            "model": call.model, "output": output, "parallel_tool_calls": True,
            "previous_response_id": echo.get("previous_response_id"), "reasoning": None,
            "store": echo.get("store", True), "temperature": 1.0,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto",
            "tools": echo.get("tools", []), "top_p": 1.0, "truncation": "disabled",
            "metadata": echo.get("metadata", {}), "usage": usage,
        }

    def _remember(self, call: Call) -> None:
        if call.echo.get("store", True) and call.request.token_ids is not None:
            tokens = call.request.token_ids
            self.store.put(call.response_id, StoredResponse(
                tokens if isinstance(tokens, array) else array("I", tokens),
                call.echo.get("instructions")))

    def body(self, call: Call) -> dict[str, Any]:
        self._remember(call)
        status = self._status(call)
        item = self._item(call, status, [self._text_part(call.text)])
        return self._response(call, status, [item], self.usage(call))

    async def events(self, call: Call, progress: AsyncIterator[tuple[str, bool]]) -> AsyncIterator[bytes]:
        sequence = 0

        def event(name: str, **fields: Any) -> bytes:
            nonlocal sequence
            data = {"type": name, "sequence_number": sequence, **fields}
            sequence += 1
            return sse_event(name, data)

        item_id = self._message_id(call)
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        opening = self._response(call, "in_progress", [], None)
        yield event("response.created", response=opening)
        yield event("response.in_progress", response=opening)
        yield event("response.output_item.added", output_index=0,
                    item=self._item(call, "in_progress", []))
        yield event("response.content_part.added", **where, part=self._text_part(""))
        try:
            async for text, _finished in progress:
                if text:
                    yield event("response.output_text.delta", **where, delta=text, logprobs=[])
        except CallFailed as err:
            yield event("error", code="server_error", message=str(err), param=None)
            return
        self._remember(call)
        status = self._status(call)
        part = self._text_part(call.text)
        item = self._item(call, status, [part])
        yield event("response.output_text.done", **where, text=call.text, logprobs=[])
        yield event("response.content_part.done", **where, part=part)
        yield event("response.output_item.done", output_index=0, item=item)
        yield event(f"response.{status}", response=self._response(call, status, [item], self.usage(call)))

