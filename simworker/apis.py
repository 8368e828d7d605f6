"""The simworker's Anthropic Messages and OpenAI Responses APIs: their requests as prompts,
their answers, streams and errors, in vLLM 0.32's shapes.

Both drive the same engine model as chat completions (simworker/worker.py): the request is
turned into chat messages as vLLM 0.32 turns it (``vllm/entrypoints/anthropic/serving.py``
``to_chat_completion_request``, ``vllm/entrypoints/openai/responses/utils.py``
``construct_chat_messages_with_tool_call``) and rendered by the same pseudo-tokenizer, so a
reply sent back verbatim hits the prefix cache through the reply, exactly as in chat.

Messages (``POST /v1/messages``, with or without a query string such as Claude Code's
``?beta=true``; ``POST /v1/messages/count_tokens``): the body is checked as vLLM's
``AnthropicMessagesRequest`` (simworker/validation.py; ``role`` may be "system" anywhere in
``messages``, as Claude Code sends with beta ``mid-conversation-system-2026-04-07``). Then,
as vLLM: the top-level ``system`` (a string, or the text of its text blocks, joined without
separator; blocks starting ``x-anthropic-billing-header``, Claude Code's per-request
attribution, dropped) opens the conversation as one system message; a system message among
the others stays where it is as a system message (the pseudo template accepts system
messages anywhere, so none is merged into the first); a string content is the message's
text; of content blocks, text blocks are parts, ``thinking`` becomes the message's
``reasoning`` (not rendered, like a chat template that drops earlier turns' reasoning),
``redacted_thinking`` and ``tool_reference`` are dropped, ``tool_use`` becomes a chat tool
call (``arguments`` = ``json.dumps(input)``), a user's ``tool_result`` becomes a tool message
before the user's remaining content (its text parts joined by newlines), an assistant's a
``Tool result: …`` text part, and ``image`` is refused ("<model> is not a multimodal
model", as vLLM answers for a text-only model); a user message left without content is
dropped, and a conversation left empty is refused as vLLM's chat template refuses it.
``cache_control`` anywhere is no tokens. ``tools`` become chat function tools (after the
``tool_addition`` / ``tool_removal`` blocks of system messages are applied), ``tool_choice``
maps to chat's (``any`` → required, ``tool`` → that tool, which must be offered). A final
assistant message is closed and a new one opened, as vLLM does (it sets no
``continue_final_message``). ``priority`` is ignored (vLLM's Anthropic route has none).
``usage.input_tokens`` excludes the prefix-cache reads, which come as
``cache_read_input_tokens``; ``cache_creation_input_tokens`` is 0. Ids are vLLM's:
``chatcmpl-<16 hex>``.

Responses (``POST /v1/responses``): ``input`` is a string (one user message) or items, as
vLLM maps them: messages (``input_text``/``output_text`` parts are their text; an assistant
message is the text of its first part), ``function_call`` (a tool call, merged into the
assistant message before it), ``function_call_output`` and ``custom_tool_call_output`` (a
tool message), ``reasoning`` (the assistant's reasoning; ``encrypted_content`` refused), any
other item type refused ("Unsupported input item type"). ``instructions`` open the
conversation as a system message. ``previous_response_id`` continues a stored answer: the
prompt is that answer's whole token sequence (its prompt and its reply), then the new input,
so it hits the cache through the previous turn; instructions already in that context are not
repeated (different ones are appended as a system message); an unknown id is vLLM's 404.
Answers are stored unless ``store`` is false, the newest ``responses_kept``.
``usage.input_tokens`` includes the cached tokens (``input_tokens_details.cached_tokens``).

Output length, both APIs: the reply's own length is the worker's ``default_max_tokens``;
``max_tokens`` / ``max_output_tokens`` cut it (Anthropic ``stop_reason`` "max_tokens",
Responses ``status`` "incomplete" with ``incomplete_details.reason`` "max_output_tokens"),
otherwise it ends by itself ("end_turn", "completed"). A tool-call reply (simworker/
tool_calls.py) is a ``tool_use`` block with ``stop_reason`` "tool_use", or a ``function_call``
output item; streamed as vLLM streams them (``content_block_start`` with the ``tool_use``
block, then ``input_json_delta``\\ s; ``response.output_item.added``, then
``response.function_call_arguments.delta``\\ s and ``.done``).
"""

from __future__ import annotations

import json
import time
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.responses import JSONResponse, Response

from sim.tokens import END, PseudoTokenizer
from simworker.calls import BadRequest, Call, CallFailed, Progress, PromptPlan, error_response, refused
from simworker.tool_calls import AUTO, NO_TOOL_CHOICE, ToolChoice, ToolSpec, random_hex

