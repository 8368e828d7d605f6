"""The simworker's OpenAI chat completions (``/v1/chat/completions``) and completions
(``/v1/completions``): their requests as prompts, their answers, streams and errors, in vLLM
0.32's shapes (simworker/worker.py's docstring says what they serve; simworker/apis.py what the
APIs share)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from starlette.responses import Response

from simworker.apis import EMPTY_CONVERSATION, MEDIA_PART_TYPES, count_tool_results
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


def _chat_tools(body: Mapping[str, Any]) -> tuple[tuple[ToolSpec, ...], ToolChoice]:
    """A checked chat request's function tools and its ``tool_choice`` (vLLM's default:
    "auto" with tools, "none" without)."""
    tools = body.get("tools") or []
    specs = tuple(ToolSpec(tool["function"]["name"], tool["function"].get("parameters")) for tool in tools)
    choice = body.get("tool_choice", "auto" if tools else "none")
    if not tools or choice in (None, "none"):
        return specs, NO_TOOL_CHOICE
    if choice == "required":
        return specs, ToolChoice("required")
    if isinstance(choice, dict):
        return specs, ToolChoice("named", choice["function"]["name"])
    return specs, AUTO


def _check_chat_parts(messages: list[dict[str, Any]], model: str) -> None:
    """What vLLM's chat parser refuses of content parts: media on a text-only model, and a
    part that is no content part (its message: "N validation errors for
    ValidatorIterator", pydantic's own)."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for number, part in enumerate(content):
            if not isinstance(part, dict):
                raise BadRequest(f"1 validation error for ValidatorIterator\n{number}\n  Input should be a valid "
                                 f"dictionary (messages[{index}].content[{number}])")
            kind = part.get("type")
            if kind in MEDIA_PART_TYPES:
                raise BadRequest(f"{model} is not a multimodal model")
            if kind in ("text", "input_text", "output_text", "refusal", "thinking") or kind is None:
                if not isinstance(part.get("text", part.get("refusal", part.get("thinking"))), str):
                    raise BadRequest(f"1 validation error for ValidatorIterator\n{number}.text\n  Field required "
                                     f"(messages[{index}].content[{number}])")
            else:
                raise BadRequest(f"1 validation error for ValidatorIterator\n{number}.type\n  Input should be a "
                                 f"content part type, got {kind!r} (messages[{index}].content[{number}])")


class OpenAICompletions:
    """``/v1/chat/completions`` (``kind`` "chat") and ``/v1/completions`` ("completion"),
    in vLLM's shapes."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind = kind
        self.validation = kind
        self.model = model
        self.id_prefix = "chatcmpl-" if kind == "chat" else "cmpl-"

    def response_id(self) -> str:
        return f"{self.id_prefix}{random_hex()}"

    def error(self, err: BadRequest) -> Response:
        return error_response(err.status, str(err), err.param, err.error_type)

    def plan(self, body: Mapping[str, Any]) -> PromptPlan:
        if self.kind == "completion":
            prompt = body.get("prompt")
            if prompt in (None, "", []):
                raise refused("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
            token_ids = isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)
            return PromptPlan(render=lambda tokenizer: tokenizer.render_completion(prompt), token_ids=token_ids)
        messages = body["messages"]
        if not messages:
            raise BadRequest(EMPTY_CONVERSATION)
        _check_chat_parts(messages, self.model)
        continue_final = body.get("continue_final_message") is True
        add_prompt = body.get("add_generation_prompt", True) is not False
        if continue_final and add_prompt:
            raise BadRequest("continue_final_message and add_generation_prompt are not compatible. Use "
                             "continue_final_message when you want the model to continue the final message, "
                             "and add_generation_prompt when you want to add a header that will prompt it to "
                             "start a new assistant message instead.")
        specs, choice = _chat_tools(body)
        tools = body.get("tools")
        return PromptPlan(
            render=lambda tokenizer: tokenizer.render_chat(messages, tools, add_generation_prompt=add_prompt,
                                                           continue_final_message=continue_final),
            tools=specs, tool_choice=choice, tool_results=count_tool_results(messages))

    def echo(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return {}

    @staticmethod
    def usage(call: Call) -> dict[str, Any]:
        prompt, cached, output = call.usage_counts()
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + output,
            "completion_tokens": output,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def body(self, call: Call) -> dict[str, Any]:
        if call.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": call.text, "reasoning": None}
            if call.tool_call is not None:
                # vLLM: no text before the call is content null ("" for a forced call)
                message["content"] = "" if call.tool_call.named else None
                message["tool_calls"] = [call.tool_call.as_chat_tool_call()]
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": call.finish_reason,
                      "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": call.text, "logprobs": None, "finish_reason": call.finish_reason,
                      "stop_reason": None}
            obj = "text_completion"
        return {"id": call.response_id, "object": obj, "created": call.created, "model": call.model,
                "choices": [choice], "usage": self.usage(call)}

    def _chunk(self, call: Call, choices: list[dict[str, Any]], usage: bool) -> bytes:
        body: dict[str, Any] = {
            "id": call.response_id,
            "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
            "created": call.created, "model": call.model, "choices": choices,
        }
        if usage:
            body["usage"] = self.usage(call)
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def _choice(self, call: Call, delta_or_text: Any, finish: str | None) -> dict[str, Any]:
        if call.kind == "chat":
            return {"index": 0, "delta": delta_or_text, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": finish}

    def _chat_deltas(self, call: Call, step: Progress, sent_arguments: int) -> tuple[list[dict[str, Any]], int]:
        """A step's chat deltas: the text, or the tool call's next arguments (its id, type
        and name go in the first delta, as vLLM's tool parsers stream them)."""
        tool = call.tool_call
        if tool is None:
            return [{"content": step.text}], sent_arguments
        deltas = []
        if sent_arguments < 0:
            deltas.append({"tool_calls": [{"index": 0, "id": tool.call_id, "type": "function",
                                           "function": {"name": tool.name}}]})
            sent_arguments = 0
        arguments = call.arguments_through(step.produced)
        if len(arguments) > sent_arguments:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": arguments[sent_arguments:]}}]})
            sent_arguments = len(arguments)
        return deltas, sent_arguments

    async def events(self, call: Call, progress: AsyncIterator[Progress]) -> AsyncIterator[bytes]:
        continuous = call.params.continuous_usage
        try:
            if call.kind == "chat":
                # vLLM opens every chat stream with the role, before the first token
                yield self._chunk(call, [self._choice(call, {"role": "assistant", "content": ""}, None)], continuous)
            sent_arguments = -1  # the tool call's arguments streamed so far; -1: not opened
            async for step in progress:
                finish = call.finish_reason if step.finished else None
                if call.kind != "chat":
                    yield self._chunk(call, [self._choice(call, step.text, finish)], continuous)
                    continue
                deltas, sent_arguments = self._chat_deltas(call, step, sent_arguments)
                if not deltas:
                    deltas = [{"content": ""}]
                for number, delta in enumerate(deltas):
                    last = number == len(deltas) - 1
                    yield self._chunk(call, [self._choice(call, delta, finish if last else None)], continuous)
            if call.params.include_usage:
                yield self._chunk(call, [], True)
        except CallFailed as err:
            error = {"error": {"message": str(err), "type": "InternalServerError", "code": 500}}
            yield b"data: " + msgspec.json.encode(error) + b"\n\n"
        yield b"data: [DONE]\n\n"
