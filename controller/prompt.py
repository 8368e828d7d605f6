"""A request's prompt, read per route: what its continuation chain covers, its estimated
tokens, its opening and the last answer it carries (architecture.md §2 "Coordinates", §5.2
"Calls without identity").

:func:`read_prompt` reads the four APIs' bodies (chat, completions, Responses, Anthropic
Messages) into one :class:`Prompt`: the tools (what ``c0`` covers besides model and salt),
the elements that get one chain id each (system prompt, messages or input items, without
``cache_control`` markers), their cumulative estimated tokens (:func:`estimate_tokens`),
the opening (system prompt and first user message: a conversation's group) and the last
assistant turn before the end (the answer a call without identity carries back). A body
of the wrong shape is an :class:`IdentityError` naming the field.

Pure: no I/O, no clock, nothing built at import time beyond constant tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controller.conversations import (
    Answer,
    anthropic_answer,
    chat_answer,
    is_response_output_item,
    responses_answer,
)
from scheduler.coordinates import canonical

ROUTE_CHAT = "/v1/chat/completions"
ROUTE_COMPLETIONS = "/v1/completions"
ROUTE_RESPONSES = "/v1/responses"
ROUTE_MESSAGES = "/v1/messages"
ROUTES = frozenset({ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_RESPONSES, ROUTE_MESSAGES})

_SYSTEM_ROLES = frozenset({"system", "developer"})


class IdentityError(ValueError):
    """A request's identity or prompt shape is invalid; the gateway answers 400.

    ``source`` names the header (``"x-session-id"``) or body field (``"body.session_id"``,
    ``"body.messages[3]"``) at fault; ``problem`` says what is wrong with it.
    """

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


def estimate_tokens(value: Any) -> int:
    """About one token per 4 bytes of the value's text: a string as is (UTF-8), anything else
    as its canonical JSON. 0 for ``None`` and empty strings, lists and objects; otherwise ≥ 1."""
    if value is None:
        return 0
    if isinstance(value, str):
        n = len(value) if value.isascii() else len(value.encode("utf-8"))
    elif isinstance(value, (list, tuple, dict)) and not value:
        return 0
    else:
        n = len(canonical(value))
    return (n + 3) // 4


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's prompt, as the chain and the content-derived session read it."""

    tools: Any  # what c0 covers (besides model and salt)
    elements: list[Any]  # one chain id each
    chain_tokens: tuple[int, ...]  # cumulative: tools, then through each element
    system: list[Any]  # system prompt parts, for the content-derived session id
    first_user: Any  # the first user message's content, likewise
    # the last assistant turn before the end (not a final one the reply continues): the
    # index of its first element, and the turn
    answer: tuple[int, Answer] | None = None


def _last_answer(elements: list[Any], is_turn: Callable[[Any], bool],
                 read: Callable[[list[Any]], Answer], *, runs: bool) -> tuple[int, Answer] | None:
    """The last answer among ``elements`` and the index of its first element, skipping
    answer elements at the very end (a final assistant message is a prefill the reply
    continues, not an answer the call carries back). An answer is one element, or with
    ``runs`` a run of consecutive ones (a Responses answer: reasoning, message, calls)."""
    end = len(elements)
    while end and is_turn(elements[end - 1]):
        end -= 1
    stop = end
    while stop and not is_turn(elements[stop - 1]):
        stop -= 1
    if not stop:
        return None
    start = stop - 1
    if runs:
        while start and is_turn(elements[start - 1]):
            start -= 1
    return start, read(elements[start:stop])


def _is_assistant(element: Any) -> bool:
    return element.get("role") == "assistant"


def _read_chat(body: dict) -> Prompt:
    messages = _message_list(body, "messages", required=True)
    tools = _tools(body)
    system, first_user = _opening(messages)
    answer = _last_answer(messages, _is_assistant, lambda run: chat_answer(run[0]), runs=False)
    return Prompt(tools, messages, _cumulative(tools, messages, "body.messages"), system,
                   first_user, answer)


def _read_completions(body: dict) -> Prompt:
    prompt = body.get("prompt")
    if prompt is None:
        raise IdentityError("body.prompt", "is required")
    if not isinstance(prompt, (str, list)):
        raise IdentityError(
            "body.prompt", f"must be a string or an array, got {json_type(prompt)}"
        )
    tools = _tools(body)
    base = _estimate(tools, "body.tools")
    return Prompt(tools, [prompt], (base, base + _completion_prompt_tokens(prompt)), [], prompt)