_encode = msgspec.json.Encoder().encode

# Claude Code's attribution header: a system text block that changes on every request, which
# vLLM drops so that it does not defeat prefix caching.
BILLING_HEADER = "x-anthropic-billing-header"
EMPTY_CONVERSATION = ("Cannot apply chat template to an empty conversation. Provide at least one "
                      "message.")
# Content parts a text-only model refuses (vLLM's chat parser would hand them to a
# multimodal processor the model does not have).
MEDIA_PART_TYPES = frozenset({"image_url", "image", "input_image", "image_pil", "image_embeds",
                              "input_audio", "audio_url", "audio_embeds", "video_url", "input_file",
                              "file"})


def sse_event(name: str, data: Mapping[str, Any]) -> bytes:
    """One server-sent event with an ``event:`` line, as both APIs send them."""
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


def refuse_media(messages: list[dict[str, Any]], model: str) -> None:
    """vLLM's answer to an image (or audio, video, file) part on a text-only model."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES
                                             for part in content):
            raise BadRequest(f"{model} is not a multimodal model")


def count_tool_results(messages: list[dict[str, Any]]) -> int:
    return sum(1 for message in messages if message.get("role") == "tool")


# -- Anthropic Messages ---------------------------------------------------------------------


def anthropic_error(err: BadRequest) -> dict[str, Any]:
    """vLLM's Anthropic envelope (``translate_error_response``)."""
    return {"type": "error", "error": {"type": err.error_type, "message": str(err)}}


def _system_text(content: Any, *, skip_billing_in_string: bool) -> str | None:
    """A system prompt's text: a string as is, else its text blocks joined; the billing
    header dropped (vLLM checks a string for it only in mid-conversation messages)."""
    if isinstance(content, str):
        if skip_billing_in_string and content.startswith(BILLING_HEADER):
            return None
        return content or None
    parts = [block["text"] for block in content or ()
             if block.get("type") == "text" and block.get("text") and not block["text"].startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _tool_result_message(block: Mapping[str, Any], model: str) -> dict[str, Any]:
    content = block.get("content")
    if isinstance(content, list):
        text = "\n".join(item.get("text", "") for item in content
                         if isinstance(item, dict) and item.get("type") == "text")
        if any(isinstance(item, dict) and item.get("type") == "image" for item in content):
            raise BadRequest(f"{model} is not a multimodal model")
    else:
        text = content if isinstance(content, str) else ""
    return {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text or ""}


def anthropic_chat_messages(body: Mapping[str, Any], model: str = "") -> list[dict[str, Any]]:
    """``system`` and ``messages`` of a checked Messages request as chat messages, as vLLM
    converts them (module docstring). Raises BadRequest for an image block."""
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        text = _system_text(system, skip_billing_in_string=False)
        if text:
            chat.append({"role": "system", "content": text})
    for message in body.get("messages") or ():
        role, content = message["role"], message["content"]
        if role == "system":
            text = _system_text(content, skip_billing_in_string=True)
            if text:
                chat.append({"role": "system", "content": text})
            continue
        converted: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        else:
            parts: list[dict[str, Any]] = []
            tool_calls: list[dict[str, Any]] = []
            reasoning: list[str] = []
            for block in content:
                kind = block.get("type")
                if kind == "text" and block.get("text"):
                    parts.append({"type": "text", "text": block["text"]})
                elif kind == "image" and block.get("source"):
                    raise BadRequest(f"{model} is not a multimodal model")
                elif kind == "thinking" and block.get("thinking") is not None:
                    reasoning.append(block["thinking"])
                elif kind == "tool_use":
                    tool_calls.append({"id": block.get("id") or f"call_{int(time.time())}", "type": "function",
                                       "function": {"name": block.get("name") or "",
                                                    "arguments": json.dumps(block.get("input") or {})}})
                elif kind == "tool_result":
                    if role == "user":
                        chat.append(_tool_result_message(block, model))
                    else:
                        result = block.get("content")
                        parts.append({"type": "text", "text": f"Tool result: {result if result else ''}"})
            if reasoning:
                converted["reasoning"] = "".join(reasoning)
            if tool_calls:
                converted["tool_calls"] = tool_calls
            if parts:
                converted["content"] = parts[0]["text"] if len(parts) == 1 else parts
        if not (role == "user" and "content" not in converted):
            chat.append(converted)
    return chat


def _resolved_anthropic_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """``tools`` after the ``tool_addition`` / ``tool_removal`` blocks of the messages."""
    tools = body.get("tools")
    changes = [block for message in body.get("messages") or () if isinstance(message["content"], list)
               for block in message["content"] if block.get("type") in ("tool_addition", "tool_removal")]
    if not changes:
        return tools
    by_name = {tool["name"]: tool for tool in tools or ()}
    removed: set[str] = set()
    for block in changes:
        change = block["tool"]
        if change.get("type") == "tool_definition" and isinstance(change.get("definition"), dict):
            name = change["definition"].get("name")
            by_name[name] = change["definition"]
        else:
            name = change.get("name")
            if name not in by_name:
                raise BadRequest(f"{block['type']} references tool {name!r}, which is not declared in tools")
            if block["type"] == "tool_addition":
                by_name[name] = {key: value for key, value in by_name[name].items() if key != "defer_loading"}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [tool for name, tool in by_name.items() if name not in removed]


def _anthropic_chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for tool in tools:
        schema = dict(tool.get("input_schema") or {})
        schema.setdefault("type", "object")
        function = {"name": tool["name"], "description": tool.get("description"), "parameters": schema,
                    "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading")}
        out.append({"type": "function",
                    "function": {key: value for key, value in function.items() if value is not None}})
    return out


