"""AsyncLLM: the engine's asyncio face, and the only one the HTTP gateway sees.

One background task owns the engine. It drains an inbox of adds and aborts into the
EngineCore, runs `step()` in a single worker thread so the event loop stays free, and hands
the step's outputs to the OutputProcessor (detokenization, stop strings, the `n` fan-out).
Each caller's request then receives RequestOutputs on its own collector. Engine state is
only touched between steps, by that task, so nothing needs a lock. With no work it sleeps
on the inbox.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineArgs, EngineConfig, EngineHooks
from engine.core import EngineCore
from engine.errors import EngineDeadError, RequestValidationError
from engine.output_processor import OutputProcessor
from engine.outputs import IterationStats, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler.output import SchedulerStats, StepResult

logger = logging.getLogger(__name__)

# Called on the event loop after every step, and when the engine turns idle after aborts.
StatsListener = Callable[[SchedulerStats, IterationStats], None]


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    prompt: str | None
    labels: Mapping[str, str]
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Collector:
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


class AsyncLLM:
    def __init__(self, core: EngineCore, tokenizer: Any) -> None:
        self.core = core
        self.config: EngineConfig = core.config
        self.tokenizer = tokenizer
        self._processor = OutputProcessor(tokenizer, core.config.model.arch.eos_token_ids)
        self._inbox: asyncio.Queue[_Add | _Abort] = asyncio.Queue()
        self._collectors: dict[str, _Collector] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task: asyncio.Task[None] | None = None
        self._listener: StatsListener | None = None
        self._abort_stats = IterationStats()
        self.error: BaseException | None = None
        # Monotonic time of the last finished step, or of the moment work arrived while
        # idle: readiness compares it with now to detect a stalled loop.
        self.last_progress = time.monotonic()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, hooks: EngineHooks | None = None) -> AsyncLLM:
        """Loads the model (blocking: run it in a thread from async code)."""
        core = EngineCore.from_args(args, hooks)
        return cls(core, core.tokenizer)

    # ---- lifecycle -----------------------------------------------------------------

    def start(self, stats_listener: StatsListener | None = None) -> None:
        """Starts the background loop on the running event loop."""
        if self._task is None:
            self._listener = stats_listener
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Cancels the loop; waits for a step in flight without blocking the event loop."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                logger.debug("engine loop cancelled")
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)
        self.core.shutdown()

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done() and self.error is None

    @property
    def has_pending_work(self) -> bool:
        return bool(self._collectors) or not self._inbox.empty()

    # ---- requests ------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        prompt: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields this request's outputs (as `params.output_kind` says) until it finishes.

        Raises RequestValidationError for a prompt that can never run, EngineDeadError once
        the loop has failed. Leaving the iteration early (client gone, task cancelled)
        aborts every choice, which frees their blocks.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine loop has failed: {self.error!r}")
        self._validate(prompt_token_ids)
        await self.check_constraints(params)
        if request_id in self._collectors:
            raise ValueError(f"duplicate request id {request_id!r}")
        collector = _Collector(params.output_kind)
        self._collectors[request_id] = collector
        add = _Add(request_id, prompt_token_ids, params, cache_salt, prompt, labels or {})
        self._inbox.put_nowait(add)
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def check_constraints(self, params: SamplingParams) -> None:
        """Compiles the output constraint of `params` on the grammar threads (cached), so
        the event loop stays free; raises RequestValidationError for one that cannot
        compile. generate() calls it too: a caller calls it first only when it must know
        before the first output (to answer a stream with an HTTP 400)."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        if self.core.grammars is None:
            raise RequestValidationError("this engine has no grammar engine", "structured_outputs")
        await asyncio.wrap_future(self.core.grammars.compile(constraint))

    def abort(self, request_id: str) -> None:
        """Asks the loop to end a request; unknown or finished ids are ignored."""
        self._inbox.put_nowait(_Abort(request_id))

    def _validate(self, prompt_token_ids: list[int]) -> None:
        max_model_len = self.config.scheduler.max_model_len
        if not prompt_token_ids:
            raise RequestValidationError("the prompt is empty", "prompt")
        if len(prompt_token_ids) >= max_model_len:
            raise RequestValidationError(
                f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is "
                f"{max_model_len}, which leaves no room to generate",
                "prompt",
            )

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
                    self._publish(self.core.stats(), IterationStats())
                    continue
                result = await loop.run_in_executor(self._executor, self.core.step)
                self.last_progress = time.monotonic()
                self._handle(result)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.exception("engine loop failed")
            self.error = exc
            for collector in self._collectors.values():
                collector.put(EngineDeadError(f"the engine failed: {exc!r}"))

    def _apply(self, message: _Add | _Abort) -> None:
        if isinstance(message, _Abort):
            self._abort(message.request_id)
            return
        collector = self._collectors.get(message.request_id)
        if collector is None:
            return  # the caller left before the loop picked the request up
        requests = self._processor.add_request(
            message.request_id,
            message.prompt_token_ids,
            message.params,
            message.cache_salt,
            message.prompt,
            message.labels,
            message.arrival_time,
        )
        try:
            for request in requests:
                self.core.add_request(request)
        except ValueError as exc:
            self._abort(message.request_id)
            collector.put(exc)

    def _abort(self, request_id: str) -> None:
        engine_ids, stats = self._processor.abort_request(request_id)
        self.core.abort_requests(engine_ids)
        self._abort_stats.finished += stats.finished

    def _handle(self, result: StepResult) -> None:
        processed = self._processor.process_outputs(result.outputs)
        self.core.abort_requests(processed.aborts)
        for output in processed.outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
        self._publish(result.stats, processed.stats)

    def _publish(self, stats: SchedulerStats, iteration: IterationStats) -> None:
        iteration.finished += self._abort_stats.finished
        self._abort_stats = IterationStats()
        if self._listener is not None:
            self._listener(stats, iteration)
