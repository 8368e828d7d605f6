"""The directive sender: the policy's Retain / Demote / Release actions as KvHint-shaped
envelopes to each worker's engine plugin (``controller/vllm_plugin/directives.py``).

One ZMQ PUSH socket per worker that has a ``directives`` endpoint, connected to the plugin's
PULL socket. ``send`` is called under the admission lock, so it never blocks: a message that
cannot be queued (the socket's high-water mark reached, the engine gone) is dropped and
counted. Directives are hints, so a dropped one costs cache efficiency, never correctness.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from typing import Any

import zmq

from controller.admission import Directive, DirectiveSink
from controller.serve_config import WorkerConfig
from scheduler.directive_envelope import envelope

SEND_HWM = 10_000


class ZmqDirectiveSink(DirectiveSink):
    def __init__(self, workers: Iterable[WorkerConfig], log: Any | None = None) -> None:
        super().__init__(log)
        self._context = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}
        for worker in workers:
            if worker.directives:
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(worker.directives)
                self._sockets[worker.name] = sock
        self._ids = itertools.count()

    def send(self, action: Directive) -> None:
        super().send(action)
        worker = action.worker
        sock = self._sockets.get(worker) if worker is not None else None
        if sock is None:
            return
        message = json.dumps(envelope(action, f"sluice-{next(self._ids)}"),
                             separators=(",", ":")).encode()
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
