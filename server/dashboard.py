"""GET /dashboard and GET /dashboard/events: a live view of the engine in the browser.

The page (static/dashboard.html) is one self-contained file: no CDN, no external fetch, and
a Content-Security-Policy that forbids both. It reads `/dashboard/events`, a server-sent
event stream of the engine's views (AsyncLLM.watch): `event: snapshot` first, then
`event: delta` (another snapshot whenever this viewer fell behind), as JSON. Only ids and
counts travel, never prompt or completion text.

Both routes sit behind the API key like every other non-probe route. A browser cannot put
a Bearer header on a page load or on an EventSource, so here the key is also accepted as
the password of HTTP Basic authentication (any user name): the browser asks for it once.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from sse_starlette.sse import EventSourceResponse

from engine import EngineSnapshot, EngineView
from server.errors import OpenAIError
from server.serving import ServingContext
from server.settings import AppState

DASHBOARD_PATHS = frozenset({"/dashboard", "/dashboard/events"})
BASIC_CHALLENGE = {"WWW-Authenticate": 'Basic realm="pagedserve", charset="UTF-8"'}
# The page may talk to its own origin only, so it cannot leak what it shows.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
    ),
    "Cache-Control": "no-store",
}


def basic_password(credentials: str) -> str:
    """The password of an HTTP Basic `Authorization` value (after "Basic "); "" if malformed."""
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return ""
    return decoded.partition(":")[2]


def add_dashboard_routes(app: FastAPI, state: AppState) -> None:
    page = (resources.files("server") / "static" / "dashboard.html").read_text("utf-8")

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers=PAGE_HEADERS)

    @app.get("/dashboard/events")
    async def dashboard_events() -> EventSourceResponse:
        ctx = state.serving
        if ctx is None or not ctx.engine.is_alive:
            raise OpenAIError(503, f"the engine is not serving ({state.phase.value})")
        return EventSourceResponse(view_events(ctx), ping=15, headers={"Cache-Control": "no-store"})


async def view_events(ctx: ServingContext) -> AsyncIterator[dict[str, str]]:
    """The engine's views as SSE events; leaving (viewer gone) stops the watch."""
    async with aclosing(ctx.engine.watch()) as views:  # type: ignore[type-var]
        async for view in views:
            yield encode_view(view, ctx.model_name)


def encode_view(view: EngineView, model_name: str) -> dict[str, str]:
    """One SSE event. The views are flat dataclasses of numbers, strings and tuples, so
    json's C encoder walks them with `vars` (ten times faster than dataclasses.asdict)."""
    data = vars(view)
    kind = "snapshot" if isinstance(view, EngineSnapshot) else "delta"
    if kind == "snapshot":
        data = {**data, "model": model_name}
    return {"event": kind, "data": json.dumps(data, default=vars, separators=(",", ":"))}
