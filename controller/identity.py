"""Who a request belongs to: its program, parent, group, hints and continuation chain.

architecture.md §5.2 "Identity" and §2 "Coordinates". :func:`resolve_identity` reads the
program (session) id from the first identity source a request carries — the body's agent
contexts first, then session headers, then plain body fields (:data:`SOURCE_ORDER`) —
with its parent, its group and the client's hints (priority, deadline, expected output,
retention TTL); mints the continuation chain of the prompt (read per route by
controller/prompt.py, which also estimates its token counts), and returns the body to
forward without the identity fields Sluice consumes (``program_id``, ``agent_hint``,
``nvext.agent_context`` / ``agent_hints``, ``vllm_xargs.agentic_context``) and without any
continuation id the client sent. A ``previous_response_id`` is looked up in
:class:`ResponseSessions`, the Responses ids the gateway has seen answered.

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
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from controller.conversations import AnswerKey, answer_fingerprint
from controller.prompt import ROUTES, IdentityError, json_type, read_prompt
from scheduler.calls import CallHints
from scheduler.coordinates import (
    ContinuationChain,
    InvalidIdentifier,
    SessionId,
    canonical,
    mint_chain,
    validate_session_id,
)

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
CONTENT_TENANT_PREFIX = b"tenant:"
# Every source, in the order the first one present wins (docs and tests read this).
SOURCE_ORDER = (AGENTIC_CONTEXT_SOURCE, NVEXT_CONTEXT_SOURCE, AGENT_HINT_SOURCE,
                *SESSION_HEADERS, "body.session_id", "body.program_id", USER_ID_SOURCE,
                "body.prompt_cache_key", "body.previous_response_id", "body.conversation",
                CONTENT_SOURCE)

_FINAL_VALUES = frozenset({"true", "1"})
# Claude Code before 2.0 put "user_<hash>_account_<uuid>_session_<uuid>" in metadata.user_id.
_LEGACY_CLAUDE_CODE_USER_ID = re.compile(r"_session_([0-9A-Za-z-]{8,64})$")
_INT32 = 2**31
# A hint's seconds are bounded so that a client cannot make the policy's arithmetic overflow.
_HINT_MAX_SECONDS = 10 * 365 * 24 * 3600.0
RESPONSE_SESSIONS_KEPT = 100_000


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


class ResponseSessions:
    """Responses API ids → the session that produced them, for a later call's
    ``previous_response_id`` (the relay puts each answered call's id; the oldest of more
    than ``limit`` go first)."""

    def __init__(self, limit: int = RESPONSE_SESSIONS_KEPT) -> None:
        self._limit = limit
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, response_id: str) -> str | None:
        return self._map.get(response_id)

    def put(self, response_id: str, session_id: str) -> None:
        self._map[response_id] = session_id
        self._map.move_to_end(response_id)
        if len(self._map) > self._limit:
            self._map.popitem(last=False)


def _no_lookup(_response_id: str) -> SessionId | None:
    return None



def resolve_identity(
    route: str,
    headers: Mapping[str, str],
    body: dict,
    lookup_response: Callable[[str], SessionId | None] = _no_lookup,
    tenant: str | None = None,
) -> tuple[Identity, dict]:
    """Resolve the session, parent, group, hints, final flag and continuation chain of one
    request.

    ``route`` is one of :data:`ROUTES`. ``headers`` is looked up with lower-case names
    (starlette ``Headers`` are case-insensitive; a plain ``dict`` has its keys lower-cased
    here). ``lookup_response`` maps a ``previous_response_id`` to the session that produced
    it, or ``None`` when unknown (the next source is then tried). ``tenant`` (the name of the
    client key the call carries, when the gateway has keys) goes into the id of a session
    named from content, so that two keys sending the same opening never share a program
    (controller/client_keys.py); None keeps the id as it always was.

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
        raise IdentityError("body", f"must be a JSON object, got {json_type(body)}")
    if type(headers) is dict:
        headers = {str(k).lower(): v for k, v in headers.items()}

    model = _optional_str(body, "model")
    cache_salt = _optional_str(body, "cache_salt")
    prompt = read_prompt(route, body)
    contexts = _Contexts.read(body)

    found = _session(headers, body, contexts, lookup_response)
    chain = mint_chain(model or "", cache_salt, prompt.tools, prompt.elements)
    session_id, source, group, continues = found.session, found.source, found.group, None
    if session_id is None:
        session_id = _content_session(model, cache_salt, prompt.system, prompt.first_user,
                                      tenant)
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
        raise IdentityError(source, f"must be an object, got {json_type(value)}")
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
        raise IdentityError(f"{source}.{key}", f"must be an integer, got {json_type(value)}")
    if not minimum <= value < _INT32:
        raise IdentityError(f"{source}.{key}", f"must be in [{minimum}, {_INT32}), got {value}")
    return value


