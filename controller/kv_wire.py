"""The KV-event wire as a subscriber reads it: vLLM's publisher frames, its topics in the
llm-d layout, and its replay socket (architecture.md §5.3).

- A message is vLLM's ``[topic, seq (8 bytes big-endian), msgpack([ts, events, rank])]``.
  An extra fourth frame, when present, is read as the publisher's *epoch*
  (:func:`publisher_epoch`, the hook for the Sluice engine plugin's per-start stamp). The
  reader peeks a batch's rank without decoding its events (:class:`RankPeek`).
- In the llm-d layout the engines publish to one bound socket with topic
  ``kv@<worker>@<model>`` (:func:`worker_from_topic`).
- Replay: a DEALER sends ``[b"", start_seq]`` and reads ``[b"", topic, seq, payload]``
  until seq −1 (:data:`END_SEQ`) (:func:`replay_from`); a data-parallel rank's replay socket is
  the rank 0 endpoint offset as vLLM offsets it (:func:`offset_endpoint`).
- Every socket that reads the wire (the subscribers and the replay DEALER) is set up by
  :func:`prepare_socket` before it connects or binds: no frame over
  :data:`MAX_MESSAGE_BYTES` is ever read, and, for a worker with a ``zmq_server_key``, the
  socket is a CurveZMQ client of that worker (controller/zmq_keys.py). A subscriber that connects is kept connected by
  :func:`reconnect_when_lost` (libzmq gives up a connection over such a frame).
- The socket bound at ``kv_events_bind`` is set up by :func:`prepare_bound_socket`: with the
  gateway's publisher keys it is a CurveZMQ server that hears only the publishers in
  ``zmq_keys.publisher_keys_dir``.
- Every socket the gateway binds (``kv_events_bind``, a worker's ``kv_events`` holding ``*``)
  is bound by :func:`bind_private`: a bound ``ipc://`` file is made 0600.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from sluice_vllm_plugin.zmq_auth import (
    ClientKeys,
    ServerAuth,
    ServerKeys,
    restrict_ipc,
    set_client_options,
    set_server_options,
)

END_SEQ = b"\xff" * 8
TOPIC_PREFIX = "kv@"

# The largest frame a KV-event socket accepts. libzmq drops the connection of a peer that
# announces a larger frame before it allocates any of it (the connection is made again, by the
# peer or by :func:`reconnect_when_lost`; a batch lost so is a gap like any other, repaired
# from replay). What vLLM sends: one batch per engine step; a BlockStored carries each stored
# block's hash (at most 33 bytes) and its tokens' ids (at most 5 bytes each), and a
# BlockRemoved (one per evicted block) about 60 bytes: some 11 bytes per token at block size
# 16. A step stores and evicts at most a few tens of thousands of tokens (its
# max_num_batched_tokens); with ``kv_cache_report_mode: "full"`` it also re-reports the cached
# prefixes of the calls it admits. 32 MiB is about three million tokens' worth, several times
# a whole GPU pool (about a million tokens for a small model on a 141 GB GPU): only dozens of
# long calls re-reported in one step would come near it, and a batch over it is lost (the
# index is reset and rebuilt, never wrong). The limit also caps what decoding one frame
# costs, which can be about twelve times its size (a list of small ints as Python objects).
MAX_MESSAGE_BYTES = 32 * 1024 * 1024


def prepare_socket(socket: zmq.Socket, client_keys: ClientKeys | None = None) -> None:
    """Set up a socket that reads KV events or replays (before it connects or binds): no
    linger at close, no frame over :data:`MAX_MESSAGE_BYTES`, and with ``client_keys`` a
    CurveZMQ client of the worker they name (which then is the only publisher it hears)."""
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if client_keys is not None:
        set_client_options(socket, client_keys)


def prepare_bound_socket(socket: zmq.Socket, server_keys: ServerKeys | None) -> ServerAuth | None:
    """Set up the SUB that ``kv_events_bind`` binds (before it binds), as
    :func:`prepare_socket` does, and with ``server_keys`` make it a CurveZMQ server with a ZAP
    handler on its context: the handler, which the caller stops once the socket is closed, or
    None without keys. Without the handler libzmq would let in any publisher that knows the
    gateway's (public) key, so it is started here, before the socket can bind."""
    prepare_socket(socket)
    if server_keys is None:
        return None
    auth = ServerAuth(socket.context, server_keys)
    set_server_options(socket, server_keys)
    return auth


def publisher_epoch(frames: list[bytes]) -> bytes | None:
    """The publisher's epoch, if the message carries one: the hook for the Sluice engine
    plugin's per-start stamp (architecture.md §5.4 (d)), sent as a fourth frame. vLLM's
    own publisher sends three frames, so its restarts show as seq going backwards."""
    return frames[3] if len(frames) > 3 and frames[3] else None


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Where a data-parallel rank's socket is, by vLLM's rule: a tcp port plus the rank
    (port 0 stays 0), ``inproc://`` names get ``_dp<rank>``. None when unknown."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit():
            return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return None


def worker_from_topic(topic: bytes, names: Iterable[str]) -> str | None:
    """The worker a ``kv@<worker>@<model>`` (or ``kv@<worker>``) topic names: the longest
    of ``names`` that fits, since names and models may both hold ``@``."""
    try:
        text = topic.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not text.startswith(TOPIC_PREFIX):
        return None
    rest = text[len(TOPIC_PREFIX):]
    for name in sorted(names, key=len, reverse=True):
        if rest == name or rest.startswith(name + "@"):
            return name
    return None


