"""The error shapes the gateway answers with, one per API family.

OpenAI routes (and everything else): ``{"error": {"message", "type", "code"}}``. ``code`` is
the HTTP status (as vLLM's own error bodies carry it) unless the error names a code of its
own (``model_not_found``, as OpenAI's API answers an unknown model); ``param`` is added when
the error is about one header or body field (an invalid session id, say).

Anthropic routes (``/v1/messages`` and below): ``{"type": "error", "error": {"type",
"message"}}`` with one of the error types Anthropic documents, chosen from the HTTP status,
because the Anthropic SDKs and Claude Code read ``error.type`` and expect only those.

The gateway's own shortages (descriptors, socket buffers, memory) are told apart from the
workers' faults: :func:`local_shortage` finds one in a failure's chain, and
:func:`out_of_local_resources` is the 503 a call gets for it (code
``gateway_out_of_resources``), so that no worker is blamed for what the gateway lacks.
"""

from __future__ import annotations

import errno
import json

from starlette.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
TOO_LARGE = "request_too_large"
AUTHENTICATION = "authentication_error"
PERMISSION = "permission_error"
UPSTREAM = "upstream_error"
UPSTREAM_TIMEOUT = "upstream_timeout"
UNAVAILABLE = "service_unavailable"
INTERNAL = "internal_error"
RATE_LIMITED = "rate_limit_error"
MODEL_NOT_FOUND = "model_not_found"  # OpenAI's error code for a model it does not serve
INVALID_API_KEY = "invalid_api_key"  # OpenAI's error code for a missing or wrong key
# the error code of a 503 that the gateway's own shortage caused (out_of_local_resources)
OUT_OF_LOCAL_RESOURCES = "gateway_out_of_resources"

# errno values by which the gateway's own machine says it ran out of something: descriptors
# (the process's, the system's), socket buffers, memory. An operation failing with one of
# them says nothing of the peer it was meant for.
LOCAL_SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Retry-After of such a 503: a shortage lasts about as long as the burst that caused it.
LOCAL_SHORTAGE_RETRY_AFTER_S = 1

ANTHROPIC_ROUTE_PREFIX = "/v1/messages"
# Anthropic's documented error types by HTTP status; other 4xx/5xx fall back below.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def is_anthropic_route(path: str) -> bool:
    """Whether ``path`` belongs to the Anthropic API (``/v1/messages``, ``/v1/messages/...``)."""
    return path == ANTHROPIC_ROUTE_PREFIX or path.startswith(ANTHROPIC_ROUTE_PREFIX + "/")


def anthropic_error_type(status: int) -> str:
    known = _ANTHROPIC_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


class GatewayError(Exception):
    """An error that becomes a JSON response with ``status``."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        # Sent as ``Retry-After`` (whole seconds, RFC 9110 §10.2.3) on a 429 or 503 the
        # client should simply try again later: SDKs (openai, anthropic) honour it.
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """Headers the error adds to its response."""
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(self.retry_after_s)}

    def body(self, path: str | None = None) -> dict:
        """The JSON body, in the shape of the API that ``path`` belongs to (OpenAI's when
        ``path`` is None)."""
        if path is not None and is_anthropic_route(path):
            return {"type": "error",
                    "error": {"type": anthropic_error_type(self.status), "message": self.message}}
        error: dict = {"message": self.message, "type": self.type,
                       "code": self.code if self.code is not None else self.status}
        if self.param is not None:
            error["param"] = self.param
        return {"error": error}

    def sse_event(self, path: str | None = None) -> bytes:
        """The error as the last event of a stream that broke after it started: Anthropic
        streams name their events (``event: error``); OpenAI streams carry data only."""
        data = json.dumps(self.body(path), separators=(",", ":")).encode()
        if path is not None and is_anthropic_route(path):
            return b"event: error\ndata: " + data + b"\n\n"
        return b"data: " + data + b"\n\n"

    def response(self, headers: dict[str, str] | None = None,
                 path: str | None = None) -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status,
                            headers={**self.headers(), **(headers or {})})


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict[str, str] | None = None, path: str | None = None) -> JSONResponse:
    return GatewayError(status, message, type_, param).response(headers, path)


def local_shortage(exc: BaseException) -> OSError | None:
    """The :class:`OSError` in ``exc``'s chain (itself, its causes and contexts, the members
    of exception groups) by which the gateway's own machine ran out of descriptors, buffers
    or memory (:data:`LOCAL_SHORTAGE_ERRNOS`); None when there is none. The chain is walked
    because the clients wrap the error: httpx's ``ConnectError`` has it as a cause, the
    relay client's as the context of its own ``ConnectError``."""
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in LOCAL_SHORTAGE_ERRNOS:
            return current
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        pending.extend(linked for linked in (current.__cause__, current.__context__)
                       if linked is not None)
    return None


def describe_shortage(shortage: OSError) -> str:
    """``EMFILE: Too many open files``: the errno's name, then what the system says of it."""
    name = errno.errorcode.get(shortage.errno or 0, f"errno {shortage.errno}")
    return f"{name}: {shortage.strerror or shortage}"


def out_of_local_resources(doing: str, shortage: OSError) -> GatewayError:
    """The 503 of a call that failed for want of the gateway's own resources while
    ``doing`` (``connecting to worker w0``): it says the worker is not at fault."""
    return GatewayError(
        503, f"the gateway is out of local resources ({describe_shortage(shortage)}) while "
        f"{doing}; the worker is not at fault: retry shortly", UNAVAILABLE,
        code=OUT_OF_LOCAL_RESOURCES, retry_after_s=LOCAL_SHORTAGE_RETRY_AFTER_S)