def _anthropic_tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> ToolChoice:
    choice = body.get("tool_choice")
    if choice is None:
        return AUTO if tools else NO_TOOL_CHOICE
    kind = choice["type"]
    if kind == "none":
        return NO_TOOL_CHOICE
    if kind == "any":
        return ToolChoice("required")
    if kind == "tool":
        name = choice["name"]
        if name not in {tool["name"] for tool in tools or ()}:
            # the structured-output grammar vLLM builds for a named tool (xgrammar) refuses it
            raise BadRequest(f"The tool with name '{name}' is not found in the tools list.")
        return ToolChoice("named", name)
    return AUTO


class AnthropicMessages:
    """``POST /v1/messages`` (``counting`` False) or ``/v1/messages/count_tokens``."""

    kind = "messages"

    def __init__(self, model: str, *, counting: bool = False) -> None:
        self.model = model
        self.validation = "count_tokens" if counting else "messages"

    @staticmethod
    def response_id() -> str:
        return f"chatcmpl-{random_hex()}"

    def error(self, err: BadRequest) -> Response:
        return JSONResponse(anthropic_error(err), status_code=err.status)

    def plan(self, body: Mapping[str, Any]) -> PromptPlan:
        messages = anthropic_chat_messages(body, self.model)
        if not messages:
            raise BadRequest(EMPTY_CONVERSATION)
        tools = _resolved_anthropic_tools(body)
        choice = _anthropic_tool_choice(body, tools)
        chat_tools = _anthropic_chat_tools(tools)
        specs = tuple(ToolSpec(tool["name"], tool.get("input_schema")) for tool in tools or ()
                      if not tool.get("defer_loading"))
        return PromptPlan(render=lambda tokenizer: tokenizer.render_chat(messages, chat_tools),
                          tools=specs, tool_choice=choice, tool_results=count_tool_results(messages))

    def echo(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return {}

    @staticmethod
    def usage(call: Call) -> dict[str, Any]:
        prompt, cached, output = call.usage_counts()
        return {"input_tokens": prompt - cached, "output_tokens": output,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    @staticmethod
    def stop_reason(call: Call) -> str:
        if call.tool_call is not None:
            return "tool_use"
        return "max_tokens" if call.finish_reason == "length" else "end_turn"

    def _message(self, call: Call, content: list[Any], stop_reason: str | None,
                 usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": call.response_id, "type": "message", "role": "assistant", "content": content,
                "model": call.model, "stop_reason": stop_reason, "stop_sequence": None, "usage": usage}

    @staticmethod
    def _tool_use(call: Call, with_input: bool) -> dict[str, Any]:
        tool = call.tool_call
        assert tool is not None
        return {"type": "tool_use", "id": tool.call_id, "name": tool.name,
                "input": tool.input if with_input else {}}

    def body(self, call: Call) -> dict[str, Any]:
        if call.tool_call is not None:
            content = [self._tool_use(call, with_input=True)]
        else:
            content = [{"type": "text", "text": call.text}]
        return self._message(call, content, self.stop_reason(call), self.usage(call))

    async def events(self, call: Call, progress: AsyncIterator[Progress]) -> AsyncIterator[bytes]:
        started = False
        sent_arguments = 0
        try:
            async for text, produced, _finished in progress:
                if not started:
                    # Sent with the first tokens: only then does the engine know the cache hit.
                    started = True
                    usage = {**self.usage(call), "output_tokens": 0}
                    yield sse_event("message_start", {"type": "message_start",
                                                      "message": self._message(call, [], None, usage)})
                    block = self._tool_use(call, with_input=False) if call.tool_call else {"type": "text", "text": ""}
                    yield sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                            "content_block": block})
                if call.tool_call is not None:
                    arguments = call.arguments_through(produced)
                    if len(arguments) > sent_arguments:
                        yield sse_event("content_block_delta", {
                            "type": "content_block_delta", "index": 0,
                            "delta": {"type": "input_json_delta", "partial_json": arguments[sent_arguments:]}})
                        sent_arguments = len(arguments)
                elif text:
                    yield sse_event("content_block_delta", {
                        "type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": text}})
        except CallFailed as err:
            # vLLM's stream converter reports a failure as an "internal_error" event
            yield sse_event("error", {"type": "error", "error": {"type": "internal_error", "message": str(err)}})
            return
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason(call), "stop_sequence": None},
            "usage": self.usage(call)})
        yield sse_event("message_stop", {"type": "message_stop"})


