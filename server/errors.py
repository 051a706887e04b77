"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An error the client sees with this status and body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """The first pydantic error, phrased as OpenAI phrases it."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {param}", param)
    if first["type"] == "missing":
        return OpenAIError(400, f"Missing required parameter: '{param}'", param)
    return OpenAIError(400, f"Invalid value for '{param}': {first['msg']}", param)
