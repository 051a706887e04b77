"""The caller's end of one AsyncLLM request: its collector and the stream that drains it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind


class OutputCollector:
    """One request's outputs, waiting for its consumer. A consumer that falls behind gets
    the DELTA outputs merged into one; a CUMULATIVE output replaces the older one."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self._merge = kind is RequestOutputKind.DELTA
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        pending = self._item
        if self._merge and isinstance(pending, RequestOutput) and isinstance(item, RequestOutput):
            pending.merge(item)
        else:
            self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._item is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._item = self._item, None
        if isinstance(item, BaseException):
            raise item
        return item


class RequestStream:
    """A queued request's outputs, as an async iterator that ends after the final one.

    The request is queued when the stream is made, not when it is first awaited. Leaving
    early (closing the stream, or an exception, the task's cancellation included, while
    waiting for an output) aborts every choice, which frees their blocks. A stream must be
    closed (`contextlib.aclosing`) unless it was drained to the end.
    """

    def __init__(
        self, request_id: str, collector: OutputCollector, release: Callable[[bool], None]
    ) -> None:
        self.request_id = request_id
        self._collector = collector
        # Called once: release(abort) forgets the request, aborting it when True.
        self._release = release
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            output = await self._collector.get()
        except BaseException:
            self.close()
            raise
        if output.finished:
            self._closed = True
            self._release(False)
        return output

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Aborts the request unless it has finished; closing twice is harmless."""
        if not self._closed:
            self._closed = True
            self._release(True)
