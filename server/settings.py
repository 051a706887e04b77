"""Server settings (validated once at the CLI edge) and the app's mutable lifecycle state."""

from __future__ import annotations

import enum
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.factory import Engine
from server.serving import ServingContext


class ServerSettings(BaseModel):
    """Everything about the HTTP side. Engine options travel separately as EngineArgs."""

    model_config = ConfigDict(frozen=True)

    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)
    served_model_name: str | None = None
    api_key: str | None = None
    shutdown_timeout: float = Field(default=30.0, ge=0)
    # Readiness fails when pending work has seen no finished step for this long.
    stall_timeout: float = Field(default=60.0, gt=0)
    max_request_bytes: int = Field(default=16 << 20, gt=0)
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    log_format: Literal["text", "json"] = "text"
    log_requests: bool = True


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
        self.engine: Engine | None = None
        self.serving: ServingContext | None = None
        self.load_error: BaseException | None = None
        self.in_flight = 0
        self.started = time.time()

    def model_name(self) -> str:
        if self.settings.served_model_name:
            return self.settings.served_model_name
        if self.engine is not None:
            return self.engine.config.model_path.name
        return "unknown"

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
