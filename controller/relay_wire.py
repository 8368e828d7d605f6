"""What a relay process and the policy process say to each other over a Unix socket
(``sluice serve --relays N``, controller/relay_processes.py).

Each relay holds one connection to the policy process. Both ways a message is a frame:
the payload's length (4 bytes, big-endian), an ask id (8 bytes), then the payload, msgpack.
A relay sends ``Ask``s; the policy answers each with an :class:`Answer` under the same id,
every ask but :class:`Abandon` exactly once. Each ask is one method of
:class:`controller.policy_link.PolicyLink` (or a request to another route), so the messages
carry what those methods take and return: plain data, client keys by name.

Why not ZMQ, as the rest of our sockets: an ask answered over pyzmq's asyncio sockets
cost 90 µs of the relay's CPU and 67 µs of the policy's, over plain pyzmq sockets on the
event loop's reader 48 and 35, over asyncio's own Unix streams 21 and 14 (design notes,
"Relay processes"); a call makes two asks.
"""

from __future__ import annotations

import asyncio
import struct

import msgspec

from controller.admission import Admitted
from controller.conversations import AnswerKey
from scheduler.calls import CallRequest, Usage
from scheduler.coordinates import ContinuationId, SessionId


class Hello(msgspec.Struct, tag="hello"):
    """A relay's first ask: its name, for the policy process's log lines."""

    relay: str


class Admit(msgspec.Struct, tag="admit"):
    call: CallRequest


class Abandon(msgspec.Struct, tag="abandon"):
    """The relay stopped waiting for its admit (the client left, the drain cut the call):
    the call is aborted in the policy, held or admitted. No answer."""

    request_id: str


class Complete(msgspec.Struct, tag="complete"):
    request_id: str
    usage: Usage


class Abort(msgspec.Struct, tag="abort"):
    request_id: str


class Unreachable(msgspec.Struct, tag="unreachable"):
    worker: str
    problem: str


class ModelServed(msgspec.Struct, tag="model"):
    model: str


class LookupResponse(msgspec.Struct, tag="lookup_response"):
    response_id: str


class RememberResponse(msgspec.Struct, tag="remember_response"):
    response_id: str
    session_id: SessionId


class ContinueConversation(msgspec.Struct, tag="continue"):
    group: SessionId
    continues: AnswerKey | None
    head: ContinuationId
    client: str | None
    fresh_head: ContinuationId


class ConversationEnded(msgspec.Struct, tag="conversation_ended"):
    session_id: SessionId
    head: ContinuationId
    answered: bool
    fingerprint: str | None


class Claim(msgspec.Struct, tag="claim"):
    client: str
    session_id: SessionId
    parent_id: SessionId | None


class CallEnded(msgspec.Struct, tag="call_ended"):
    client: str
    session_id: SessionId


class WorkerEndpoint(msgspec.Struct, tag="worker"):
    """A worker's config, for the relay's own connections to it."""

    worker: str


class HttpRequest(msgspec.Struct, tag="http"):
    """A request to a route the relay does not serve itself (admin API, metrics, health,
    models, token counts): run by the policy process's app, answered whole."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None


Ask = (Hello | Admit | Abandon | Complete | Abort | Unreachable | ModelServed | LookupResponse
       | RememberResponse | ContinueConversation | ConversationEnded | Claim | CallEnded
       | WorkerEndpoint | HttpRequest)


class Refusal(msgspec.Struct):
    """A :class:`controller.errors.GatewayError`, field for field."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None


class AdmitAnswer(msgspec.Struct):
    admitted: Admitted | None  # None: no worker can take calls now
    worker_url: str | None  # where the admitted worker is, so a relay sees it moved
    worker_count: int


class HttpAnswer(msgspec.Struct):
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class Answer(msgspec.Struct):
    """One ask's answer: ``refusal`` set, or ``value`` (msgpack, typed by the ask)."""

    value: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    refusal: Refusal | None = None


_HEAD = struct.Struct(">IQ")  # payload length, ask id
HEAD_BYTES = _HEAD.size
NO_ANSWER = 0  # the id of an ask that wants no answer (an abandon)


# What the policy process accepts in one frame beyond a request body (``max_body_bytes``):
# the rest of an ask, a passed-on request's headers (``http:`` bounds them far below this).
ASK_HEADROOM_BYTES = 1 << 20
# What a relay accepts in one answer: a passed-on route's whole answer (the admin API's
# program list of a large fleet runs to megabytes).
ANSWER_LIMIT_BYTES = 256 << 20


class FrameTooLarge(ValueError):
    """A frame past the bound the reader was given: the peer is not one of ours."""


def frame(ask_id: int, payload: bytes) -> bytes:
    return _HEAD.pack(len(payload), ask_id) + payload


class FrameWriter:
    """Frames to one connection's transport; those of one turn of the event loop go out in
    one write (one system call for the asks, or answers, of every call that reached that
    point together)."""

    __slots__ = ("transport", "_queued")

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._queued: list[bytes] = []

    def write(self, ask_id: int, payload: bytes) -> None:
        if not self._queued:
            asyncio.get_running_loop().call_soon(self._flush)
        self._queued.append(frame(ask_id, payload))

    def _flush(self) -> None:
        data = b"".join(self._queued)
        self._queued.clear()
        if not self.transport.is_closing():
            self.transport.write(data)  # type: ignore[attr-defined]


class FrameReader:
    """Frames out of a byte stream, each at most ``limit`` bytes of payload."""

    __slots__ = ("_buffer", "_limit")

    def __init__(self, limit: int) -> None:
        self._buffer = bytearray()
        self._limit = limit

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The frames ``data`` completes, in order; FrameTooLarge past the bound."""
        buffer = self._buffer
        buffer += data
        frames = []
        start = 0
        end = len(buffer)
        while end - start >= HEAD_BYTES:
            length, ask_id = _HEAD.unpack_from(buffer, start)
            if length > self._limit:
                raise FrameTooLarge(f"a frame of {length} bytes, past the bound of {self._limit}")
            if end - start - HEAD_BYTES < length:
                break
            body = start + HEAD_BYTES
            frames.append((ask_id, bytes(buffer[body:body + length])))
            start = body + length
        del buffer[:start]
        return frames
