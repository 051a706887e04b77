"""Pure-ASGI gateway middleware: request ids, API keys and tenants, per-tenant
concurrency, body size, drain, error counting.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched. Each request's scope state carries `request_id`, `tenant` and
`cleanup`, an ExitStack closed when the exchange ends however it ends (a streamed
response included), for what a route holds on the request's behalf.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.admission import RETRY_AFTER_S
from server.dashboard import BASIC_CHALLENGE, DASHBOARD_PATHS, basic_password
from server.errors import OpenAIError
from server.settings import AppState, Phase

# Probes and metrics stay open without an API key, for kubelet and Prometheus.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
# vLLM's render endpoints: open to the --render-allow-from networks.
RENDER_PATHS = frozenset({"/v1/completions/render", "/v1/chat/completions/render"})
FORWARDED = frozenset({"x-forwarded-for", "forwarded"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class BodyTooLarge(Exception):
    pass


class _Reply:
    """The ASGI `send` of one exchange: adds X-Request-Id, counts error statuses."""

    def __init__(self, send: Send, request_id: str, state: AppState, scope: Scope) -> None:
        self._send = send
        self._request_id = request_id.encode()
        self._state = state
        self._scope = scope
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            message["headers"] = [*message.get("headers", []), (b"x-request-id", self._request_id)]
            serving = self._state.serving
            if serving is not None and self._scope["path"].startswith("/v1/"):
                method, path = self._scope["method"], self._scope["path"]
                serving.metrics.count_api_request(method, path, message["status"])
            if message["status"] >= 400 and serving is not None:
                serving.metrics.count_error(message["status"])
        await self._send(message)


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
        tenant = self.state.keys.tenant(_authorization(scope["path"], headers))
        scope.setdefault("state", {}).update(request_id=request_id, tenant=tenant)
        reply = _Reply(send, request_id, self.state, scope)
        tracked = scope["path"].startswith("/v1/") and scope["method"] == "POST"
        # The endpoint picker's render calls: no key, and no tenant's limit to count against.
        picker = tenant is None and self._from_picker(scope, headers)
        limited = tracked and not picker
        rejection = self._reject(scope["path"], scope["method"], headers, tenant, picker)
        if rejection is None and limited and not self.state.tenant_concurrency.try_acquire(tenant):
            rejection = self._tenant_limited()
        if rejection is not None:
            await rejection.response()(scope, receive, reply)
            return
        if not tracked:
            await self._run(scope, receive, reply)
            return
        self.state.in_flight += 1
        try:
            await self._run(scope, receive, reply)
        finally:
            self.state.in_flight -= 1
            if limited:
                self.state.tenant_concurrency.release(tenant)

    async def _run(self, scope: Scope, receive: Receive, reply: _Reply) -> None:
        try:
            with contextlib.ExitStack() as scope["state"]["cleanup"]:
                await self.app(scope, self._limited(receive), reply)
        except BodyTooLarge:
            if not reply.started:
                await self._too_large().response()(scope, receive, reply)

    def _from_picker(self, scope: Scope, headers: dict[str, str]) -> bool:
        """A render call straight from a --render-allow-from network: llm-d's endpoint
        picker tokenizes each request here and sends no key. One a proxy forwarded (a
        Gateway adds X-Forwarded-For) is a client's, whatever the proxy's address."""
        networks = self.state.render_networks
        if not networks or scope["path"] not in RENDER_PATHS or FORWARDED & headers.keys():
            return False
        client = scope.get("client")
        try:
            address = ipaddress.ip_address(client[0]) if client else None
        except ValueError:  # a Unix socket's peer, or a test client's name
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # an IPv4 peer on a dual-stack socket
        return address is not None and any(address in network for network in networks)

    def _reject(
        self, path: str, method: str, headers: dict[str, str], tenant: str | None, picker: bool
    ) -> OpenAIError | None:
        keyless = path in OPEN_PATHS or picker
        if not self.state.keys.open and tenant is None and not keyless:
            # A browser asks for the dashboard's key once it is challenged for Basic auth.
            challenge = BASIC_CHALLENGE if path in DASHBOARD_PATHS else None
            return OpenAIError(
                401, "Incorrect or missing API key.", code="invalid_api_key", headers=challenge
            )
        if path.startswith("/v1/") and method == "POST":
            if self.state.phase is Phase.DRAINING:
                return OpenAIError(503, "the server is shutting down; retry on another replica")
            if self.state.phase is not Phase.READY:
                return OpenAIError(503, f"the server is not ready ({self.state.phase.value})")
        length = headers.get("content-length")
        limit = self.state.settings.max_request_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return self._too_large()
        return None

    def _tenant_limited(self) -> OpenAIError:
        if self.state.serving is not None:
            self.state.serving.metrics.count_rejection("tenant_concurrency")
        limit = self.state.tenant_concurrency.limit
        return OpenAIError(
            429,
            f"too many concurrent requests for this API key's tenant (limit {limit})",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

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


def _authorization(path: str, headers: dict[str, str]) -> str:
    """The request's Authorization header, with the dashboard's HTTP Basic credentials (a
    browser cannot send a Bearer header on a page load or an EventSource) read as a Bearer
    key whose value is the Basic password."""
    authorization = headers.get("authorization", "")
    scheme, _, credentials = authorization.partition(" ")
    if path in DASHBOARD_PATHS and scheme.lower() == "basic":
        return f"Bearer {basic_password(credentials)}"
    return authorization
