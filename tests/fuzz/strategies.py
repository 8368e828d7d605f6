"""Hypothesis strategies shared by the fuzz targets: hostile JSON (nested, wrong types, huge
numbers, every kind of unicode, nesting deeper than any parser's limit), bytes that are not
JSON, plausible bodies of each API with fields swapped for such values, and HTTP headers a
careless or hostile client might send."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Beyond int64 and uint64, where msgspec and most JSON readers stop.
HUGE_INTEGERS = st.sampled_from([2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)])
INTEGERS = st.one_of(st.integers(-5, 300), st.integers(), HUGE_INTEGERS)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)  # JSON has neither
# Any code point but lone surrogates, which no JSON text in UTF-8 can carry.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
SHORT_ASCII = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), min_size=1,
                      max_size=24)

JSON_LEAVES = st.one_of(st.none(), st.booleans(), INTEGERS, FLOATS, TEXT)

JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(TEXT, inner, max_size=5)),
    max_leaves=25,
)


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of ``choices``, each ``(weight, strategy)`` drawn in proportion to its weight
    (``st.one_of`` draws its branches alike and merges repeated ones)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(range(len(table))).flatmap(table.__getitem__)


def _nest(depth: int, kind: str) -> bytes:
    if kind == "array":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


# Deeper than Python's recursion limit on purpose (it is 1000 by default).
DEEP_JSON = st.builds(_nest, st.sampled_from([50, 999, 1_001, 3_000, 20_000]),
                      st.sampled_from(["array", "object"]))


@st.composite
def deep_body(draw: st.DrawFn) -> bytes:
    """An object whose ``messages`` (or another field) is nested deeply: valid JSON, maybe too
    deep to walk after it parsed."""
    key = draw(st.sampled_from(["messages", "input", "prompt", "metadata", "vllm_xargs", "x"]))
    nested = draw(DEEP_JSON)
    return b'{"model":"sluice-sim","' + key.encode() + b'":' + nested + b"}"


# Bytes that are not a JSON object: binary noise, truncated or almost-JSON text.
NOT_JSON = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"", b"null", b"[]", b"{", b'{"model":', b"NaN", b"Infinity",
                     b'{"a":NaN}', b'{"a":1e999}', b'{"a":"\\ud800"}', b"\xef\xbb\xbf{}",
                     b'{"a":1,"a":2}', b"{}" * 3, b'"text"', b"123"]),
    st.builds(lambda t: t.encode("utf-8", "surrogatepass"), st.text(max_size=60)),
)

# Fields each API reads, and the identity fields Sluice reads from any of them.
BODY_FIELDS = [
    "model", "messages", "input", "prompt", "max_tokens", "max_completion_tokens",
    "max_output_tokens", "stream", "stream_options", "system", "tools", "tool_choice",
    "temperature", "n", "stop", "user", "metadata", "session_id", "program_id",
    "continuation_id", "previous_response_id", "conversation", "prompt_cache_key",
    "cache_salt", "vllm_xargs", "nvext", "agent_hint", "priority", "kv_transfer_params",
    "request_id", "instructions", "thinking",
]

IDENTITY_OBJECTS = st.fixed_dictionaries({}, optional={
    "program_id": st.one_of(SHORT_ASCII, JSON_VALUES),
    "session_id": st.one_of(SHORT_ASCII, JSON_VALUES),
    "parent_program_id": st.one_of(SHORT_ASCII, JSON_VALUES),
    "root_program_id": st.one_of(SHORT_ASCII, JSON_VALUES),
    "priority": JSON_VALUES,
    "deadline_seconds": st.one_of(FLOATS, JSON_VALUES),
    "expected_output_length": st.one_of(INTEGERS, JSON_VALUES),
    "kv_retention_ttl_seconds": st.one_of(FLOATS, JSON_VALUES),
})


def _message(role: str, content: Any) -> dict:
    return {"role": role, "content": content}


CONTENT = st.one_of(
    TEXT,
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "tool_result", "x"]),
                                    "text": TEXT}), max_size=3),
    JSON_VALUES,
)
MESSAGES = st.lists(st.builds(_message, st.sampled_from(["system", "developer", "user",
                                                          "assistant", "tool", "other"]),
                              CONTENT), min_size=0, max_size=4)


def _base_body(route: str) -> dict:
    """A body the route accepts, to mutate: fuzzing only shapeless values would seldom get
    past the first type check."""
    if route.endswith("/completions") and "chat" not in route:
        return {"model": "sluice-sim", "prompt": "Say hi.", "max_tokens": 4}
    if route == "/v1/responses":
        return {"model": "sluice-sim", "input": "Say hi.", "max_output_tokens": 4}
    if route.startswith("/v1/messages"):
        return {"model": "sluice-sim", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Say hi."}]}
    return {"model": "sluice-sim", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hi."}]}


@st.composite
def mutated_body(draw: st.DrawFn, route: str) -> dict:
    """A route's valid body with a few fields replaced, added or removed."""
    body = _base_body(route)
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3, 4]))):
        field = draw(st.sampled_from(BODY_FIELDS))
        choice = draw(st.integers(0, 5))
        if choice == 0:
            body.pop(field, None)
        elif choice == 1 and field in ("messages", "input"):
            body[field] = draw(MESSAGES)
        elif choice == 2 and field in ("vllm_xargs", "nvext"):
            inner = "agentic_context" if field == "vllm_xargs" else "agent_context"
            body[field] = {inner: draw(IDENTITY_OBJECTS)}
        elif choice == 3 and field == "agent_hint":
            body[field] = draw(IDENTITY_OBJECTS)
        elif choice == 4 and field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            body[field] = draw(st.one_of(st.integers(-2, 64), INTEGERS, TEXT))
        elif choice == 4 and field == "stream":
            body[field] = draw(st.one_of(st.booleans(), st.sampled_from(["true", 1, 0, None])))
        else:
            body[field] = draw(JSON_VALUES)
    return body


