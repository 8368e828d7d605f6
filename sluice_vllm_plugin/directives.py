"""The directive socket: KvHint-shaped envelopes in, their actions posted to the block pools.

The engine core binds a ZMQ PULL socket at ``SLUICE_DIRECTIVE_ENDPOINT`` (e.g. ``tcp://*:5590``;
unset means no socket), offset by the data-parallel rank the way vLLM offsets its KV-event
endpoint (``ZmqEventPublisher.offset_endpoint_port``: tcp port + rank, ``inproc`` gets
``_dp<rank>``). The rank is read from the engine-core process name ``EngineCore_DP<rank>``
(0 otherwise). A background thread receives one envelope per message (the wire format:
:mod:`sluice_vllm_plugin.directive_envelope`, shared with the gateway and the simworker). Each
action of a valid envelope is posted, as it was decoded, to every patched block pool's inbox
(:func:`retention.post`), so it is applied on the scheduler's thread at the next allocation,
never concurrently with one. Retention is per session for now: a ``continuation_id`` in the
payload is accepted and ignored.

Whatever arrives, the thread keeps receiving: a message that is not a valid envelope (garbage,
wrong types, nesting too deep to decode, more than one frame, over ``max_message_bytes``,
which ZMQ's ``MAXMSGSIZE`` enforces on the wire) is dropped whole, counted by reason in
``drops`` and logged with its context, at most one line every few seconds. What a valid
directive may do is bounded where it is applied (:mod:`sluice_vllm_plugin.directive_limits`,
set by ``SLUICE_DIRECTIVE_<FIELD>`` variables, e.g. ``SLUICE_DIRECTIVE_MAX_TTL_S``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections import Counter
from typing import Any, Callable

from .directive_envelope import KvAction, decode
from .directive_limits import DirectiveLimits, ThrottledLog, environment_limits, receiver_socket_options
from .zmq_auth import ServerAuth, ServerKeys, check_bind, restrict_ipc, server_keys_from_environment

logger = logging.getLogger("sluice.vllm_plugin.directives")

ENV_ENDPOINT = "SLUICE_DIRECTIVE_ENDPOINT"

# Why a message was dropped (DirectiveServer.drops).
DROP_MALFORMED = "malformed"    # not a valid envelope (any decode error, deep nesting included)
DROP_OVERSIZE = "oversize"      # over max_message_bytes where ZMQ did not cut it off
DROP_MULTIPART = "multipart"    # an envelope is one frame
DROP_FAILED = "failed"          # posting it, or receiving, raised


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
    """PULL socket on a daemon thread; ``post`` receives each action of a valid envelope."""

    # class defaults, so that a server made without __init__ (to call handle() alone) works
    limits = DirectiveLimits()
    _drops: Counter | None = None
    _drop_log: ThrottledLog | None = None

    def __init__(self, endpoint: str, post: Callable[[KvAction], Any] | None = None,
                 limits: DirectiveLimits | None = None, server_keys: ServerKeys | None = None,
                 allow_insecure_bind: bool | None = None) -> None:
        import zmq
        if allow_insecure_bind is None:  # not given: SLUICE_ZMQ_* in the engine's environment
            env_keys, allow_insecure_bind = server_keys_from_environment()
            server_keys = server_keys or env_keys
        # With keys only the gateway's key may push (CURVE server, ZAP on our own context).
        check_bind(endpoint, keyed=server_keys is not None, allow_insecure=allow_insecure_bind,
                   setting=ENV_ENDPOINT, keys_hint="SLUICE_ZMQ_SECRET_KEY_FILE and "
                   "SLUICE_ZMQ_CLIENT_KEYS_DIR", allow_hint="SLUICE_ZMQ_ALLOW_INSECURE_BIND=1")
        if post is None:
            # here, not at the top: retention imports vLLM, which this module needs only once
            # a server starts (it imports without vLLM, as tests/unit/test_layering.py does)
            from . import retention
            post = retention.post
        self.endpoint = endpoint
        self.limits = limits if limits is not None else environment_limits()
        self._post = post
        self.received = 0
        self.applied = 0
        self.dropped = 0
        self._drops = Counter()
        self._drop_log = ThrottledLog()
        self._ctx = zmq.Context() if server_keys is not None else zmq.Context.instance()
        self._auth = ServerAuth(self._ctx, server_keys) if server_keys is not None else None
        self._sock = self._ctx.socket(zmq.PULL)
        for option, value in receiver_socket_options(self.limits, server_keys):
            self._sock.setsockopt(option, value)
        self._sock.bind(endpoint)
        restrict_ipc(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-directives", daemon=True)
        self._thread.start()

    @property
    def drops(self) -> Counter:
        """Messages dropped, by reason."""
        if self._drops is None:
            self._drops = Counter()
        return self._drops

    def handle(self, message: Any) -> None:
        """Post a valid envelope's actions; drop anything else. Never raises."""
        self.received += 1
        size = len(message) if isinstance(message, (bytes, bytearray, memoryview)) else None
        if size is not None and size > self.limits.max_message_bytes:
            self._drop(DROP_OVERSIZE, f"{size} bytes, limit {self.limits.max_message_bytes}", size)
            return
        try:
            envelope = decode(message)
        except Exception as exc:  # decode errors are ValueErrors; deep nesting is a RecursionError
            self._drop(DROP_MALFORMED, f"{type(exc).__name__}: {exc}", size)
            return
        for action in envelope.actions:
            try:
                self._post(action)
            except Exception as exc:
                self._drop(DROP_FAILED, f"posting {action!r}: {type(exc).__name__}: {exc}", size)
                continue
            self.applied += 1

    def _drop(self, reason: str, problem: str, size: int | None) -> None:
        self.dropped += 1
        self.drops[reason] += 1
        if self._drop_log is None:
            self._drop_log = ThrottledLog()
        unlogged = self._drop_log.due()
        if unlogged is not None:
            logger.warning("sluice directives: dropped a message on %s (%s: %.300s; %s bytes); "
                           "%d dropped, %d not logged since the last line",
                           getattr(self, "endpoint", "?"), reason, problem,
                           "?" if size is None else size, self.dropped, unlogged)

    def _receive(self) -> Any:
        """The next message's one frame; None when it had several (the rest read and dropped,
        frame by frame, so a long multipart message is never held whole)."""
        import zmq
        frame = self._sock.recv(zmq.NOBLOCK)
        if not self._sock.getsockopt(zmq.RCVMORE):
            return frame
        frames = 1
        while self._sock.getsockopt(zmq.RCVMORE):
            self._sock.recv()
            frames += 1
        self.received += 1
        self._drop(DROP_MULTIPART, f"{frames} frames; an envelope is one", None)
        return None

    def _run(self) -> None:
        import zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(200):
                    message = self._receive()
                    if message is not None:
                        self.handle(message)
            except Exception as exc:  # never let the thread die on input
                self._drop(DROP_FAILED, f"receive failed: {type(exc).__name__}: {exc}", None)
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._ctx.term()  # a context of its own (the ZAP handler is per context)

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
