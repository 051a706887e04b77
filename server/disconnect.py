"""Abandoned work: a request whose client has gone is cancelled, not finished for nobody.

Streamed responses stop by themselves (the SSE response watches the connection and
closes its generator). A non-streamed request only answers at the end, so while it runs
the connection is watched here: the ASGI `http.disconnect` message cancels the work, which
closes its engine streams, which aborts every choice and frees their blocks before the
engine's next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")
# nginx's status for "client closed request": it reaches no client, only logs and metrics.
CLIENT_CLOSED_REQUEST = 499


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


async def cancel_on_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Runs `work` to its result, unless the client disconnects first: then `work` is
    cancelled (and has run its cleanup) and ClientDisconnected is raised. The request
    body must have been read already."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task in done:
        return task.result()
    raise ClientDisconnected


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
