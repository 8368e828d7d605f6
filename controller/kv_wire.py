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
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager

import msgspec
import zmq
import zmq.asyncio

END_SEQ = b"\xff" * 8
TOPIC_PREFIX = "kv@"


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


def attach(socket: zmq.Socket, endpoint: str) -> str:
    """Bind an endpoint holding a wildcard, connect to any other; the endpoint in effect."""
    if "*" in endpoint:
        socket.bind(endpoint)
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)
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
async def replay_from(context: zmq.asyncio.Context, endpoint: str, start_seq: int, timeout_s: float
                 ) -> AsyncIterator[Callable[[], Awaitable[tuple[int, bytes] | None]]]:
    """Ask ``endpoint`` for every buffered batch from ``start_seq`` on; yields a function
    returning the next ``(seq, payload)``, or None after the end marker."""
    socket = context.socket(zmq.DEALER)  # a fresh one: no late answer to an old ask
    timeout_ms = max(1, int(timeout_s * 1000))
    try:
        socket.setsockopt(zmq.LINGER, 0)
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
