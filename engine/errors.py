"""The engine's error types. The server maps them to HTTP statuses without reading messages."""

from __future__ import annotations


class RequestValidationError(ValueError):
    """A request the engine cannot run as given.

    `param` names the offending field as the OpenAI API spells it (None when no single field
    is to blame), so a gateway can answer 400 with it.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[RequestValidationError], tuple[str, str | None]]:
        return type(self), (str(self), self.param)  # the engine core process sends it


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can make progress any more."""


class EngineClosedError(RuntimeError):
    """The engine was closed (the server is shutting down): its requests were cut off."""
