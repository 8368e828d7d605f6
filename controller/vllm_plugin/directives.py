"""The directive socket: KvHint-shaped envelopes in, retention directives out.

The engine core binds a ZMQ PULL socket at ``SLUICE_DIRECTIVE_ENDPOINT`` (e.g. ``tcp://*:5590``;
unset means no socket), offset by the data-parallel rank the way vLLM offsets its KV-event
endpoint (``ZmqEventPublisher.offset_endpoint_port``: tcp port + rank, ``inproc`` gets
``_dp<rank>``). The rank is read from the engine-core process name ``EngineCore_DP<rank>``
(0 otherwise). A background thread receives one envelope per message, as JSON (a message that
starts with ``{``) or msgpack:

    {"protocol_version": 1, "message_id": str,
     "actions": [{"action_id": str, "action_type": "kv.retain"|"kv.demote"|"kv.release",
                  "action_version": int, "payload": {"session_id": str,
                  "continuation_id": str?, "priority": 0..100, "ttl_s": float}}]}

(``priority`` and ``ttl_s`` only for ``kv.retain``.) Each valid action is posted to every
patched block pool's inbox (:func:`retention.post`), so it is applied on the scheduler's thread at
the next allocation, never concurrently with one. A malformed envelope or action is dropped with a
counter and a log line; nothing here can raise into the engine. Retention is per session for
now: a ``continuation_id`` in the payload is accepted and ignored.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading
from typing import Any, Callable

logger = logging.getLogger("sluice.vllm_plugin.directives")

ENV_ENDPOINT = "SLUICE_DIRECTIVE_ENDPOINT"
SUPPORTED_PROTOCOL = 1
_ACTIONS = {"kv.retain": "retain", "kv.demote": "demote", "kv.release": "release"}


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
    if env.get("protocol_version") != SUPPORTED_PROTOCOL:
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
        kind = _ACTIONS.get(a.get("action_type"))
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


def data_parallel_rank() -> int:
    name = multiprocessing.current_process().name
    if name.startswith("EngineCore_DP"):
        try:
            return int(name[len("EngineCore_DP"):])
        except ValueError:
            return 0
    return 0


def resolve_endpoint(endpoint: str, rank: int) -> str:
    from vllm.distributed.kv_events import ZmqEventPublisher
    return ZmqEventPublisher.offset_endpoint_port(endpoint, rank) or endpoint


class DirectiveServer:
    """PULL socket on a daemon thread; ``post`` receives each valid directive."""

    def __init__(self, endpoint: str, post: Callable[..., None] | None = None) -> None:
        import zmq
        if post is None:
            from . import retention
            post = retention.post
        self.endpoint = endpoint
        self._post = post
        self.received = 0
        self.applied = 0
        self.dropped = 0
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-directives", daemon=True)
        self._thread.start()

    def handle(self, message: Any) -> None:
        self.received += 1
        try:
            actions = parse_envelope(message)
        except Exception as exc:
            self.dropped += 1
            logger.warning("sluice directives: dropped malformed envelope (%s); %d dropped",
                           exc, self.dropped)
            return
        for kind, session, priority, ttl in actions:
            self._post(kind, session, priority, ttl)
            self.applied += 1

    def _run(self) -> None:
        import zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(200):
                    self.handle(self._sock.recv(zmq.NOBLOCK))
            except Exception as exc:  # never let the thread die on input
                self.dropped += 1
                logger.warning("sluice directives: receive failed: %s", exc)
        self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


_server: DirectiveServer | None = None


def start_from_env() -> DirectiveServer | None:
    """Start the socket if ``SLUICE_DIRECTIVE_ENDPOINT`` is set (once per process)."""
    global _server
    endpoint = os.environ.get(ENV_ENDPOINT, "").strip()
    if not endpoint or _server is not None:
        return _server
    try:
        _server = DirectiveServer(resolve_endpoint(endpoint, data_parallel_rank()))
        logger.info("sluice directives: listening on %s", _server.endpoint)
    except Exception as exc:
        logger.warning("sluice directives: could not bind %s: %s", endpoint, exc)
    return _server