def _hint_seconds(obj: dict, key: str, source: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise IdentityError(f"{source}.{key}", f"must be a number of seconds, got {json_type(value)}")
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
            source, f"must be a string or an object with an id, got {json_type(conversation)}"
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


class AsgiHeaders(dict):
    """A request's headers, lower-case ``str`` names (as ASGI gives them) to ``str`` values,
    the first of a repeated name kept (as Starlette's ``Headers.get`` does). Not a plain
    ``dict``, so :func:`resolve_identity` takes its names as lower-cased already."""


def asgi_headers(raw: Iterable[tuple[bytes, bytes]]) -> AsgiHeaders:
    """The headers of an ASGI scope (``scope["headers"]``) as :class:`AsgiHeaders`."""
    headers = AsgiHeaders()
    for name, value in raw:
        key = name.decode("latin-1")
        if key not in headers:
            headers[key] = value.decode("latin-1")
    return headers


# The headers an ingress hashes to find a call's shard, first present wins: Claude Code's run
# id (its sub-agents share it), then a sub-agent's parent, then the session headers — the
# order of ops/nginx/sluice-shard-key.conf, so both ingresses split programs alike.
SHARD_KEY_HEADERS = (CLAUDE_CODE_SESSION_HEADER, *PARENT_HEADERS,
                     *(name for name in SESSION_HEADERS if name != CLAUDE_CODE_SESSION_HEADER))


def shard_key(headers: Mapping[str, str]) -> str:
    """The root session an ingress hashes to pick a call's shard (lower-case header names);
    "" when no header names one: such calls (identity in the body, or from content) all go
    to one shard, since an ingress does not read bodies."""
    for name in SHARD_KEY_HEADERS:
        value = headers.get(name)
        if value:
            return value
    return ""


def _final(headers: Mapping[str, str]) -> bool:
    value = headers.get(FINAL_HEADER)
    return isinstance(value, str) and value.strip().lower() in _FINAL_VALUES


def _content_session(
    model: str | None, cache_salt: str | None, system: list[Any], first_user: Any,
    tenant: str | None = None,
) -> SessionId:
    """``c-<hex>``: the same model, salt, system prompt and first user message (and client
    key, when there is one) always give the same id, so every turn of one conversation lands
    on one program."""
    h = hashlib.blake2b(digest_size=16)
    parts = [
        CONTENT_SESSION_NAMESPACE,
        (model or "").encode("utf-8"),
        (cache_salt or "").encode("utf-8"),
        canonical(system),
        canonical(first_user),
    ]
    if tenant is not None:  # appended only then: ids without keys stay as they were
        parts.append(CONTENT_TENANT_PREFIX + tenant.encode("utf-8"))
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return SessionId(CONTENT_SESSION_PREFIX + h.hexdigest())


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
            raise IdentityError("body.vllm_xargs", f"must be an object, got {json_type(xargs)}")
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
    raise IdentityError(f"body.{key}", f"must be a string, got {json_type(value)}")
