"""Server settings (validated once at the CLI edge) and the app's mutable lifecycle state."""

from __future__ import annotations

import enum
import ipaddress
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine import cache_root
from server.chat_template import load_chat_template
from server.responses import Responses
from server.serving import ServingContext
from server.tenants import KeyRing, TenantConcurrency


class ServerSettings(BaseModel):
    """Everything about the HTTP side. Engine options travel separately as EngineArgs."""

    model_config = ConfigDict(frozen=True)

    host: str = Field(default="0.0.0.0", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    served_model_name: str | None = Field(
        default=None, description="model name clients use (default: the directory name)"
    )
    api_key: list[str] = Field(
        default=[],
        description="require one of these Bearer keys on every endpoint but probes and "
        "metrics; each key is its own tenant (env: comma-separated)",
    )
    api_keys_file: str | None = Field(
        default=None,
        description="file of `KEY TENANT` lines, keys beside --api-key; tenants never share "
        "prefix-cache blocks",
    )
    render_allow_from: list[str] = Field(
        default=[],
        description="networks (CIDR) whose calls to the render endpoints need no API key: the "
        "endpoint picker's, which sends none (llm-d's precise prefix routing); a call that "
        "carries a proxy's X-Forwarded-For or Forwarded header still needs one",
    )
    max_concurrent_requests_per_tenant: int | None = Field(
        default=None,
        gt=0,
        description="requests in flight per tenant before 429 (without keys, all clients are "
        "one tenant; default: no limit)",
    )
    tenant_metrics: bool = Field(
        default=False,
        description="also export per-tenant request and token counters (one series per tenant)",
    )
    max_num_queued_reqs: int | None = Field(
        default=None,
        gt=0,
        description="queued choices (n per prompt) before 503 (default: 8 x --max-num-seqs)",
    )
    max_num_queued_tokens: int | None = Field(
        default=None,
        gt=0,
        description="queued prompt tokens before 503 (default: the larger of "
        "64 x --max-num-batched-tokens and 8 x --max-model-len)",
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
    tool_call_parser: Literal[
        "auto",
        "granite",
        "hermes",
        "llama3_json",
        "mistral",
        "pythonic",
        "qwen3_coder",
        "llama4_json",
        "llama4_pythonic",
        "none",
    ] = Field(
        default="auto",
        description="the format tool calls are written and read in: auto picks it from the "
        "chat template (a template without tool support gets none); hermes also prompts "
        "models whose template has no tool support; none refuses requests with tools "
        "(llama4_json and llama4_pythonic, vLLM's names, are llama3_json and pythonic)",
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1", "granite"] | None = Field(
        default=None,
        description="split the model's thinking from its answer into the message's "
        "`reasoning` field; structured outputs then apply from the end of the thinking",
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        default="info", description="log level"
    )
    log_format: Literal["text", "json"] = Field(default="text", description="log line format")
    log_requests: bool = Field(default=True, description="one log line per finished request")
    disable_dashboard: bool = Field(
        default=False, description="turn off the live engine view, /dashboard and its events"
    )
    responses_store: str = Field(
        default="sqlite",
        description="where /v1/responses keeps stored responses: sqlite (responses.db in the "
        "cache directory), sqlite:PATH, or a redis:// or rediss:// URL that replicas share",
    )
    responses_ttl: float = Field(
        default=30 * 24 * 3600.0,
        gt=0,
        description="seconds a stored response is kept after it was last written (default: "
        "30 days)",
    )
    api_server_count: int = Field(
        default=1,
        ge=1,
        le=64,
        description="HTTP frontend processes sharing the port (SO_REUSEPORT) over one engine "
        "core process; /metrics sums them (needs the engine core in its own process)",
    )

    @field_validator("responses_store")
    @classmethod
    def _store_spec(cls, value: str) -> str:
        if value == "sqlite" or value.startswith(("sqlite:", "redis://", "rediss://")):
            return value
        raise ValueError("give sqlite, sqlite:PATH, or a redis:// or rediss:// URL")

    @field_validator("render_allow_from")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for network in value:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"not a network (CIDR): {network!r}") from None
        return value

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
        # Raises ValueError or OSError for a bad --api-keys-file.
        self.keys = KeyRing.load(settings.api_key, settings.api_keys_file)
        self.tenant_concurrency = TenantConcurrency(settings.max_concurrent_requests_per_tenant)
        self.render_networks = [
            ipaddress.ip_network(network, strict=False) for network in settings.render_allow_from
        ]
        self.responses = Responses(settings.responses_store, settings.responses_ttl, cache_root())
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
        if self.serving is not None and self.serving.engine.fatal_error is not None:
            return False, f"engine failed: {self.serving.engine.fatal_error}"
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
