"""KV-event publishing for the simworker, as vLLM 0.32's ``ZmqEventPublisher`` does it.

- PUB socket: one message per batch, frames ``[topic, seq (8 bytes big-endian), payload,
  epoch]``, ``seq`` counting from 0, ``payload`` the msgpack ``[ts, events, data_parallel_rank]``
  (``scheduler.kv_events.EventBatch``, rank 0 as vLLM's publisher fills it in), ``epoch`` 16
  random bytes drawn at each ``open`` (the Sluice engine plugin's per-start stamp,
  sluice_vllm_plugin/epoch.py); replay answers carry no epoch, as with the plugin.
- Replay ROUTER: a client (DEALER) sends ``[b"", start_seq (8 bytes big-endian)]``; the
  ROUTER answers ``[b"", topic, seq, payload]`` for every buffered batch with seq ≥ start,
  then the end marker ``[b"", b"", b"\\xff" * 8, b""]``. Requests of another shape are
  logged and ignored. The buffer keeps the last ``buffer_steps`` batches.
- An endpoint is bound if it holds ``*`` or ``::`` or is ``ipc://`` / ``inproc://``;
  otherwise the socket connects to it (vLLM's rule).
- With ``server_keys`` both sockets are CurveZMQ servers and only the clients whose public
  keys are in its directory can subscribe or ask for a replay (a ZAP handler on the
  publisher's context, :class:`sluice_vllm_plugin.zmq_auth.ServerAuth`). Without keys a socket
  is not bound beyond loopback unless ``allow_insecure_bind``; a bound ``ipc://`` file is
  made 0600.

vLLM publishes from a thread with a queue; here publishing is a non-blocking send from the
event loop (a PUB socket drops rather than blocks at its high-water mark), so batches go out
in engine order with no thread.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence

import structlog
import zmq
import zmq.asyncio

from scheduler.kv_events import EventBatch, EventBatchEncoder, KVEvent
from sluice_vllm_plugin.zmq_auth import (
    ServerAuth,
    ServerKeys,
    check_bind,
    restrict_ipc,
    set_server_options,
)

END_SEQ = b"\xff" * 8
# A replay request is [identity, b"", 8-byte start seq]; nothing a client sends the PUB or the
# ROUTER is longer than this, so a longer frame is a hostile one, refused by libzmq unread.
MAX_INBOUND_FRAME_BYTES = 1024
# Ignored replay requests are logged at most once per this many seconds (with a count).
IGNORED_LOG_EVERY_S = 10.0


def _should_bind(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, data_parallel_rank: int = 0,
                 server_keys: ServerKeys | None = None, allow_insecure_bind: bool = False) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode("utf-8")
        self.hwm = hwm
        self.data_parallel_rank = data_parallel_rank
        self.server_keys = server_keys
        self.allow_insecure_bind = allow_insecure_bind
        self._auth: ServerAuth | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = EventBatchEncoder()
        self._next_seq = 0
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self.bound_endpoint: str | None = None
        self.bound_replay_endpoint: str | None = None
        self.epoch: bytes | None = None
        self._log = structlog.get_logger("sluice.simworker.kv_events")
        self.ignored_requests = 0  # malformed replay requests, dropped
        self._ignored_logged_at = -IGNORED_LOG_EVERY_S

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def open(self) -> None:
        """Create and bind (or connect) the sockets; raises ``zmq.ZMQError`` naming the endpoint."""
        self._ctx = zmq.Context()
        self.epoch = os.urandom(16)
        try:
            if self.server_keys is not None:
                self._auth = ServerAuth(self._ctx, self.server_keys)
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, self.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_FRAME_BYTES)  # subscriptions only
            self.bound_endpoint = self._attach(self._pub, self.endpoint, "kv_events")
            if self.replay_endpoint:
                actx = zmq.asyncio.Context.shadow(self._ctx.underlying)
                self._replay = actx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_FRAME_BYTES)
                self.bound_replay_endpoint = self._attach(self._replay, self.replay_endpoint, "replay")
        except (zmq.ZMQError, ValueError):
            self.close()
            raise

    def _attach(self, socket: zmq.Socket, endpoint: str, setting: str) -> str:
        """Bind or connect ``socket`` (a CURVE server when there are keys); raises
        ``zmq.ZMQError`` naming the endpoint, or ``InsecureBindRefused``."""
        if self.server_keys is not None:
            set_server_options(socket, self.server_keys)
        try:
            if _should_bind(endpoint):
                check_bind(endpoint, keyed=self.server_keys is not None,
                           allow_insecure=self.allow_insecure_bind, setting=setting,
                           keys_hint="zmq_secret_key_file and zmq_client_keys_dir",
                           allow_hint="allow_insecure_bind (--allow-insecure-bind)")
                socket.bind(endpoint)
                bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
                restrict_ipc(bound)
                return bound
            socket.connect(endpoint)
            return endpoint
        except zmq.ZMQError as err:
            raise zmq.ZMQError(err.errno, f"{endpoint}: {err.strerror}") from None

    def close(self) -> None:
        for socket in (self._replay, self._pub):
            if socket is not None:
                socket.close(linger=0)
        self._replay = self._pub = None
        if self._auth is not None:
            self._auth.stop()  # its sockets live on the context: gone before it terminates
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number."""
        if self._pub is None:
            raise RuntimeError("publish() before open()")
        seq = self._next_seq
        self._next_seq += 1
        payload = self._encoder.encode(
            EventBatch(time.time() if ts is None else ts, list(events), self.data_parallel_rank))
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload, self.epoch),
                                 flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        return seq

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled (returns at once without a replay socket)."""
        socket = self._replay
        if socket is None:
            return
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                self.ignored_requests += 1
                now = time.monotonic()
                if now - self._ignored_logged_at >= IGNORED_LOG_EVERY_S:
                    self._ignored_logged_at = now
                    self._log.warning("replay request ignored: expected [identity, b'', 8-byte start_seq]",
                                      frames=len(frames), ignored_so_far=self.ignored_requests)
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            sent = 0
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await socket.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
                    sent += 1
            await socket.send_multipart((client, b"", b"", END_SEQ, b""))
            self._log.debug("replay served", start_seq=start_seq, batches=sent)
