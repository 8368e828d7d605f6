"""Who a request belongs to, and where its prompt sits among the ones seen before.

architecture.md §5.2 "Identity" and §2 "Coordinates". :func:`resolve_identity` reads the
program (session) id from the first identity source a request carries — the body's agent
contexts first, then session headers, then plain body fields (:data:`SOURCE_ORDER`) —
with its parent, its group and the client's hints (priority, deadline, expected output,
retention TTL); mints the continuation chain of the prompt, estimates its token counts, and
returns the body to forward without the identity fields Sluice consumes (``program_id``,
``agent_hint``, ``nvext.agent_context`` / ``agent_hints``, ``vllm_xargs.agentic_context``)
and without any continuation id the client sent.

A request with no identity at all is resolved by its content: its group is a hash of its
opening (model, salt, system prompt, first user message), and :attr:`Identity.continues`
names the answer it carries on from — the chain id before its last assistant turn and that
turn's fingerprint (:mod:`controller.conversations` decides which program that is).

Pure: no I/O, no clock, nothing built at import time beyond constant tables. Runs on every
request, so each message is serialised twice at most (once to estimate its tokens, once inside
:func:`scheduler.coordinates.mint_chain` to hash it).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from controller.conversations import (
    Answer,
    AnswerKey,
    anthropic_answer,
    answer_fingerprint,
    chat_answer,
    is_response_output_item,
    responses_answer,
)
from scheduler.calls import CallHints
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

# vllm-router's program scheduling contract (docs/program_scheduling.md in
# vllm-project/router): vllm_xargs.agentic_context {program_id, session_id, task_id,
# parent_program_id, root_program_id, priority, deadline_seconds, expected_output_length,
# kv_retention_ttl_seconds}, and its compatibility object agent_hint {session_id,
# parent_session_id}.
AGENTIC_CONTEXT_SOURCE = "body.vllm_xargs.agentic_context"
AGENT_HINT_SOURCE = "body.agent_hint"
# Dynamo's (docs.nvidia.com/dynamo, "Agent Context" and "Agent Hints"): nvext.agent_context
# {session_id, trajectory_id, parent_trajectory_id} (newer: workflow_id, program_id,
# parent_program_id) and nvext.agent_hints {priority, osl}.
NVEXT_CONTEXT_SOURCE = "body.nvext.agent_context"
# architecture.md §5.2, in order. The claude-code slot also reads the agent header (a child
# session); "session-id" is Codex's and OpenCode's.
SESSION_HEADERS = ("x-dynamo-session-id", "x-claude-code-session-id", "session-id", "thread-id",
                   "x-session-id")
CLAUDE_CODE_SESSION_HEADER = "x-claude-code-session-id"
CLAUDE_CODE_AGENT_HEADER = "x-claude-code-agent-id"
PARENT_HEADERS = (
    "x-dynamo-parent-session-id",
    "x-claude-code-parent-agent-id",
    "x-codex-parent-thread-id",
    "x-parent-session-id",
)
FINAL_HEADER = "x-dynamo-session-final"
USER_ID_SOURCE = "body.metadata.user_id"
CONTENT_SOURCE = "content"
CONTENT_SESSION_PREFIX = "c-"
CONTENT_SESSION_NAMESPACE = b"sluice.session.v1"
# Every source, in the order the first one present wins (docs and tests read this).
SOURCE_ORDER = (AGENTIC_CONTEXT_SOURCE, NVEXT_CONTEXT_SOURCE, AGENT_HINT_SOURCE,
                *SESSION_HEADERS, "body.session_id", "body.program_id", USER_ID_SOURCE,
                "body.prompt_cache_key", "body.previous_response_id", "body.conversation",
                CONTENT_SOURCE)

_FINAL_VALUES = frozenset({"true", "1"})
_SYSTEM_ROLES = frozenset({"system", "developer"})
# Claude Code before 2.0 put "user_<hash>_account_<uuid>_session_<uuid>" in metadata.user_id.
_LEGACY_CLAUDE_CODE_USER_ID = re.compile(r"_session_([0-9A-Za-z-]{8,64})$")
_INT32 = 2**31
# A hint's seconds are bounded so that a client cannot make the policy's arithmetic overflow.
_HINT_MAX_SECONDS = 10 * 365 * 24 * 3600.0


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
    group_id: SessionId | None = None  # programs that belong together (task, root, opening)
    hints: CallHints | None = None  # what the client said about the call
    # content source only: the answer this call carries on from (None: it opens a conversation)
    continues: AnswerKey | None = None


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
    """Resolve the session, parent, group, hints, final flag and continuation chain of one
    request.

    ``route`` is one of :data:`ROUTES`. ``headers`` is looked up with lower-case names
    (starlette ``Headers`` are case-insensitive; a plain ``dict`` has its keys lower-cased
    here). ``lookup_response`` maps a ``previous_response_id`` to the session that produced
    it, or ``None`` when unknown (the next source is then tried).

    Returns the identity and the body to forward: a shallow copy of ``body`` without
    ``program_id``, ``continuation_id``, ``agent_hint``, ``vllm_xargs.continuation_id``,
    ``vllm_xargs.agentic_context`` and ``nvext``'s ``agent_context`` / ``agent_hints`` (an
    emptied or null ``vllm_xargs`` or ``nvext`` is dropped); nested values are shared with
    ``body``, which is not mutated.

    Raises :class:`IdentityError` for an invalid id, hint or malformed body, naming the
    header or field, and ``ValueError`` for a route that is not one of :data:`ROUTES` (a
    caller's bug).
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
    contexts = _Contexts.read(body)

    found = _session(headers, body, contexts, lookup_response)
    chain = mint_chain(model or "", cache_salt, prompt.tools, prompt.elements)
    session_id, source, group, continues = found.session, found.source, found.group, None
    if session_id is None:
        session_id = _content_session(model, cache_salt, prompt.system, prompt.first_user)
        source, group = CONTENT_SOURCE, session_id
        if prompt.answer is not None:
            start, answer = prompt.answer
            continues = AnswerKey(chain.ids[start], answer_fingerprint(answer))
    parent = _parent(headers)
    if parent is None:
        parent = found.parent
    if parent == session_id:
        parent = None  # a program is not its own parent

    identity = Identity(
        session_id=session_id,
        source=source,
        parent_session_id=parent,
        final=_final(headers),
        chain=chain,
        chain_tokens=prompt.chain_tokens,
        prompt_tokens=prompt.chain_tokens[-1],
        model=model,
        group_id=group if source == CONTENT_SOURCE or group != session_id else None,
        hints=contexts.hints(),
        continues=continues,
    )
    return identity, _forward_body(body)


# -- session, parent, group, hints ----------------------------------------------------------


def _validated(value: object, source: str) -> SessionId:
    try:
        return validate_session_id(value, source)
    except InvalidIdentifier as exc:
        raise IdentityError(exc.source, exc.problem) from exc


def _object(value: Any, source: str) -> dict | None:
    """``value`` when it is an object, None when absent; anything else is the client's error."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise IdentityError(source, f"must be an object, got {_json_type(value)}")
    return value


def _optional_id(obj: dict, key: str, source: str) -> SessionId | None:
    value = obj.get(key)
    return None if value is None else _validated(value, f"{source}.{key}")


@dataclass(frozen=True, slots=True)
class _Contexts:
    """The agent contexts a body carries (vllm-router's, Dynamo's, agent_hint), read once."""

    agentic: dict | None  # vllm_xargs.agentic_context
    nvext_context: dict | None  # nvext.agent_context
    nvext_hints: dict | None  # nvext.agent_hints
    agent_hint: dict | None  # agent_hint

    @classmethod
    def read(cls, body: dict) -> _Contexts:
        xargs = body.get("vllm_xargs")
        agentic = None
        if isinstance(xargs, dict):
            agentic = _object(xargs.get("agentic_context"), AGENTIC_CONTEXT_SOURCE)
        nvext = _object(body.get("nvext"), "body.nvext")
        nvext_context = nvext_hints = None
        if nvext is not None:
            nvext_context = _object(nvext.get("agent_context"), NVEXT_CONTEXT_SOURCE)
            nvext_hints = _object(nvext.get("agent_hints"), "body.nvext.agent_hints")
        return cls(agentic, nvext_context, nvext_hints,
                   _object(body.get("agent_hint"), AGENT_HINT_SOURCE))

    def hints(self) -> CallHints | None:
        """The client's hints, each from the first context that has it (vllm-router's
        ``agentic_context`` before Dynamo's ``agent_hints``); None when there are none."""
        agentic, dynamo = self.agentic or {}, self.nvext_hints or {}
        priority = _hint_int(agentic, "priority", AGENTIC_CONTEXT_SOURCE)
        if priority is None:
            priority = _hint_int(dynamo, "priority", "body.nvext.agent_hints")
        expected = _hint_int(agentic, "expected_output_length", AGENTIC_CONTEXT_SOURCE, minimum=0)
        if expected is None:
            expected = _hint_int(dynamo, "osl", "body.nvext.agent_hints", minimum=0)
        deadline = _hint_seconds(agentic, "deadline_seconds", AGENTIC_CONTEXT_SOURCE)
        ttl = _hint_seconds(agentic, "kv_retention_ttl_seconds", AGENTIC_CONTEXT_SOURCE)
        if priority is None and expected is None and deadline is None and ttl is None:
            return None
        return CallHints(priority or 0, deadline, expected, ttl)


def _hint_int(obj: dict, key: str, source: str, minimum: int = -_INT32) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise IdentityError(f"{source}.{key}", f"must be an integer, got {_json_type(value)}")
    if not minimum <= value < _INT32:
        raise IdentityError(f"{source}.{key}", f"must be in [{minimum}, {_INT32}), got {value}")
    return value


def _hint_seconds(obj: dict, key: str, source: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise IdentityError(f"{source}.{key}", f"must be a number of seconds, got {_json_type(value)}")
    if not (math.isfinite(value) and 0 <= value <= _HINT_MAX_SECONDS):
        raise IdentityError(f"{source}.{key}", f"must be between 0 and {_HINT_MAX_SECONDS:g}, got {value}")
    return float(value)


class _Found(NamedTuple):
    session: SessionId | None  # None: no source present (the content decides)
    source: str
    parent: SessionId | None  # the parent the source implies
    group: SessionId | None  # the group the source implies


def _from_contexts(contexts: _Contexts) -> _Found | None:
    """The program named by an agent context: vllm-router's canonical one, Dynamo's, then
    ``agent_hint`` (vllm-router's precedence; each names a program more precisely than a
    session header, which usually names the whole run)."""
    agentic = contexts.agentic
    if agentic is not None:
        src = AGENTIC_CONTEXT_SOURCE
        program = _optional_id(agentic, "program_id", src) or _optional_id(agentic, "session_id", src)
        if program is not None:
            group = _optional_id(agentic, "task_id", src) or _optional_id(agentic, "root_program_id", src)
            return _Found(program, src, _optional_id(agentic, "parent_program_id", src), group)
    dynamo = contexts.nvext_context
    if dynamo is not None:
        src = NVEXT_CONTEXT_SOURCE
        run = _optional_id(dynamo, "workflow_id", src) or _optional_id(dynamo, "session_id", src)
        program = _optional_id(dynamo, "program_id", src) or _optional_id(dynamo, "trajectory_id", src)
        if program is not None or run is not None:
            parent = (_optional_id(dynamo, "parent_program_id", src)
                      or _optional_id(dynamo, "parent_trajectory_id", src))
            return _Found(program or run, src, parent, run if program is not None else None)
    hint = contexts.agent_hint
    if hint is not None:
        program = _optional_id(hint, "session_id", AGENT_HINT_SOURCE)
        if program is not None:
            return _Found(program, AGENT_HINT_SOURCE,
                          _optional_id(hint, "parent_session_id", AGENT_HINT_SOURCE), None)
    return None


def _session(
    headers: Mapping[str, str],
    body: dict,
    contexts: _Contexts,
    lookup_response: Callable[[str], SessionId | None],
) -> _Found:
    """The program id from the first source present (:data:`SOURCE_ORDER`)."""
    found = _from_contexts(contexts)
    if found is not None:
        return found

    for name in SESSION_HEADERS:
        value = headers.get(name)
        if name == CLAUDE_CODE_SESSION_HEADER:
            agent = headers.get(CLAUDE_CODE_AGENT_HEADER)
            if agent is not None:
                child = _validated(agent, CLAUDE_CODE_AGENT_HEADER)
                parent = None if value is None else _validated(value, CLAUDE_CODE_SESSION_HEADER)
                return _Found(child, CLAUDE_CODE_AGENT_HEADER, parent, None)
        if value is not None:
            return _Found(_validated(value, name), name, None, None)

    for field in ("session_id", "program_id"):
        value = body.get(field)
        if value is not None:
            source = f"body.{field}"
            return _Found(_validated(value, source), source, None, None)

    user = _claude_code_session(body)
    if user is not None:
        return _Found(user, USER_ID_SOURCE, None, None)

    value = body.get("prompt_cache_key")
    if value is not None:
        return _Found(_validated(value, "body.prompt_cache_key"), "body.prompt_cache_key", None, None)

    previous = body.get("previous_response_id")
    if previous is not None:
        source = "body.previous_response_id"
        found_session = lookup_response(_validated(previous, source))
        if found_session is not None:
            return _Found(found_session, source, None, None)

    conversation = body.get("conversation")
    if conversation is not None:
        source = "body.conversation"
        if isinstance(conversation, dict):
            return _Found(_validated(conversation.get("id"), "body.conversation.id"), source, None, None)
        if isinstance(conversation, str):
            return _Found(_validated(conversation, source), source, None, None)
        raise IdentityError(
            source, f"must be a string or an object with an id, got {_json_type(conversation)}"
        )
    return _Found(None, CONTENT_SOURCE, None, None)


def _claude_code_session(body: dict) -> SessionId | None:
    """Anthropic's ``metadata.user_id``: Claude Code 2 puts a JSON object there with its
    ``session_id``, earlier versions ``user_<hash>_account_<uuid>_session_<uuid>``; any other
    value is taken as it is (a harness that labels each run there). Anthropic's field, read
    opportunistically: a value that is no valid id is ignored, not refused."""
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user, str):
        return None
    candidate: object = user
    if user.startswith("{"):
        try:
            decoded = json.loads(user)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict) and decoded.get("session_id") is not None:
            candidate = decoded["session_id"]
    else:
        legacy = _LEGACY_CLAUDE_CODE_USER_ID.search(user)
        if legacy is not None:
            candidate = legacy.group(1)
    try:
        return validate_session_id(candidate, USER_ID_SOURCE)
    except InvalidIdentifier:
        return None


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


