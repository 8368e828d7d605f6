"""The directive envelope: the wire format of Sluice's retention directives, the one definition
the gateway's sender (``controller/directives.py``) encodes and the engine plugin
(:mod:`sluice_vllm_plugin.directives`) and the simworker (``simworker/directive_socket.py``)
decode, so every engine accepts and rejects exactly the same input.

One KvHint-shaped envelope per message, as JSON (a message that starts with ``{``) or msgpack:

    {"protocol_version": 1, "message_id": str,
     "actions": [{"action_type": "kv.retain"|"kv.demote"|"kv.release"|"kv.offload"|"kv.prefetch",
                  "action_id": str, "action_version": int,
                  "payload": {"session_id": str (1..256), "continuation_id": str?,
                              "priority": 0..100, "ttl_s": float ≥ 0, "deadline_s": float ≥ 0?}}]}

(``priority`` and ``ttl_s`` for ``kv.retain``; ``priority`` (default 50) and ``deadline_s``
(optional) for ``kv.prefetch``; ``action_id`` and ``action_version`` are carried for tracing and
may be left out.) ``kv.offload`` and ``kv.prefetch`` address the host KV tier (vLLM's offloading
connector) in the same coordinates as retention: what they do is in
:mod:`sluice_vllm_plugin.host_tier`.

:data:`KvAction` is the table of directive verbs: the core's directive of each verb
(``scheduler/actions.py``, named alike: ``Retain`` has ``verb = "retain"``) becomes its action
by :func:`kv_action`, its payload read off the directive's fields of the same names, and every
engine applies an action by the method named after its verb (:func:`verb_of`), with its typed
payload. A new verb is a struct here and a directive there, and the methods that carry it out.

Keys this version does not know are
ignored, so a newer sender's additions reach an older engine harmlessly; a wrong type, a value
out of range, an unknown ``action_type`` or another ``protocol_version`` rejects the whole
envelope (:func:`decode` raises ``ValueError``). It lives in the plugin package, which vLLM's
environment installs on its own, and imports nothing but msgspec (a vLLM dependency too).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec

PROTOCOL_VERSION = 1
ACTION_VERSION = 1

# No longer than the gateway accepts one (scheduler/coordinates.py, SESSION_ID_MAX_LEN): a
# receiver keeps session ids as state, so a forged long one must not get that far.
SESSION_ID_MAX_LEN = 256
SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=SESSION_ID_MAX_LEN)]
Priority = Annotated[int, msgspec.Meta(ge=0, le=100)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]


class RetainPayload(msgspec.Struct, frozen=True, omit_defaults=True):
    session_id: SessionId
    priority: Priority
    ttl_s: Seconds
    # Carried for the engines; they retain per session for now and ignore it.
    continuation_id: str | None = None


class SessionPayload(msgspec.Struct, frozen=True):
    session_id: SessionId


class KvRetain(msgspec.Struct, frozen=True, tag_field="action_type", tag="kv.retain"):
    """Keep the session's cached blocks at ``priority`` for ``ttl_s`` seconds."""
    payload: RetainPayload
    action_id: str = ""
    action_version: int = ACTION_VERSION


class KvDemote(msgspec.Struct, frozen=True, tag_field="action_type", tag="kv.demote"):
    """Evict the session's cached blocks before anyone else's."""
    payload: SessionPayload
    action_id: str = ""
    action_version: int = ACTION_VERSION


class KvRelease(msgspec.Struct, frozen=True, tag_field="action_type", tag="kv.release"):
    """Back to plain LRU for the session's cached blocks."""
    payload: SessionPayload
    action_id: str = ""
    action_version: int = ACTION_VERSION


class OffloadPayload(msgspec.Struct, frozen=True, omit_defaults=True):
    session_id: SessionId
    # Carried for the engines; they offload per session for now and ignore it.
    continuation_id: str | None = None


class PrefetchPayload(msgspec.Struct, frozen=True, omit_defaults=True):
    session_id: SessionId
    continuation_id: str | None = None
    # Among favoured sessions the host tier gives up the lowest priority first.
    priority: Priority = 50
    # When the program is expected back, from receipt; the favour lasts until then (None: until
    # the session's request loads its blocks or a kv.release).
    deadline_s: Seconds | None = None


class KvOffload(msgspec.Struct, frozen=True, tag_field="action_type", tag="kv.offload"):
    """Park the session's cached blocks in the host tier, then evict them first on the GPU."""
    payload: OffloadPayload
    action_id: str = ""
    action_version: int = ACTION_VERSION


class KvPrefetch(msgspec.Struct, frozen=True, tag_field="action_type", tag="kv.prefetch"):
    """The session is about to resume: keep its host-tier blocks ahead of others'."""
    payload: PrefetchPayload
    action_id: str = ""
    action_version: int = ACTION_VERSION


KvAction = KvRetain | KvDemote | KvRelease | KvOffload | KvPrefetch

# Each action's struct and its payload's, by verb ("retain" for kv.retain).
_ACTIONS: dict[str, tuple[type, type]] = {
    action.__struct_config__.tag.removeprefix("kv."):
        (action, next(field.type for field in msgspec.structs.fields(action) if field.name == "payload"))
    for action in get_args(KvAction)
}
VERBS: tuple[str, ...] = tuple(_ACTIONS)


def verb_of(action: KvAction) -> str:
    """``retain`` for a ``kv.retain`` action: what an engine's method applying it is named."""
    return action.__struct_config__.tag.removeprefix("kv.")


def kv_action(verb: str, directive: Any, action_id: str = "") -> KvAction:
    """The ``kv.<verb>`` action of ``directive``: its payload's fields are the directive's
    attributes of the same names."""
    action, payload = _ACTIONS[verb]
    return action(payload(**{name: getattr(directive, name) for name in payload.__struct_fields__}),
                  action_id)


class Envelope(msgspec.Struct, frozen=True):
    protocol_version: Literal[1]
    message_id: str
    actions: list[KvAction]


def encode_json(envelope: Envelope) -> bytes:
    return msgspec.json.encode(envelope)


def decode(message: bytes | bytearray | memoryview) -> Envelope:
    """The envelope in ``message`` (JSON if it starts with ``{``, else msgpack); ``ValueError``
    (``msgspec.DecodeError`` / ``ValidationError``) if it is malformed in any part."""
    data = bytes(message)
    if data[:1] == b"{":
        return msgspec.json.decode(data, type=Envelope)
    return msgspec.msgpack.decode(data, type=Envelope)
