"""Server settings (validated once at the CLI edge) and the app's mutable lifecycle state."""

from __future__ import annotations

import enum
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.chat_template import load_chat_template
from server.serving import ServingContext


class ServerSettings(BaseModel):
    """Everything about the HTTP side. Engine options travel separately as EngineArgs."""

    model_config = ConfigDict(frozen=True)

    host: str = Field(default="0.0.0.0", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    served_model_name: str | None = Field(
        default=None, description="model name clients use (default: the directory name)"
    )
    api_key: str | None = Field(
        default=None, description="require this Bearer key on every endpoint but probes and metrics"
    )
    shutdown_timeout: float = Field(
        default=30.0, ge=0, description="seconds in-flight requests get after SIGTERM"
    )
    stall_timeout: float = Field(
        default=60.0,
        gt=0,
        description="readiness fails when pending work has seen no finished step for this long",
    )
    max_request_bytes: int = Field(
        default=16 << 20,
        gt=0,
        description="largest accepted request body",
        json_schema_extra={"unit": "bytes"},
    )
    chat_template: str | None = Field(
        default=None,
        description="Jinja chat template, or a file holding one, used instead of the tokenizer's",
    )
    tool_call_parser: Literal["hermes", "none"] = Field(
        default="hermes",
        description="how tool calls are prompted and read back: hermes (<tool_call> JSON "
        "blocks) or none (requests with tools are refused)",
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        default="info", description="log level"
    )
    log_format: Literal["text", "json"] = Field(default="text", description="log line format")
    log_requests: bool = Field(default=True, description="one log line per finished request")

    @field_validator("chat_template")
    @classmethod
    def _load_template(cls, value: str | None) -> str | None:
        """The template's text: a file's content, or the value itself."""
        return load_chat_template(value)


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class AppState:
    """What the probes, the middleware and the routes share. Mutated on the event loop only."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.phase = Phase.LOADING
        # Set once the model is loaded: the engine and what the endpoints need beside it.
        self.serving: ServingContext | None = None
        self.load_error: BaseException | None = None
        self.in_flight = 0
        self.started = time.time()

    def liveness(self) -> tuple[bool, str]:
        """Alive while loading or serving; dead when loading failed or the engine loop died."""
        if self.load_error is not None:
            return False, f"model loading failed: {self.load_error!r}"
        if self.serving is not None and not self.serving.engine.is_alive:
            return False, f"engine loop is not running: {self.serving.engine.error!r}"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        alive, reason = self.liveness()
        if not alive:
            return False, reason
        if self.phase is not Phase.READY or self.serving is None:
            return False, self.phase.value
        engine = self.serving.engine
        stalled_for = time.monotonic() - engine.last_progress
        if engine.has_pending_work and stalled_for > self.settings.stall_timeout:
            return False, f"engine loop stalled: no step finished for {stalled_for:.0f}s"
        return True, "ok"
