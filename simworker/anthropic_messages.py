"""The simworker's Anthropic Messages API: its requests as prompts, its answers, streams and
errors, in vLLM 0.32's shapes (simworker/apis.py says what the APIs share).

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
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.responses import JSONResponse, Response

from simworker.apis import EMPTY_CONVERSATION, count_tool_results, sse_event
from simworker.calls import BadRequest, Call, CallFailed, Progress, PromptPlan
from simworker.tool_calls import AUTO, NO_TOOL_CHOICE, ToolChoice, ToolSpec, random_hex

# Claude Code's attribution header: a system text block that changes on every request, which
# vLLM drops so that it does not defeat prefix caching.
BILLING_HEADER = "x-anthropic-billing-header"


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
