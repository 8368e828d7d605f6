"""Who a request belongs to, and where its prompt sits among the ones seen before.

architecture.md §5.2 "Identity" and §2 "Coordinates". :func:`resolve_identity` reads the session id
from the first identity source a request carries (headers first, then body fields, then a
hash of the conversation's opening), the parent session and the ``final`` flag, mints the
continuation chain of the prompt, estimates its token counts, and returns the body to forward
without ``program_id`` and without any continuation id the client sent.

Pure: no I/O, no clock, nothing built at import time beyond constant tables. Runs on every
request, so each message is serialised twice at most (once to estimate its tokens, once inside
:func:`scheduler.coordinates.mint_chain` to hash it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.coordinates import (
    ContinuationChain,
    InvalidIdentifier,
    SessionId,
    canonical,
    mint_chain,
    validate_session_id,
)

ROUTE_CHAT = "/v1/chat/completions"
ROUTE_COMPLETIONS = "/v1/completions"
ROUTE_RESPONSES = "/v1/responses"
ROUTE_MESSAGES = "/v1/messages"
ROUTES = frozenset({ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_RESPONSES, ROUTE_MESSAGES})

# architecture.md §5.2, in order. The claude-code slot also reads the agent header (a child session).
SESSION_HEADERS = ("x-dynamo-session-id", "x-claude-code-session-id", "thread-id", "x-session-id")
CLAUDE_CODE_SESSION_HEADER = "x-claude-code-session-id"
CLAUDE_CODE_AGENT_HEADER = "x-claude-code-agent-id"
PARENT_HEADERS = (
    "x-dynamo-parent-session-id",
    "x-claude-code-parent-agent-id",
    "x-codex-parent-thread-id",
    "x-parent-session-id",
)
FINAL_HEADER = "x-dynamo-session-final"
CONTENT_SOURCE = "content"
CONTENT_SESSION_PREFIX = "c-"
CONTENT_SESSION_NAMESPACE = b"sluice.session.v1"

_FINAL_VALUES = frozenset({"true", "1"})
_SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True, slots=True)
class Identity:
    """What the gateway learned about one request before admitting it."""

    session_id: SessionId
    source: str  # the header or body field it came from, or "content"
    parent_session_id: SessionId | None
    final: bool  # x-dynamo-session-final: true
    chain: ContinuationChain  # minted by the gateway (scheduler.coordinates.mint_chain)
    chain_tokens: tuple[int, ...]  # estimated cumulative prompt tokens through each chain id
    prompt_tokens: int  # estimated prompt tokens of the whole request
    model: str | None


class IdentityError(ValueError):
    """A request's identity or prompt shape is invalid; the gateway answers 400.

    ``source`` names the header (``"x-session-id"``) or body field (``"body.session_id"``,
    ``"body.messages[3]"``) at fault; ``problem`` says what is wrong with it.
    """

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


def _no_lookup(_response_id: str) -> SessionId | None:
    return None


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


def resolve_identity(
    route: str,
    headers: Mapping[str, str],
    body: dict,
    lookup_response: Callable[[str], SessionId | None] = _no_lookup,
) -> tuple[Identity, dict]:
    """Resolve the session, parent, final flag and continuation chain of one request.

    ``route`` is one of :data:`ROUTES`. ``headers`` is looked up with lower-case names
    (starlette ``Headers`` are case-insensitive; a plain ``dict`` has its keys lower-cased
    here). ``lookup_response`` maps a ``previous_response_id`` to the session that produced
    it, or ``None`` when unknown (the next source is then tried).

    Returns the identity and the body to forward: a shallow copy of ``body`` without
    ``program_id``, ``continuation_id``, ``vllm_xargs.continuation_id`` (an emptied or null
    ``vllm_xargs`` is dropped); nested values are shared with ``body``, which is not mutated.

    Raises :class:`IdentityError` for an invalid id or a malformed body, naming the header or
    field, and ``ValueError`` for a route that is not one of :data:`ROUTES` (a caller's bug).
    """
    if route not in ROUTES:
        raise ValueError(f"resolve_identity: unknown route {route!r}")
    if not isinstance(body, dict):
        raise IdentityError("body", f"must be a JSON object, got {_json_type(body)}")
    if type(headers) is dict:
        headers = {str(k).lower(): v for k, v in headers.items()}

    model = _optional_str(body, "model")
    cache_salt = _optional_str(body, "cache_salt")
    prompt = _PROMPT_READERS[route](body)

    session_id, source, implied_parent = _session(headers, body, lookup_response)
    if session_id is None:
        session_id = _content_session(model, cache_salt, prompt.system, prompt.first_user)
        source = CONTENT_SOURCE
    parent = _parent(headers)
    if parent is None:
        parent = implied_parent
    if parent == session_id:
        parent = None  # a program is not its own parent

    chain = mint_chain(model or "", cache_salt, prompt.tools, prompt.elements)
    identity = Identity(
        session_id=session_id,
        source=source,
        parent_session_id=parent,
        final=_final(headers),
        chain=chain,
        chain_tokens=prompt.chain_tokens,
        prompt_tokens=prompt.chain_tokens[-1],
        model=model,
    )
    return identity, _forward_body(body)


# -- session, parent, final ---------------------------------------------------------------


def _validated(value: object, source: str) -> SessionId:
    try:
        return validate_session_id(value, source)
    except InvalidIdentifier as exc:
        raise IdentityError(exc.source, exc.problem) from exc


def _session(
    headers: Mapping[str, str],
    body: dict,
    lookup_response: Callable[[str], SessionId | None],
) -> tuple[SessionId | None, str, SessionId | None]:
    """(session id, source, parent implied by the source) from the first source present."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if name == CLAUDE_CODE_SESSION_HEADER:
            agent = headers.get(CLAUDE_CODE_AGENT_HEADER)
            if agent is not None:
                child = _validated(agent, CLAUDE_CODE_AGENT_HEADER)
                parent = None if value is None else _validated(value, CLAUDE_CODE_SESSION_HEADER)
                return child, CLAUDE_CODE_AGENT_HEADER, parent
        if value is not None:
            return _validated(value, name), name, None

    for field in ("session_id", "program_id", "prompt_cache_key"):
        value = body.get(field)
        if value is not None:
            source = f"body.{field}"
            return _validated(value, source), source, None

    previous = body.get("previous_response_id")
    if previous is not None:
        source = "body.previous_response_id"
        found = lookup_response(_validated(previous, source))
        if found is not None:
            return found, source, None

    conversation = body.get("conversation")
    if conversation is not None:
        source = "body.conversation"
        if isinstance(conversation, dict):
            return _validated(conversation.get("id"), "body.conversation.id"), source, None
        if isinstance(conversation, str):
            return _validated(conversation, source), source, None
        raise IdentityError(
            source, f"must be a string or an object with an id, got {_json_type(conversation)}"
        )
    return None, CONTENT_SOURCE, None


def _parent(headers: Mapping[str, str]) -> SessionId | None:
    for name in PARENT_HEADERS:
        value = headers.get(name)
        if value is not None:
            return _validated(value, name)
    return None


def _final(headers: Mapping[str, str]) -> bool:
    value = headers.get(FINAL_HEADER)
    return isinstance(value, str) and value.strip().lower() in _FINAL_VALUES


def _content_session(
    model: str | None, cache_salt: str | None, system: list[Any], first_user: Any
) -> SessionId:
    """``c-<hex>``: the same model, salt, system prompt and first user message always give
    the same id, so every turn of one conversation lands on one program."""
    h = hashlib.blake2b(digest_size=16)
    for part in (
        CONTENT_SESSION_NAMESPACE,
        (model or "").encode("utf-8"),
        (cache_salt or "").encode("utf-8"),
        canonical(system),
        canonical(first_user),
    ):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return SessionId(CONTENT_SESSION_PREFIX + h.hexdigest())


# -- the prompt, per route ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Prompt:
    tools: Any  # what c0 covers (besides model and salt)
    elements: list[Any]  # one chain id each
    chain_tokens: tuple[int, ...]  # cumulative: tools, then through each element
    system: list[Any]  # system prompt parts, for the content-derived session id
    first_user: Any  # the first user message's content, likewise


def _read_chat(body: dict) -> _Prompt:
    messages = _message_list(body, "messages", required=True)
    tools = _tools(body)
    system, first_user = _opening(messages)
    return _Prompt(tools, messages, _cumulative(tools, messages, "body.messages"), system,
                   first_user)


def _read_completions(body: dict) -> _Prompt:
    prompt = body.get("prompt")
    if prompt is None:
        raise IdentityError("body.prompt", "is required")
    if not isinstance(prompt, (str, list)):
        raise IdentityError(
            "body.prompt", f"must be a string or an array, got {_json_type(prompt)}"
        )
    tools = _tools(body)
    base = _estimate(tools, "body.tools")
    return _Prompt(tools, [prompt], (base, base + _completion_prompt_tokens(prompt)), [], prompt)


def _read_responses(body: dict) -> _Prompt:
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
            "body.instructions", f"must be a string or an array, got {_json_type(instructions)}"
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
            "body.input", f"must be a string or an array, got {_json_type(raw_input)}"
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

    return _Prompt(tools, elements, _cumulative(tools, elements, field), system, first_user)


def _read_messages(body: dict) -> _Prompt:
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
            "body.system", f"must be a string or an array, got {_json_type(raw_system)}"
        )
    _, first_user = _opening(messages)

    def field(i: int) -> str:
        return "body.system" if i < offset else f"body.messages[{i - offset}]"

    return _Prompt(tools, elements, _cumulative(tools, elements, field), system, first_user)