async def reconnect_when_lost(socket: zmq.asyncio.Socket, endpoint: str, log: Any) -> None:
    """Keep ``socket`` connected to ``endpoint`` until cancelled. libzmq reconnects after an
    ordinary loss, but gives a connection up for good after a protocol error, and a frame over
    :data:`MAX_MESSAGE_BYTES` is one: a single oversized frame would end a subscription. So
    every loss is answered with a fresh connection (an ordinary one merely comes back sooner),
    and logged on the 1st, 2nd, 4th, 8th ... time, so that a flood of such frames cannot flood
    the log."""
    monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    lost = 0
    try:
        while True:
            await monitor.recv_multipart()
            lost += 1
            if lost & (lost - 1) == 0:
                log.warning("KV-event connection lost (the publisher went away, or sent a frame "
                            "over the size limit); reconnecting", endpoint=endpoint, count=lost,
                            max_message_bytes=MAX_MESSAGE_BYTES)
            socket.disconnect(endpoint)
            socket.connect(endpoint)
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)


# sizeof(sockaddr_un.sun_path) on Linux less the terminating NUL: ZMQ refuses longer ipc paths.
IPC_PATH_MAX_BYTES = 107


def check_zmq_endpoint(value: str) -> str:
    """A ZMQ endpoint as zmq_bind/zmq_connect read it. ``ipc://`` is a filesystem path
    (``ipc:///abs/path``, ``ipc://relative``, ``ipc://@abstract``), not HOST:PORT, so it
    is checked apart from tcp/inproc, which a URL parser reads correctly."""
    scheme, separator, rest = value.partition("://")
    if separator and scheme == "ipc":
        if not rest or rest.endswith("/"):
            raise ValueError(f"an ipc ZMQ endpoint needs a socket path such as "
                             f"ipc:///tmp/sluice-kv.sock, got {value!r}")
        if "\x00" in rest or any(ch.isspace() for ch in rest):
            raise ValueError(f"an ipc ZMQ endpoint path cannot hold NUL or whitespace, got {value!r}")
        if len(rest.encode()) > IPC_PATH_MAX_BYTES:
            raise ValueError(f"an ipc ZMQ endpoint path is at most {IPC_PATH_MAX_BYTES} bytes "
                             f"(a Unix socket address), got {len(rest.encode())} in {value!r}")
        return value
    parts = urlsplit(value)
    if parts.scheme not in ("tcp", "ipc", "inproc") or not parts.netloc:
        raise ValueError(f"a ZMQ endpoint must look like tcp://HOST:PORT, got {value!r}")
    return value


def binds(endpoint: str) -> bool:
    """Whether :func:`attach` binds ``endpoint`` (it holds a wildcard) rather than connects.
    A worker's ``kv_events`` so written is checked as a bind when the worker joins
    (controller/serve_config.py), not against ``worker_urls``."""
    return "*" in endpoint


def bind_private(socket: zmq.Socket, endpoint: str) -> str:
    """Bind ``socket`` at ``endpoint``; the endpoint in effect. A bound ``ipc://`` file is
    made 0600 at once: whoever may open it may feed the index."""
    socket.bind(endpoint)
    bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    restrict_ipc(bound)  # the bound name: ipc://* picks a file of its own
    return bound


def attach(socket: zmq.Socket, endpoint: str) -> str:
    """Bind an endpoint holding a wildcard, connect to any other; the endpoint in effect."""
    if binds(endpoint):
        return bind_private(socket, endpoint)
    socket.connect(endpoint)
    return endpoint


class RankPeek(msgspec.Struct, array_like=True):
    """A batch with its events left undecoded: the reader only needs the rank."""

    ts: msgspec.Raw
    events: msgspec.Raw
    data_parallel_rank: int | None = None


class ReplayError(Exception):
    """The replay socket did not answer in time, or answered something else."""


@asynccontextmanager
async def replay_from(context: zmq.asyncio.Context, endpoint: str, start_seq: int, timeout_s: float,
                      client_keys: ClientKeys | None = None
                      ) -> AsyncIterator[Callable[[], Awaitable[tuple[int, bytes] | None]]]:
    """Ask ``endpoint`` for every buffered batch from ``start_seq`` on (as a CurveZMQ client
    with ``client_keys``); yields a function returning the next ``(seq, payload)``, or None
    after the end marker. A server that turns the keys away shows as no answer in time."""
    socket = context.socket(zmq.DEALER)  # a fresh one: no late answer to an old ask
    timeout_ms = max(1, int(timeout_s * 1000))
    try:
        # An answer over the size limit drops the connection: it shows as no answer in time.
        prepare_socket(socket, client_keys)
        try:
            socket.connect(endpoint)
            await socket.send_multipart((b"", start_seq.to_bytes(8, "big")), flags=zmq.NOBLOCK)
        except zmq.ZMQError as err:
            raise ReplayError(f"cannot ask {endpoint} for a replay: {err}") from None

        async def next_batch() -> tuple[int, bytes] | None:
            try:
                if not await socket.poll(timeout_ms, zmq.POLLIN):
                    raise ReplayError(f"{endpoint} did not answer within "
                                      f"{timeout_s}s")
                frames = await socket.recv_multipart()
            except zmq.ZMQError as err:
                raise ReplayError(f"replay from {endpoint} failed: {err}") from None
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                raise ReplayError(f"{endpoint} answered {len(frames)} frames, expected "
                                  "[b'', topic, seq, payload]")
            if frames[2] == END_SEQ:
                return None
            return int.from_bytes(frames[2], "big"), frames[3]

        yield next_batch
    finally:
        socket.close(linger=0)
