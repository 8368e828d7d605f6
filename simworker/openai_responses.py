"""The simworker's OpenAI Responses API: its requests as prompts, its answers, streams and
errors, and the store of answers ``previous_response_id`` continues, in vLLM 0.32's shapes
(simworker/apis.py says what the APIs share).

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
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from sim.tokens import END, PseudoTokenizer
from simworker.apis import (
    EMPTY_CONVERSATION,
    count_tool_results,
    refuse_media,
    sse_event,
)
from simworker.calls import (
    BadRequest,
    Call,
    CallFailed,
    Progress,
    PromptPlan,
    error_response,
    refused,
)
from simworker.tool_calls import AUTO, NO_TOOL_CHOICE, ToolChoice, ToolSpec, random_hex

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
