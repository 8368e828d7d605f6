"""The one error shape the gateway answers with: ``{"error": {"message", "type", "code"}}``.

``code`` is the HTTP status (as vLLM's own error bodies carry it); ``param`` is added when
the error is about one header or body field (an invalid session id, say).
"""

from __future__ import annotations

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


class GatewayError(Exception):
    """An error that becomes a JSON response with ``status``."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict:
        error: dict = {"message": self.message, "type": self.type, "code": self.status}
        if self.param is not None:
            error["param"] = self.param
        return {"error": error}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return GatewayError(status, message, type_, param).response(headers)