def _read_chat(body: dict) -> _Prompt:
    messages = _message_list(body, "messages", required=True)
    tools = _tools(body)
    system, first_user = _opening(messages)
    answer = _last_answer(messages, _is_assistant, lambda run: chat_answer(run[0]), runs=False)
    return _Prompt(tools, messages, _cumulative(tools, messages, "body.messages"), system,
                   first_user, answer)


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

    answer = _last_answer(elements, is_response_output_item, responses_answer, runs=True)
    return _Prompt(tools, elements, _cumulative(tools, elements, field), system, first_user,
                   answer)


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

    answer = _last_answer(elements, _is_assistant,
                          lambda run: anthropic_answer(run[0].get("content")), runs=False)
    return _Prompt(tools, elements, _cumulative(tools, elements, field), system, first_user,
                   answer)


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
    """The body without what Sluice consumes: identity fields, agent contexts and hints,
    client continuation ids (vLLM's ``vllm_xargs`` only takes flat values, so an
    ``agentic_context`` object there would be refused by the engine anyway)."""
    out = dict(body)
    out.pop("program_id", None)
    out.pop("continuation_id", None)
    out.pop("agent_hint", None)
    if "vllm_xargs" in out:
        xargs = out["vllm_xargs"]
        if xargs is None:
            del out["vllm_xargs"]
        elif not isinstance(xargs, dict):
            raise IdentityError("body.vllm_xargs", f"must be an object, got {_json_type(xargs)}")
        else:
            _drop_keys(out, "vllm_xargs", ("continuation_id", "agentic_context"))
    if isinstance(out.get("nvext"), dict):
        _drop_keys(out, "nvext", ("agent_context", "agent_hints"))
    elif "nvext" in out and out["nvext"] is None:
        del out["nvext"]
    return out


def _drop_keys(body: dict, key: str, names: tuple[str, ...]) -> None:
    """``body[key]`` (an object) without ``names``: replaced by a copy when it has any, removed
    when nothing is left."""
    inner = body[key]
    if not any(name in inner for name in names):
        return
    rest = {k: v for k, v in inner.items() if k not in names}
    if rest:
        body[key] = rest
    else:
        del body[key]


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
