"""The simworker's directive socket: what the Sluice engine plugin does inside vLLM
(``sluice_vllm_plugin/directives.py``), on the simulated engine.

A ZMQ PULL socket (bound if the endpoint holds ``*`` or ``::`` or is ``ipc://`` /
``inproc://``, else connected, like the KV-event sockets) receives KvHint envelopes from the
gateway's directive sender and applies each action by the method named after its verb, as the
plugin does: ``kv.retain`` / ``kv.demote`` / ``kv.release`` to the engine's block pool, whose
retention classes are the plugin's (the fidelity test keeps them equal), and ``kv.offload`` /
``kv.prefetch`` to the engine's host tier as the plugin does on vLLM's offloading manager
(:meth:`sim.engine.Engine.offload`, ``prefetch``). Envelopes are decoded by the plugin's own
envelope module (:mod:`sluice_vllm_plugin.directive_envelope`), so both engines accept and
reject exactly the same input. Directives run on the event loop between engine iterations, as
the plugin applies them between scheduler steps; a TTL or a prefetch deadline counts in
virtual time from arrival.

What a directive may do is bounded as in the plugin (:mod:`sluice_vllm_plugin.directive_limits`:
TTLs and priorities clamped, a budget of sessions and of retained blocks, state forgotten after
a while, a message size limit), by the worker's ``directive_limits``. Whatever arrives, the
socket keeps serving: a message that is not a valid envelope (garbage, wrong types, nesting
too deep to decode, too large, several frames) is dropped, an action beyond the limits is
refused, an action whose application fails is dropped; each is counted by reason (on
``/metrics``) and logged with its context, at most one line every few seconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio

from sim.engine import Engine
from sluice_vllm_plugin.directive_envelope import (
    KvAction,
    OffloadPayload,
    PrefetchPayload,
    RetainPayload,
    SessionPayload,
    decode,
    verb_of,
)
from sluice_vllm_plugin.directive_limits import (
    DirectiveGovernor,
    DirectiveLimits,
    ThrottledLog,
    receiver_socket_options,
)
from sluice_vllm_plugin.zmq_auth import ServerAuth, ServerKeys, check_bind, restrict_ipc

# Why a message or an action was dropped (``drops``; ``governor.refused`` says why an action
# was refused by the limits).
DROP_MALFORMED = "malformed"    # not a valid envelope (any decode error, deep nesting included)
DROP_OVERSIZE = "oversize"      # over max_message_bytes where ZMQ did not cut it off
DROP_MULTIPART = "multipart"    # an envelope is one frame
DROP_FAILED = "failed"          # a valid action whose application raised

# How often, in the idle loop, state past ``forget_after_s`` is released (wall seconds).
FORGET_POLL_MS = 1000


def _should_bind(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class DirectiveSocket:
    def __init__(self, endpoint: str, engine: Engine, clock: Callable[[], float],
                 limits: DirectiveLimits | None = None, server_keys: ServerKeys | None = None,
                 allow_insecure_bind: bool = False) -> None:
        self.endpoint = endpoint
        # With keys the socket is a CURVE server and only the gateway's key may push to it.
        self.server_keys = server_keys
        self.allow_insecure_bind = allow_insecure_bind
        self._auth: ServerAuth | None = None
        self.bound_endpoint: str | None = None
        self._engine = engine
        self._clock = clock
        self.limits = limits if limits is not None else DirectiveLimits()
        self.governor = DirectiveGovernor(self.limits, blocks_of=engine.pool.session_block_count)
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self.received = 0
        self.applied = 0
        self.drops: Counter[str] = Counter()
        self._drop_log = ThrottledLog()
        self._clamp_log = ThrottledLog()
        self._log = structlog.get_logger("sluice.simworker.directives")

    @property
    def dropped(self) -> int:
        """Messages and actions dropped (malformed, too large, failed); refusals not included."""
        return sum(self.drops.values())

    @property
    def refused(self) -> int:
        return sum(self.governor.refused.values())

    def open(self) -> None:
        """Create and bind (or connect) the socket; raises ``zmq.ZMQError`` naming the endpoint."""
        if _should_bind(self.endpoint):
            check_bind(self.endpoint, keyed=self.server_keys is not None,
                       allow_insecure=self.allow_insecure_bind, setting="directives",
                       keys_hint="zmq_secret_key_file and zmq_client_keys_dir",
                       allow_hint="allow_insecure_bind (--allow-insecure-bind)")
        self._ctx = zmq.asyncio.Context()
        if self.server_keys is not None:
            self._auth = ServerAuth(self._ctx, self.server_keys)
        self._socket = self._ctx.socket(zmq.PULL)
        for option, value in receiver_socket_options(self.limits, self.server_keys):
            self._socket.setsockopt(option, value)
        try:
            if _should_bind(self.endpoint):
                self._socket.bind(self.endpoint)
                self.bound_endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
                restrict_ipc(self.bound_endpoint)
            else:
                self._socket.connect(self.endpoint)
                self.bound_endpoint = self.endpoint
        except zmq.ZMQError as err:
            self.close()
            raise zmq.ZMQError(err.errno, f"{self.endpoint}: {err.strerror}") from None

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._auth is not None:
            self._auth.stop()  # its sockets live on the context: gone before it terminates
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def handle(self, message: object) -> None:
        """Apply one envelope's actions to the engine, each within the limits; drop a message
        that is not a valid envelope. Never raises."""
        self.received += 1
        now = self._clock()
        self.forget_lapsed(now)
        size = len(message) if isinstance(message, (bytes, bytearray, memoryview)) else None
        if size is not None and size > self.limits.max_message_bytes:
            self._drop(DROP_OVERSIZE, f"{size} bytes, limit {self.limits.max_message_bytes}", size)
            return
        try:
            envelope = decode(message)  # type: ignore[arg-type]
        except Exception as err:  # decode errors are ValueErrors; deep nesting is a RecursionError
            self._drop(DROP_MALFORMED, f"{type(err).__name__}: {err}", size)
            return
        for action in envelope.actions:
            self._apply(action, now, envelope.message_id)

    def _apply(self, action: KvAction, now: float, message_id: str) -> None:
        verb = verb_of(action)
        session = action.payload.session_id
        try:
            clamped_before = self.governor.clamped
            admitted = self.governor.admit(action, now)
            if admitted is None:
                self._refused(verb, session, message_id)
                return
            if self.governor.clamped != clamped_before:
                self._clamped(action, admitted, message_id)
            getattr(self, verb)(admitted.payload, now)
        except Exception as err:  # one action's failure must not stop the socket
            self._drop(DROP_FAILED, f"{type(err).__name__}: {err}", None, verb=verb,
                       session_id=session, message_id=message_id)
            return
        self.applied += 1

    def forget_lapsed(self, now: float) -> None:
        """Release the sessions whose latest directive is ``forget_after_s`` old."""
        for session in self.governor.lapsed(now):
            try:
                self._engine.release_session(session)
            except Exception as err:
                self._drop(DROP_FAILED, f"releasing a forgotten session: {type(err).__name__}: {err}",
                           None, session_id=session)

    def _drop(self, reason: str, problem: str, size: int | None, **context: object) -> None:
        self.drops[reason] += 1
        unlogged = self._drop_log.due()
        if unlogged is not None:
            self._log.warning("directive dropped", reason=reason, problem=problem[:200], size=size,
                              endpoint=self.bound_endpoint, dropped=self.dropped,
                              not_logged_since_last=unlogged, **context)

    def _refused(self, verb: str, session: str, message_id: str) -> None:
        unlogged = self._drop_log.due()
        if unlogged is not None:
            self._log.warning("directive refused by the worker's directive limits", verb=verb,
                              session_id=session[:200], message_id=message_id[:200],
                              refused=dict(self.governor.refused), sessions=self.governor.sessions,
                              retained_blocks=self.governor.retained_blocks,
                              not_logged_since_last=unlogged)

    def _clamped(self, sent: KvAction, applied: KvAction, message_id: str) -> None:
        unlogged = self._clamp_log.due()
        if unlogged is not None:
            self._log.info("directive clamped to the worker's directive limits", verb=verb_of(sent),
                           session_id=sent.payload.session_id[:200], message_id=message_id[:200],
                           sent=str(sent.payload)[:300], applied=str(applied.payload)[:300],
                           clamped=self.governor.clamped, not_logged_since_last=unlogged)

    # the verbs: each takes its action's payload and when it arrived

    def retain(self, payload: RetainPayload, now: float) -> None:
        self._engine.pool.retain(payload.session_id, payload.priority, payload.ttl_s, now)

    def demote(self, payload: SessionPayload, now: float) -> None:
        self._engine.pool.demote(payload.session_id)

    def release(self, payload: SessionPayload, now: float) -> None:
        self._engine.release_session(payload.session_id)

    def offload(self, payload: OffloadPayload, now: float) -> None:
        self._engine.offload(payload.session_id)

    def prefetch(self, payload: PrefetchPayload, now: float) -> None:
        self._engine.prefetch(payload.session_id, payload.priority, payload.deadline_s, now)

    async def receive(self) -> bytes | None:
        """The next message's one frame; None when it had several (the rest read and dropped,
        frame by frame, so a long multipart message is never held whole)."""
        sock = self._socket
        if sock is None:
            raise RuntimeError("receive() before open()")
        frame = await sock.recv()
        if not sock.getsockopt(zmq.RCVMORE):
            return frame
        frames = 1
        while sock.getsockopt(zmq.RCVMORE):
            await sock.recv()
            frames += 1
        self.received += 1
        self._drop(DROP_MULTIPART, f"{frames} frames; an envelope is one", None)
        return None

    async def serve(self) -> None:
        """Receive and apply envelopes until cancelled; forget lapsed state while idle."""
        if self._socket is None:
            raise RuntimeError("serve() before open()")
        while True:
            if not await self._socket.poll(FORGET_POLL_MS):
                self.forget_lapsed(self._clock())
                continue
            message = await self.receive()
            if message is not None:
                self.handle(message)