def encode_json(value: Any) -> bytes:
    """``value`` as JSON text (arbitrarily large integers included)."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def request_bodies(route: str) -> st.SearchStrategy[bytes]:
    """What a client might POST to ``route``, from plausible to hostile."""
    return weighted(
        # mostly bodies that get past the gateway's checks and reach the worker
        (6, st.builds(encode_json, mutated_body(route))),
        (1, st.builds(encode_json, JSON_VALUES)),
        (1, st.builds(encode_json, st.dictionaries(st.sampled_from(BODY_FIELDS), JSON_VALUES,
                                                   max_size=6))),
        (1, deep_body()),
        (1, DEEP_JSON),
        (1, NOT_JSON),
    )


# Header values as bytes: any visible Latin-1, tabs and spaces; no CR, LF or NUL, which no
# HTTP server hands on to an application.
_HEADER_BYTES = st.binary(max_size=80).map(
    lambda b: bytes(c for c in b if c == 9 or 0x20 <= c <= 0xFF and c != 0x7F))
HEADER_VALUES = weighted(
    (3, SHORT_ASCII.map(str.encode)),
    (1, _HEADER_BYTES),
    (1, st.sampled_from([b"", b" ", b"true", b"1", b"TRUE", b"false", b"0", b"yes",
                     b"\xff\xfe", b"x" * 300, b"s" * 257])),
    (1, st.integers(1, 20_000).map(lambda n: b"h" * n)),
)

SESSION_HEADER_NAMES = [
    "x-session-id", "x-dynamo-session-id", "x-claude-code-session-id", "session-id",
    "thread-id", "x-claude-code-agent-id", "x-dynamo-parent-session-id",
    "x-claude-code-parent-agent-id", "x-codex-parent-thread-id", "x-parent-session-id",
    "x-dynamo-session-final",
]
OTHER_HEADER_NAMES = [
    "content-type", "content-length", "content-encoding", "transfer-encoding", "accept",
    "accept-encoding", "priority", "x-vllm-priority", "authorization", "x-api-key", "cookie",
    "connection", "host", "expect", "x-request-id",
]
CONTENT_TYPES = st.sampled_from([b"application/json", b"text/plain", b"application/x-www-form-urlencoded",
                                 b"multipart/form-data; boundary=x", b"application/json; charset=latin-1",
                                 b"", b"*/*"])
_TOKEN = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_!#$%&'*+.^`|~"),
                 min_size=1, max_size=20)


@st.composite
def request_headers(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    """Session, parent, final, priority and content headers with hostile values, repeated
    names included, and a few made-up ones."""
    headers: list[tuple[bytes, bytes]] = []
    names = draw(st.lists(st.sampled_from(SESSION_HEADER_NAMES + OTHER_HEADER_NAMES),
                          max_size=4))
    for name in names:
        value = draw(CONTENT_TYPES) if name == "content-type" and draw(st.booleans()) else \
            draw(HEADER_VALUES)
        headers.append((name.encode(), value))
    for name in draw(st.lists(_TOKEN, max_size=2)):
        headers.append((name.encode(), draw(HEADER_VALUES)))
    return headers
