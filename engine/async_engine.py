"""AsyncEngine: the asyncio face of EngineCore.

One background task owns the engine. It drains an input queue of adds and aborts into
EngineCore, runs `step()` in a single worker thread so the event loop stays free, and
routes each output to its request's own queue. Engine state is only touched between
steps, by that task, so nothing needs a lock. With no work it sleeps on the queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.output import EngineCoreOutput, SchedulerStats, StepResult

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can make progress any more."""


@dataclass(frozen=True)
class _Add:
    request: Request


@dataclass(frozen=True)
class _Abort:
    request_id: str


StatsListener = Callable[[SchedulerStats], None]


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        eos_token_ids: tuple[int, ...],
        stats_listener: StatsListener | None = None,
        fail_after_steps: int | None = None,
    ) -> None:
        """`fail_after_steps` is a test-only fault injection: step N+1 raises."""
        self.core = core
        self.eos_token_ids = eos_token_ids
        self.stats_listener = stats_listener
        self._fail_after_steps = fail_after_steps
        self._inbox: asyncio.Queue[_Add | _Abort] = asyncio.Queue()
        self._streams: dict[str, asyncio.Queue[EngineCoreOutput | BaseException]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None
        self.num_steps = 0
        # Monotonic time of the last finished step, or of the moment work arrived while
        # idle: readiness compares it with now to detect a stalled loop.
        self.last_progress = time.monotonic()

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Starts the background loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                logger.debug("engine loop cancelled")
        self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done() and self.error is None

    @property
    def has_pending_work(self) -> bool:
        return bool(self._streams) or not self._inbox.empty()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[EngineCoreOutput]:
        """Yields this request's outputs until it finishes.

        Leaving the iteration early (client gone, task cancelled) aborts the request,
        which frees its blocks.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine loop has failed: {self.error!r}")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, cache_salt)
        queue: asyncio.Queue[EngineCoreOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        self._inbox.put_nowait(_Add(request))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Asks the loop to end a request; unknown or finished ids are ignored."""
        self._inbox.put_nowait(_Abort(request_id))

    # ---- the loop ------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.core.has_unfinished_requests():
                    self._apply(await self._inbox.get())
                    self.last_progress = time.monotonic()
                while not self._inbox.empty():
                    self._apply(self._inbox.get_nowait())
                if not self.core.has_unfinished_requests():
                    # Idle after aborts: publish the now-empty gauges, as no step will.
                    self._publish(self.core.scheduler.stats())
                    continue
                result = await loop.run_in_executor(self._executor, self._step)
                self.last_progress = time.monotonic()
                self._route(result)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.exception("engine loop failed")
            self.error = exc
            for queue in self._streams.values():
                queue.put_nowait(EngineDeadError(f"the engine failed: {exc!r}"))

    def _step(self) -> StepResult:
        if self._fail_after_steps is not None and self.num_steps >= self._fail_after_steps:
            raise RuntimeError("injected engine step failure (test hook)")
        result = self.core.step()
        self.num_steps += 1
        return result

    def _apply(self, message: _Add | _Abort) -> None:
        if isinstance(message, _Abort):
            self.core.abort_requests([message.request_id])
            return
        request = message.request
        if request.request_id not in self._streams:
            return  # the caller left before the loop picked the request up
        try:
            self.core.add_request(request)
        except ValueError as exc:
            self._streams[request.request_id].put_nowait(exc)

    def _route(self, result: StepResult) -> None:
        for out in result.outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        self._publish(result.stats)

    def _publish(self, stats: SchedulerStats) -> None:
        if self.stats_listener is not None:
            self.stats_listener(stats)
