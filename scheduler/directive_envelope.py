"""The directive envelope: the wire format of Sluice's retention directives, written by the
gateway (``controller/directives.py``) and read by the engine plugin
(``controller/vllm_plugin/directives.py``) and the simworker (``sim/directive_socket.py``).

One KvHint-shaped envelope per message, as JSON (a message that starts with ``{``) or msgpack:

    {"protocol_version": 1, "message_id": str,
     "actions": [{"action_id": str, "action_type": "kv.retain"|"kv.demote"|"kv.release",
                  "action_version": int, "payload": {"session_id": str,
                  "continuation_id": str?, "priority": 0..100, "ttl_s": float}}]}

(``priority`` and ``ttl_s`` only for ``kv.retain``.) It lives in the core because it is data
both shells speak, like the KV-event structs; it imports only the standard library (msgpack
decoding imports msgspec when a msgpack message arrives), so the plugin can load it inside
vLLM's environment.
"""

from __future__ import annotations

import json
from typing import Any

from scheduler.actions import Demote, Release, Retain

PROTOCOL_VERSION = 1
ACTION_VERSION = 1
_PARSED_ACTIONS = {"kv.retain": "retain", "kv.demote": "demote", "kv.release": "release"}


def envelope(action: Retain | Demote | Release, message_id: str) -> dict[str, Any]:
    """One action as a KvHint envelope (DESIGN.md §5 "Directives")."""
    payload: dict[str, Any] = {"session_id": action.session_id}
    if isinstance(action, Retain):
        kind = "kv.retain"
        payload.update(priority=action.priority, ttl_s=action.ttl_s)
        if action.continuation_id is not None:
            payload["continuation_id"] = action.continuation_id
    elif isinstance(action, Demote):
        kind = "kv.demote"
    elif isinstance(action, Release):
        kind = "kv.release"
    else:
        raise TypeError(f"not a directive: {action!r}")
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": message_id,
        "actions": [{"action_id": f"{message_id}.0", "action_type": kind,
                     "action_version": ACTION_VERSION, "payload": payload}],
    }


def parse_envelope(raw: bytes | dict) -> list[tuple[str, str, int, float]]:
    """Validated ``(action, session_id, priority, ttl_s)`` tuples; ValueError if malformed."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        data = bytes(raw)
        if data[:1] == b"{":
            env = json.loads(data)
        else:
            import msgspec
            env = msgspec.msgpack.decode(data)
    else:
        env = raw
    if not isinstance(env, dict):
        raise ValueError("envelope is not a map")
    if env.get("protocol_version") != PROTOCOL_VERSION:
        raise ValueError(f"unsupported protocol_version {env.get('protocol_version')!r}")
    if not isinstance(env.get("message_id"), str):
        raise ValueError("message_id must be a string")
    actions = env.get("actions")
    if not isinstance(actions, list):
        raise ValueError("actions must be a list")
    out = []
    for a in actions:
        if not isinstance(a, dict):
            raise ValueError("action is not a map")
        kind = _PARSED_ACTIONS.get(a.get("action_type"))
        if kind is None:
            raise ValueError(f"unknown action_type {a.get('action_type')!r}")
        payload = a.get("payload")
        if not isinstance(payload, dict):
            raise ValueError("payload is not a map")
        session = payload.get("session_id")
        if not isinstance(session, str) or not session:
            raise ValueError("session_id must be a non-empty string")
        cont = payload.get("continuation_id")
        if cont is not None and not isinstance(cont, str):
            raise ValueError("continuation_id must be a string")
        priority, ttl = 50, 0.0
        if kind == "retain":
            priority, ttl = payload.get("priority"), payload.get("ttl_s")
            if type(priority) is not int or not 0 <= priority <= 100:
                raise ValueError("priority must be an int in 0..100")
            if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl >= 0:
                raise ValueError("ttl_s must be a number >= 0")
        out.append((kind, session, priority, float(ttl)))
    return out
