"""The directive socket: KvHint-shaped envelopes in, their actions posted to the block pools.

The engine core binds a ZMQ PULL socket at ``SLUICE_DIRECTIVE_ENDPOINT`` (e.g. ``tcp://*:5590``;
unset means no socket), offset by the data-parallel rank the way vLLM offsets its KV-event
endpoint (``ZmqEventPublisher.offset_endpoint_port``: tcp port + rank, ``inproc`` gets
``_dp<rank>``). The rank is read from the engine-core process name ``EngineCore_DP<rank>``
(0 otherwise). A background thread receives one envelope per message (the wire format:
:mod:`sluice_vllm_plugin.directive_envelope`, shared with the gateway and the simworker). Each
action of a valid envelope is posted, as it was decoded, to every patched block pool's inbox
(:func:`retention.post`), so it is applied on the scheduler's thread at the next allocation,
never concurrently with one. A malformed envelope is dropped whole with a counter and a log
line; nothing here can raise into the engine. Retention is per session for now: a
``continuation_id`` in the payload is accepted and ignored.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from typing import Any, Callable

from .directive_envelope import KvAction, decode

logger = logging.getLogger("sluice.vllm_plugin.directives")

ENV_ENDPOINT = "SLUICE_DIRECTIVE_ENDPOINT"


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

    def __init__(self, endpoint: str, post: Callable[[KvAction], None] | None = None) -> None:
        import zmq
        if post is None:
            # here, not at the top: retention imports vLLM, which this module needs only once
            # a server starts (it imports without vLLM, as tests/unit/test_layering.py does)
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
            envelope = decode(message)
        except Exception as exc:
            self.dropped += 1
            logger.warning("sluice directives: dropped malformed envelope (%s); %d dropped",
                           exc, self.dropped)
            return
        for action in envelope.actions:
            self._post(action)
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