# -- OpenAI Responses -----------------------------------------------------------------------

_TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})


@dataclass(frozen=True, slots=True)
class StoredResponse:
    tokens: array  # the answer's prompt and reply, as the engine saw them
    instructions: str | None
    tool_results: int = 0  # tool results in the conversation it continued


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


def _response_content(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    return [{"type": "text", "text": part["text"]}
            if isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES and isinstance(part.get("text"), str)
            else part for part in content]


def _first_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def response_chat_messages(items: Any) -> list[dict[str, Any]]:
    """A checked Responses ``input`` as chat messages, as vLLM maps the items (module
    docstring). Raises BadRequest."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    chat: list[dict[str, Any]] = []
    for item in items:
        previous = chat[-1] if chat and chat[-1].get("role") == "assistant" else None
        kind = item.get("type")
        if kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if previous is not None:
                previous.setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise refused("Encrypted content is not supported.", "input")
            content, summary = item.get("content") or [], item.get("summary") or []
            source = content or summary
            reasoning = source[0].get("text", "") if source and isinstance(source[0], dict) else ""
            if previous is not None and previous.get("reasoning") is None:
                previous["reasoning"] = reasoning
            else:
                chat.append({"role": "assistant", "reasoning": reasoning})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            chat.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _response_content(item.get("output"))})
        elif item.get("role") == "assistant" and _first_text(item.get("content")) is not None:
            text = _first_text(item.get("content"))
            if previous is not None and previous.get("content") is None:
                previous["content"] = text
            else:
                chat.append({"role": "assistant", "content": text})
        elif "role" in item:
            chat.append({"role": item["role"], "content": _response_content(item.get("content"))})
        else:
            raise refused(f"Unsupported input item type: {kind}", "input")
    return chat


def _responses_tool_choice(body: Mapping[str, Any], specs: tuple[ToolSpec, ...]) -> ToolChoice:
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return NO_TOOL_CHOICE
    if choice == "required":
        return ToolChoice("required")
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if name not in {spec.name for spec in specs}:
            raise refused("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        return ToolChoice("named", name)
    return AUTO


class OpenAIResponses:
    """``POST /v1/responses``, with its own store of answers for ``previous_response_id``."""

    kind = "responses"
    validation = "responses"

    def __init__(self, model: str, responses_kept: int) -> None:
        self.model = model
        self.store = ResponseStore(responses_kept)

    @staticmethod
    def response_id() -> str:
        return f"resp_{random_hex()}"

    def error(self, err: BadRequest) -> Response:
        return error_response(err.status, str(err), err.param, err.error_type)

    def plan(self, body: Mapping[str, Any]) -> PromptPlan:
        instructions = body.get("instructions")
        previous_id = body.get("previous_response_id")
        previous = None
        if previous_id is not None:
            previous = self.store.get(previous_id)
            if previous is None:
                raise BadRequest(f"Response with id '{previous_id}' not found.", "response_id", status=404,
                                 error_type="invalid_request_error")
        messages = response_chat_messages(body["input"])
        if instructions is not None and (previous is None or instructions != previous.instructions):
            messages = [{"role": "system", "content": instructions}, *messages]
        if not messages:
            raise BadRequest(EMPTY_CONVERSATION)
        refuse_media(messages, self.model)
        tools = [tool for tool in body.get("tools") or () if tool.get("type") == "function"]
        specs = tuple(ToolSpec(tool["name"], tool.get("parameters")) for tool in tools)
        choice = _responses_tool_choice(body, specs)
        chat_tools = [{"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")
                                                        if tool.get(key) is not None}} for tool in tools]

        def render(tokenizer: PseudoTokenizer) -> list[int]:
            if previous is None:
                return tokenizer.render_chat(messages, chat_tools, param="input")
            # The previous reply's assistant message is still open: close it, then go on.
            tokens = list(previous.tokens)
            tokens.append(END)
            tokens += tokenizer.render_chat(messages, opening=False, param="input")
            return tokens

        earlier = previous.tool_results if previous is not None else 0
        return PromptPlan(render=render, tools=specs, tool_choice=choice,
                          tool_results=earlier + count_tool_results(messages))

    def echo(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        tools = body.get("tools") or []
        return {
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "max_output_tokens": body.get("max_output_tokens"),
            "tools": tools,
            "tool_choice": body.get("tool_choice", "auto") if tools else "none",
            "store": body.get("store") is not False,
            "metadata": body.get("metadata"),
            "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
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
    def _function_call(call: Call, status: str, arguments: str) -> dict[str, Any]:
        tool = call.tool_call
        assert tool is not None
        return {"id": tool.item_id, "type": "function_call", "call_id": tool.call_id, "name": tool.name,
                "arguments": arguments, "status": status}

    @staticmethod
    def _text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}

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
            "store": echo.get("store", True), "temperature": echo.get("temperature", 1.0),
            "text": None, "tool_choice": echo.get("tool_choice", "none"),
            "tools": echo.get("tools", []), "top_p": 1.0, "truncation": "disabled",
            "metadata": echo.get("metadata"), "usage": usage,
        }

    def _remember(self, call: Call) -> None:
        if call.echo.get("store", True) and call.request.token_ids is not None:
            tokens = call.request.token_ids
            self.store.put(call.response_id, StoredResponse(
                tokens if isinstance(tokens, array) else array("I", tokens),
                call.echo.get("instructions"), call.tool_results))

    def _output(self, call: Call) -> list[Any]:
        if call.tool_call is not None:
            return [self._function_call(call, "completed", call.tool_call.arguments)]
        # vLLM marks the message item completed even when the response is incomplete
        return [self._item(call, "completed", [self._text_part(call.text)])]

    def body(self, call: Call) -> dict[str, Any]:
        self._remember(call)
        return self._response(call, self._status(call), self._output(call), self.usage(call))

    async def events(self, call: Call, progress: AsyncIterator[Progress]) -> AsyncIterator[bytes]:
        sequence = 0

        def event(event_type: str, **fields: Any) -> bytes:
            nonlocal sequence
            data = {"type": event_type, "sequence_number": sequence, **fields}
            sequence += 1
            return sse_event(event_type, data)

        opening = self._response(call, "in_progress", [], None)
        yield event("response.created", response=opening)
        yield event("response.in_progress", response=opening)
        tool = call.tool_call
        if tool is not None:
            yield event("response.output_item.added", output_index=0,
                        item=self._function_call(call, "in_progress", ""))
            where = {"item_id": tool.item_id, "output_index": 0}
        else:
            where = {"item_id": self._message_id(call), "output_index": 0, "content_index": 0}
            yield event("response.output_item.added", output_index=0,
                        item=self._item(call, "in_progress", []))
            yield event("response.content_part.added", **where, part=self._text_part(""))
        sent_arguments = 0
        try:
            async for text, produced, _finished in progress:
                if tool is not None:
                    arguments = call.arguments_through(produced)
                    if len(arguments) > sent_arguments:
                        yield event("response.function_call_arguments.delta", **where,
                                    delta=arguments[sent_arguments:])
                        sent_arguments = len(arguments)
                elif text:
                    yield event("response.output_text.delta", **where, delta=text, logprobs=[])
        except CallFailed as err:
            yield event("error", code="server_error", message=str(err), param=None)
            return
        self._remember(call)
        if tool is not None:
            yield event("response.function_call_arguments.done", **where, arguments=tool.arguments,
                        name=tool.name)
            yield event("response.output_item.done", output_index=0,
                        item=self._function_call(call, "completed", tool.arguments))
        else:
            part = self._text_part(call.text)
            yield event("response.output_text.done", **where, text=call.text, logprobs=[])
            yield event("response.content_part.done", **where, part=part)
            yield event("response.output_item.done", output_index=0, item=self._item(call, "completed", [part]))
        # vLLM ends every stream with "response.completed", its response "incomplete" when cut
        yield event("response.completed", response=self._response(call, self._status(call), self._output(call),
                                                                   self.usage(call)))