_PROMPT_READERS: dict[str, Callable[[dict], _Prompt]] = {
    ROUTE_CHAT: _read_chat,
    ROUTE_COMPLETIONS: _read_completions,
    ROUTE_RESPONSES: _read_responses,
    ROUTE_MESSAGES: _read_messages,
}


def _message_list(body: dict, key: str, *, required: bool) -> list[Any]:
    value = body.get(key)
    if value is None:
        if required:
            raise IdentityError(f"body.{key}", "is required")
        return []
    if not isinstance(value, list):
        raise IdentityError(f"body.{key}", f"must be an array, got {_json_type(value)}")
    return _clean_items(value, f"body.{key}")


def _clean_items(items: list[Any], field: str) -> list[Any]:
    """Every item must be an object; ``cache_control`` markers are dropped (they move from
    turn to turn and never reach the engine's tokens), copying only the items that had one."""
    out = items
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise IdentityError(f"{field}[{i}]", f"must be an object, got {_json_type(item)}")
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
        raise IdentityError("body.tools", f"must be an array, got {_json_type(tools)}")
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
                f"must be a string, a token id or an array, got {_json_type(part)}",
            )
    return total


# -- the body to forward ------------------------------------------------------------------


def _forward_body(body: dict) -> dict:
    out = dict(body)
    out.pop("program_id", None)
    out.pop("continuation_id", None)
    if "vllm_xargs" in out:
        xargs = out["vllm_xargs"]
        if xargs is None:
            del out["vllm_xargs"]
        elif not isinstance(xargs, dict):
            raise IdentityError("body.vllm_xargs", f"must be an object, got {_json_type(xargs)}")
        elif "continuation_id" in xargs:
            rest = {k: v for k, v in xargs.items() if k != "continuation_id"}
            if rest:
                out["vllm_xargs"] = rest
            else:
                del out["vllm_xargs"]
    return out


def _optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is None or isinstance(value, str):
        return value
    raise IdentityError(f"body.{key}", f"must be a string, got {_json_type(value)}")


def _json_type(value: Any) -> str:
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
