"""Pure-ASGI gateway middleware: request ids, API key, body size, drain, error counting.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched.
"""

from __future__ import annotations

import hmac
import re
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.dashboard import BASIC_CHALLENGE, DASHBOARD_PATHS, basic_password
from server.errors import OpenAIError
from server.settings import AppState, Phase

# Probes and metrics stay open without an API key, for kubelet and Prometheus.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class BodyTooLarge(Exception):
    pass


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, state: AppState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = headers.get("x-request-id", "")
        if not _REQUEST_ID.fullmatch(request_id):
            request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_wrapped(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
                if message["status"] >= 400 and self.state.serving is not None:
                    self.state.serving.metrics.count_error(message["status"])
            await send(message)

        rejection = self._reject(scope["path"], scope["method"], headers)
        if rejection is not None:
            await rejection.response()(scope, receive, send_wrapped)
            return
        tracked = scope["path"].startswith("/v1/") and scope["method"] == "POST"
        if tracked:
            self.state.in_flight += 1
        try:
            await self.app(scope, self._limited(receive), send_wrapped)
        except BodyTooLarge:
            if not started:
                await self._too_large().response()(scope, receive, send_wrapped)
        finally:
            if tracked:
                self.state.in_flight -= 1

    def _reject(self, path: str, method: str, headers: dict[str, str]) -> OpenAIError | None:
        settings = self.state.settings
        if settings.api_key and path not in OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            dashboard = path in DASHBOARD_PATHS
            if dashboard and scheme.lower() == "basic":
                scheme, token = "bearer", basic_password(token)
            valid = scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), settings.api_key.encode()
            )
            if not valid:
                challenge = BASIC_CHALLENGE if dashboard else None
                return OpenAIError(
                    401, "Incorrect or missing API key.", code="invalid_api_key", headers=challenge
                )
        if path.startswith("/v1/") and method == "POST":
            if self.state.phase is Phase.DRAINING:
                return OpenAIError(503, "the server is shutting down; retry on another replica")
            if self.state.phase is not Phase.READY:
                return OpenAIError(503, f"the server is not ready ({self.state.phase.value})")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_request_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> OpenAIError:
        limit = self.state.settings.max_request_bytes
        return OpenAIError(413, f"request body exceeds {limit} bytes")

    def _limited(self, receive: Receive) -> Receive:
        limit, received = self.state.settings.max_request_bytes, 0

        async def wrapped() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge
            return dict(message)

        return wrapped
