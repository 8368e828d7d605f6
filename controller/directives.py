"""The directive sender: the policy's directives (``scheduler.actions.Directive``) as KvHint-shaped
envelopes to each worker's engine plugin (``sluice_vllm_plugin/directives.py``).

One ZMQ PUSH socket per worker that has a ``directives`` endpoint, connected to the plugin's
PULL socket: :meth:`ZmqDirectiveSink.add` opens it when the worker joins the fleet (at start
or at run time), :meth:`ZmqDirectiveSink.remove` closes it when the worker leaves. ``send``
is called under the admission lock, so it never blocks: a message that cannot be queued (the
socket's high-water mark reached, the engine gone) is dropped and counted. Directives are
hints, so a dropped one costs cache efficiency, never correctness; one for a worker without
a socket (no ``directives`` endpoint) is counted as sent and goes nowhere. To a worker with a
``zmq_server_key`` the socket is a CurveZMQ client (controller/zmq_keys.py): the worker accepts
its directives only because it knows the gateway's public key.
"""

from __future__ import annotations

import itertools
from typing import Any

import zmq

from controller.admission import DirectiveSink
from controller.serve_config import WorkerConfig
from controller.zmq_keys import GatewayZmqKeys
from scheduler.actions import Directive
from sluice_vllm_plugin import directive_envelope
from sluice_vllm_plugin.directive_envelope import PROTOCOL_VERSION, Envelope, KvAction, encode_json
from sluice_vllm_plugin.zmq_auth import set_client_options

SEND_HWM = 10_000


def kv_action(action: Directive, action_id: str) -> KvAction:
    """The policy's directive as the envelope's action of its verb (the wire names of
    architecture.md §5.4)."""
    return directive_envelope.kv_action(action.verb, action, action_id)


def envelope(action: Directive, message_id: str) -> Envelope:
    """One directive, one envelope: each is sent as soon as the policy returns it."""
    return Envelope(PROTOCOL_VERSION, message_id, [kv_action(action, f"{message_id}.0")])


class ZmqDirectiveSink(DirectiveSink):
    def __init__(self, log: Any | None = None, zmq_keys: GatewayZmqKeys | None = None) -> None:
        super().__init__(log)
        self._zmq_keys = zmq_keys
        self._context = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}
        self._ids = itertools.count()

    def add(self, worker: WorkerConfig) -> None:
        """Connect a PUSH socket to the worker's plugin, when it has a ``directives`` endpoint."""
        if not worker.directives:
            return
        if worker.name in self._sockets:
            raise ValueError(f"directives: a worker named {worker.name!r} has a socket already")
        keys = self._zmq_keys.client(worker) if self._zmq_keys is not None else None
        if keys is None and worker.zmq_server_key is not None:
            raise ValueError(f"directives: worker {worker.name!r} has a zmq_server_key, but this "
                             "sink was made without the gateway's keys")
        sock = self._context.socket(zmq.PUSH)
        try:
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                set_client_options(sock, keys)
            sock.connect(worker.directives)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sockets[worker.name] = sock

    def remove(self, worker: str) -> None:
        """Close the worker's socket (directives still queued on it are dropped: hints)."""
        super().remove(worker)
        sock = self._sockets.pop(worker, None)
        if sock is not None:
            sock.close(linger=0)

    def endpoints(self) -> dict[str, str]:
        """The workers with an open socket, and the endpoint each is connected to."""
        return {name: sock.getsockopt_string(zmq.LAST_ENDPOINT) for name, sock in self._sockets.items()}

    def send(self, action: Directive) -> None:
        super().send(action)
        worker = action.worker
        sock = self._sockets.get(worker) if worker is not None else None
        if sock is None:
            return
        message = encode_json(envelope(action, f"sluice-{next(self._ids)}"))
        try:
            sock.send(message, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped[worker] = self.dropped.get(worker, 0) + 1
            if self._log is not None:
                self._log.warning("directive dropped: queue to the worker is full",
                                  worker=worker, session_id=action.session_id,
                                  dropped=self.dropped[worker])

    async def aclose(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._context.term()
