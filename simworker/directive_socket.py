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
virtual time from arrival. A malformed envelope is dropped, counted and logged; nothing here
stops the worker.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import zmq
import zmq.asyncio

from sim.engine import Engine
from sluice_vllm_plugin.directive_envelope import (
    OffloadPayload,
    PrefetchPayload,
    RetainPayload,
    SessionPayload,
    decode,
    verb_of,
)


def _should_bind(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class DirectiveSocket:
    def __init__(self, endpoint: str, engine: Engine, clock: Callable[[], float]) -> None:
        self.endpoint = endpoint
        self.bound_endpoint: str | None = None
        self._engine = engine
        self._clock = clock
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self.received = 0
        self.applied = 0
        self.dropped = 0
        self._log = structlog.get_logger("sluice.simworker.directives")

    def open(self) -> None:
        """Create and bind (or connect) the socket; raises ``zmq.ZMQError`` naming the endpoint."""
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if _should_bind(self.endpoint):
                self._socket.bind(self.endpoint)
                self.bound_endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
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
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def handle(self, message: bytes) -> None:
        """Apply one envelope's actions to the pool, or drop it whole if it is malformed."""
        self.received += 1
        try:
            envelope = decode(message)
        except ValueError as err:  # json and msgspec decode errors are ValueErrors too
            self.dropped += 1
            self._log.warning("malformed directive envelope dropped", problem=str(err),
                              dropped=self.dropped)
            return
        now = self._clock()
        for action in envelope.actions:
            getattr(self, verb_of(action))(action.payload, now)
            self.applied += 1

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

    async def serve(self) -> None:
        """Receive and apply envelopes until cancelled."""
        if self._socket is None:
            raise RuntimeError("serve() before open()")
        while True:
            self.handle(await self._socket.recv())
