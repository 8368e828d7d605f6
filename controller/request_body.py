"""A request's body: read within ``max_body_bytes`` and parsed as one JSON object.

Over the limit is a 413, answered after the rest of the body was read and dropped (up to
:data:`DRAIN_LIMIT_BYTES`) so the client gets its answer instead of a connection reset in
the middle of its upload; an empty body, one that is not JSON, not an object, or nested too
deeply to parse is a 400 (:class:`~controller.errors.GatewayError`, shaped by the route), as
is a call whose ``stream`` is not a boolean (:func:`check_stream_flag`).
The relay reads its bodies straight off ASGI (:func:`read_asgi_body`), the other routes
through Starlette (:func:`read_request_body`); both keep the same limits.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import msgspec
from starlette.requests import Request
from starlette.types import Receive

from controller.errors import INVALID_REQUEST, TOO_LARGE, GatewayError

# A body over the limit is still read (and dropped) up to this much, so the client gets
# its 413 instead of a connection reset in the middle of its upload.
DRAIN_LIMIT_BYTES = 64 * 1024 * 1024

_decoder = msgspec.json.Decoder()


class ClientGone(Exception):
    """The client disconnected before its request body was read."""


async def read_asgi_body(receive: Receive, headers: Mapping[str, str], limit: int) -> bytes:
    """The request body straight off ASGI ``receive`` (the relay's path; same limits)."""
    declared = headers.get("content-length")
    first = await receive()
    if first["type"] == "http.disconnect":
        raise ClientGone()
    body = first.get("body", b"")
    if not first.get("more_body", False) and len(body) <= limit:
        return body  # the usual case: the whole body in one message

    async def rest() -> AsyncIterator[bytes]:
        more = first.get("more_body", False)
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            more = message.get("more_body", False)
            yield message.get("body", b"")

    return await _collect(rest(), declared, limit, body)


async def read_request_body(request: Request, limit: int) -> bytes:
    """A Starlette request's body, within ``limit``."""
    return await _collect(request.stream(), request.headers.get("content-length"), limit)


def parse_json_object(body_bytes: bytes) -> dict:
    """The body as a JSON object, else the 400 that says why."""
    if not body_bytes:
        raise GatewayError(400, "request body is empty; expected a JSON object", INVALID_REQUEST)
    try:
        body = _decoder.decode(body_bytes)
    except msgspec.DecodeError as err:
        raise GatewayError(400, f"request body is not valid JSON: {err}", INVALID_REQUEST) from None
    except RecursionError:
        # msgspec recurses per nesting level and gives up at the interpreter's limit:
        # the client's mistake (or attack), not the gateway's.
        raise too_deep() from None
    if not isinstance(body, dict):
        raise GatewayError(400, "request body must be a JSON object", INVALID_REQUEST)
    return body


# JSON's names for the types a decoded body holds, for errors a client reads.
_JSON_TYPES = {str: "a string", int: "a number", float: "a number", list: "an array",
               dict: "an object"}


def check_stream_flag(body: dict) -> None:
    """A 400 unless ``stream`` is a JSON boolean, null or absent. OpenAI's and Anthropic's
    APIs refuse any other value (``"stream": "true"`` included) as an invalid type, and so
    does the gateway: taken as truthy it would be a stream the gateway does not read as one
    (no usage accounted), taken as false a surprise to a client that asked for a stream."""
    value = body.get("stream")
    if value is None or isinstance(value, bool):
        return
    raise GatewayError(400, f"invalid type for 'stream': expected a boolean (true or false), "
                            f"got {_JSON_TYPES.get(type(value), type(value).__name__)}",
                       INVALID_REQUEST, param="stream")


def too_deep() -> GatewayError:
    """The 400 of a body nested too deeply to parse, walk or encode again."""
    return GatewayError(400, "request body is nested too deeply to process", INVALID_REQUEST)


async def _collect(chunks: AsyncIterator[bytes], declared: str | None, limit: int,
                   head: bytes = b"") -> bytes:
    """``head`` and then ``chunks``, up to ``limit`` (else 413, after reading and dropping
    the rest so the client gets its answer instead of a reset)."""
    too_large = GatewayError(413, f"request body is over the limit of {limit} bytes",
                             TOO_LARGE)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(chunks, int(declared))
        raise too_large
    parts = [head]
    size = len(head)
    if size > limit:
        await _drain(chunks, size)
        raise too_large
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            await _drain(chunks, size)
            raise too_large
        parts.append(chunk)
    return b"".join(parts)


async def _drain(chunks: AsyncIterator[bytes], expected: int) -> None:
    """Read and drop the rest of a refused body (up to DRAIN_LIMIT_BYTES)."""
    if expected > DRAIN_LIMIT_BYTES:
        return  # not worth reading; the client sees the connection close
    seen = expected
    async for chunk in chunks:
        seen += len(chunk)
        if seen > DRAIN_LIMIT_BYTES:
            return