def _read_responses(body: dict) -> Prompt:
    tools = _tools(body)
    elements: list[Any] = []
    system: list[Any] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        elements.append({"role": "system", "content": instructions})
        system.append(instructions)
    elif isinstance(instructions, list):
        items = _clean_items(instructions, "body.instructions")
        elements.extend(items)
        system.append(items)
    elif instructions is not None:
        raise IdentityError(
            "body.instructions", f"must be a string or an array, got {json_type(instructions)}"
        )
    n_instructions = len(elements)

    raw_input = body.get("input")
    if isinstance(raw_input, str):
        items = [{"role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        items = _clean_items(raw_input, "body.input")
    elif raw_input is None:
        items = []
    else:
        raise IdentityError(
            "body.input", f"must be a string or an array, got {json_type(raw_input)}"
        )
    elements.extend(items)
    more_system, first_user = _opening(items)
    system.extend(more_system)

    def field(i: int) -> str:
        if i < n_instructions:
            if isinstance(instructions, list):
                return f"body.instructions[{i}]"
            return "body.instructions"
        if isinstance(raw_input, list):
            return f"body.input[{i - n_instructions}]"
        return "body.input"

    answer = _last_answer(elements, is_response_output_item, responses_answer, runs=True)
    return Prompt(tools, elements, _cumulative(tools, elements, field), system, first_user,
                   answer)


def _read_messages(body: dict) -> Prompt:
    messages = _message_list(body, "messages", required=True)
    tools = _tools(body)
    raw_system = body.get("system")
    if raw_system is None:
        elements = messages
        system: list[Any] = []
        offset = 0
    elif isinstance(raw_system, (str, list)):
        if isinstance(raw_system, list):
            raw_system = [_without_cache_control(b) for b in raw_system]
        elements = [{"role": "system", "content": raw_system}, *messages]
        system = [raw_system]
        offset = 1
    else:
        raise IdentityError(
            "body.system", f"must be a string or an array, got {json_type(raw_system)}"
        )
    _, first_user = _opening(messages)

    def field(i: int) -> str:
        return "body.system" if i < offset else f"body.messages[{i - offset}]"

    answer = _last_answer(elements, _is_assistant,
                          lambda run: anthropic_answer(run[0].get("content")), runs=False)
    return Prompt(tools, elements, _cumulative(tools, elements, field), system, first_user,
                   answer)


_READERS: dict[str, Callable[[dict], Prompt]] = {
    ROUTE_CHAT: _read_chat,
    ROUTE_COMPLETIONS: _read_completions,
    ROUTE_RESPONSES: _read_responses,
    ROUTE_MESSAGES: _read_messages,
}


def read_prompt(route: str, body: dict) -> Prompt:
    """The prompt of a ``body`` sent to ``route`` (one of :data:`ROUTES`)."""
    return _READERS[route](body)


def _message_list(body: dict, key: str, *, required: bool) -> list[Any]:
    value = body.get(key)
    if value is None:
        if required:
            raise IdentityError(f"body.{key}", "is required")
        return []
    if not isinstance(value, list):
        raise IdentityError(f"body.{key}", f"must be an array, got {json_type(value)}")
    return _clean_items(value, f"body.{key}")


def _clean_items(items: list[Any], field: str) -> list[Any]:
    """Every item must be an object; ``cache_control`` markers are dropped (they move from
    turn to turn and never reach the engine's tokens), copying only the items that had one."""
    out = items
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise IdentityError(f"{field}[{i}]", f"must be an object, got {json_type(item)}")
        cleaned = _without_cache_control(item)
        if cleaned is not item:
            if out is items:
                out = list(items)
            out[i] = cleaned
    return out


def _without_cache_control(item: Any) -> Any:
    """``item`` without ``cache_control`` on itself or on the blocks of its ``content``; the
    same object when it has none."""
    if not isinstance(item, dict):
        return item
    content = item.get("content")
    new_content = content
    if isinstance(content, list):
        for i, block in enumerate(content):
            if isinstance(block, dict) and "cache_control" in block:
                if new_content is content:
                    new_content = list(content)
                new_content[i] = {k: v for k, v in block.items() if k != "cache_control"}
    if new_content is content and "cache_control" not in item:
        return item
    out = {k: v for k, v in item.items() if k != "cache_control"}
    if new_content is not content:
        out["content"] = new_content
    return out


def _tools(body: dict) -> list[Any] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise IdentityError("body.tools", f"must be an array, got {json_type(tools)}")
    return [_strip_key(t, "cache_control") for t in tools]


def _strip_key(item: Any, key: str) -> Any:
    if isinstance(item, dict) and key in item:
        return {k: v for k, v in item.items() if k != key}
    return item


def _opening(messages: list[Any]) -> tuple[list[Any], Any]:
    """System/developer contents before the first user message, and that message's content."""
    system: list[Any] = []
    for message in messages:
        role = message.get("role")
        if role == "user":
            return system, message.get("content")
        if role in _SYSTEM_ROLES:
            system.append(message.get("content"))
    return system, None


def _estimate(value: Any, field: str) -> int:
    try:
        return estimate_tokens(value)
    except (TypeError, ValueError) as exc:  # NaN/Infinity from a lenient JSON parser
        raise IdentityError(field, f"is not representable as JSON ({exc})") from exc


def _cumulative(
    tools: Any, elements: list[Any], field: str | Callable[[int], str]
) -> tuple[int, ...]:
    total = _estimate(tools, "body.tools")
    out = [total]
    for i, element in enumerate(elements):
        try:
            total += estimate_tokens(element)
        except (TypeError, ValueError) as exc:
            name = field(i) if callable(field) else f"{field}[{i}]"
            raise IdentityError(name, f"is not representable as JSON ({exc})") from exc
        out.append(total)
    return tuple(out)


def _completion_prompt_tokens(prompt: str | list[Any]) -> int:
    """A completions prompt may be text, token ids, or a batch of either."""
    if isinstance(prompt, str):
        return estimate_tokens(prompt)
    total = 0
    for i, part in enumerate(prompt):
        if isinstance(part, bool):
            raise IdentityError(f"body.prompt[{i}]", "must be a string, a token id or an array")
        if isinstance(part, int):
            total += 1
        elif isinstance(part, str):
            total += estimate_tokens(part)
        elif isinstance(part, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in part):
                raise IdentityError(f"body.prompt[{i}]", "must be an array of token ids")
            total += len(part)
        else:
            raise IdentityError(
                f"body.prompt[{i}]",
                f"must be a string, a token id or an array, got {json_type(part)}",
            )
    return total


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for the messages that refuse it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
