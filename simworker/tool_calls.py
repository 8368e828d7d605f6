"""Tool-call replies: which tool a reply calls, its arguments, and the ids vLLM gives it.

A worker with ``tool_call_turns`` K > 0 (``sluice simworker --tool-call-turns K``) answers a
request that offers tools, whose ``tool_choice`` is not "none" and whose conversation holds
fewer than K tool results, with one call of one offered tool instead of text (simworker/
worker.py decides; each API shape renders the call in vLLM 0.32's shape). The tool is the
one ``tool_choice`` names, else one drawn from the call's random source; its arguments are
synthesised from the tool's JSON schema by :func:`synthesize_arguments` (every required
property filled). The reply's tokens are the call as the pseudo chat template renders it
(sim/tokens.py ``tool_calls_text``), so a client that sends the call back hits the prefix
cache through it, as with text replies.

Ids follow vLLM 0.32 with its ``hermes`` tool parser: the call's id is
``chatcmpl-tool-<16 hex>`` in every API (``vllm/renderers/chat_utils.py``
``make_tool_call_id``; the Anthropic route passes it on as the ``tool_use`` id, the Responses
route as ``call_id``), and a Responses ``function_call`` item's own id is ``fc_<16 hex>``
(``vllm/entrypoints/openai/responses/utils.py``). The hex is 64 random bits (``vllm.utils
.random_uuid``); ids come from the OS's entropy, never from a request's seed, so two seeded
calls still get different ids, as on vLLM.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from random import Random
from typing import Any

from sim.tokens import filler_sentence

# Deeper schemas (or recursive ones) end in an empty object or array.
MAX_SCHEMA_DEPTH = 6
# Arrays get one item unless the schema asks for more (then at most this many).
MAX_ARRAY_ITEMS = 3


def random_hex() -> str:
    """16 hex digits of fresh randomness, as vLLM's ``random_uuid``."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """An offered function tool: its name and its parameters' JSON schema."""

    name: str
    parameters: Mapping[str, Any] | None


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A request's ``tool_choice`` in one vocabulary: ``mode`` "none", "auto",
    "required" or "named" (then ``name`` is the tool)."""

    mode: str
    name: str | None = None


NO_TOOL_CHOICE = ToolChoice("none")
AUTO = ToolChoice("auto")


@dataclass(frozen=True, slots=True)
class ToolCallReply:
    """One tool call a reply makes. ``arguments`` is the JSON text the APIs send
    (``json.dumps`` of ``input``, as vLLM's Anthropic route re-serialises a ``tool_use``
    block's input); ``named`` says ``tool_choice`` forced it (chat then finishes with
    "stop", not "tool_calls", as vLLM does)."""

    call_id: str
    item_id: str
    name: str
    input: Any
    arguments: str
    named: bool

    def as_chat_tool_call(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def synthesize_arguments(schema: Any, rng: Random, depth: int = 0) -> Any:
    """A value that fits ``schema``: for an object its required properties (each by its
    own schema); strings are filler words, numbers and integers within ``minimum`` /
    ``maximum`` (0..100 by default), booleans drawn, an ``enum`` or ``const`` value taken
    as listed, ``anyOf`` / ``oneOf`` / ``allOf`` by their first non-null branch, arrays of
    ``minItems`` items (at least one, at most MAX_ARRAY_ITEMS)."""
    if not isinstance(schema, Mapping):
        return filler_sentence(rng, 3)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            usable = [b for b in branches if not (isinstance(b, Mapping) and b.get("type") == "null")]
            return synthesize_arguments((usable or branches)[0], rng, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        if depth >= MAX_SCHEMA_DEPTH:
            return {}
        properties = schema.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        required = schema.get("required")
        names = [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
        return {name: synthesize_arguments(properties.get(name), rng, depth + 1) for name in names}
    if kind == "array":
        if depth >= MAX_SCHEMA_DEPTH:
            return []
        wanted = schema.get("minItems")
        count = min(max(wanted, 1), MAX_ARRAY_ITEMS) if isinstance(wanted, int) else 1
        return [synthesize_arguments(schema.get("items"), rng, depth + 1) for _ in range(count)]
    if kind in ("integer", "number"):
        low = schema.get("minimum")
        high = schema.get("maximum")
        low = low if isinstance(low, (int, float)) and not isinstance(low, bool) else 0
        high = high if isinstance(high, (int, float)) and not isinstance(high, bool) else low + 100
        if high < low:
            high = low
        if kind == "integer":
            return rng.randint(math.ceil(low), max(math.ceil(low), math.floor(high)))
        return round(rng.uniform(low, high), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    text = filler_sentence(rng, rng.randint(2, 6))
    limit = schema.get("maxLength")
    return text[:limit] if isinstance(limit, int) and limit > 0 else text


def plan_tool_call(tools: Sequence[ToolSpec], choice: ToolChoice, tool_results: int,
                   turns: int, rng: Random) -> ToolCallReply | None:
    """The tool call a reply makes, or None for a text reply: None unless ``turns`` > 0,
    tools are offered, ``choice`` is not "none" and the conversation holds fewer than
    ``turns`` tool results."""
    if turns <= 0 or not tools or choice.mode == "none" or tool_results >= turns:
        return None
    named = choice.mode == "named"
    tool = next((t for t in tools if t.name == choice.name), None) if named else rng.choice(list(tools))
    if tool is None:  # the shapes refuse a named tool that is not offered; nothing to call
        return None
    arguments = synthesize_arguments(tool.parameters, rng) if tool.parameters else {}
    if not isinstance(arguments, dict):  # a function's arguments are an object, whatever the schema says
        arguments = {}
    return ToolCallReply(call_id=f"chatcmpl-tool-{random_hex()}", item_id=f"fc_{random_hex()}",
                         name=tool.name, input=arguments, arguments=json.dumps(arguments), named=named)
