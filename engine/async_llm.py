"""AsyncLLM: the engine's asyncio face, and the only one the HTTP gateway sees.

It is the frontend: tokenizer, detokenization, stop strings, the `n` fan-out and the
callers' streams live here, whichever way the engine core runs.

By default the core runs in a process of its own (engine.core_proc): the inbox's adds and
aborts go there in batches over ZMQ, each step's outputs come back, and the frontend's host
work runs beside the model rather than between its steps, on a GIL of its own.

In-process (EngineArgs.engine_in_process, and always for LLM), one background task owns the
engine. It drains an inbox of adds and aborts into the
EngineCore, starts a run of steps in a single worker thread so the event loop stays free, and
hands each step's outputs to the OutputProcessor (detokenization, stop strings, the `n`
fan-out). Each caller's request then receives RequestOutputs on its own collector. A run
steps back to back for as long as the loop has nothing to apply between steps; the loop
touches engine state only between runs, so nothing needs a lock. With no work it sleeps on
the inbox.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import msgspec

from engine.config import EngineArgs, EngineConfig, EngineHooks, load_tokenizer
from engine.core_client import CoreProcess
from engine.core_proc import (
    ABORT,
    ADD,
    ADDS_SEEN,
    ENCODER,
    FAILED,
    FATAL,
    REJECT,
    REPLY,
    STEP,
    STEP_DECODER,
    VIEW,
    CoreChannel,
    CoreRequest,
)
from engine.errors import EngineClosedError, EngineDeadError, RequestValidationError
from engine.introspection import EngineMonitor, EngineView
from engine.lora.request import LoRARequest
from engine.output_processor import EMBEDDING_PARAMS, OutputProcessor
from engine.outputs import IterationStats
from engine.pooling import PoolingParams, check_task
from engine.request import Request, check_prompt_length
from engine.sampling_params import SamplingParams
from engine.scheduler.output import SchedulerStats, StepResult
from engine.streams import OutputCollector, RequestStream

if TYPE_CHECKING:
    from engine.core import EngineCore

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
    labels: Mapping[str, str] | None
    arrival_time: float = field(default_factory=time.monotonic)
    pooling_params: PoolingParams | None = None
    lora: LoRARequest | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _CoreCall:
    """EngineCore.<method>(*args) between two steps, in order with the requests around it."""

    method: str
    args: tuple[Any, ...]
    done: asyncio.Future[Any]


def _log_call_failure(call: asyncio.Future[Any]) -> None:
    if not call.cancelled() and call.exception() is not None:
        logger.debug("engine core call failed: %r", call.exception())


def tokenizer_imports_beside_core() -> None:
    """Imports transformers' tokenizer classes on a thread of their own while the core
    process loads the model (about 1 s on a 2-core VM), so the tokenizer in the core's
    report unpickles at once. The frontend reads no tokenizer itself (core_proc.CoreReady):
    that would import torch."""

    def run() -> None:
        importlib.import_module("transformers.tokenization_utils_tokenizers")

    threading.Thread(target=run, name="pagedserve-tokenizer-imports", daemon=True).start()


def engine_thread() -> ThreadPoolExecutor:
    """The one thread that runs the engine's torch work: loading, warm-up and steps.

    With torch's OpenMP backend every thread that starts a parallel region gets a thread
    pool of its own. Once a process holds more pool threads than it has CPUs, libgomp
    stops spinning at barriers and parks its threads after each region, so every op pays
    a wake-up: on 2 cores a decode step on 2 threads took twice as long when the model
    had been loaded on another thread than the one stepping it. So loading and stepping
    share this thread, and the process keeps a single pool.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")


class AsyncLLM:
    def __init__(
        self,
        core: EngineCore | CoreProcess,
        tokenizer: Any,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        """`core`: an EngineCore to step on this process's engine thread, or a loaded
        CoreProcess to drive over its sockets."""
        self._remote = core if isinstance(core, CoreProcess) else None
        # The in-process core; None when it runs in a process of its own.
        self.core = None if isinstance(core, CoreProcess) else core
        self.config: EngineConfig = core.config
        self.tokenizer = tokenizer
        self._processor = OutputProcessor(tokenizer, core.config.model.arch.eos_token_ids)
        self._inbox: asyncio.Queue[_Add | _Abort | _CoreCall] = asyncio.Queue()
        self._collectors: dict[str, OutputCollector] = {}
        self._executor = None if self._remote is not None else executor or engine_thread()
        self._task: asyncio.Task[None] | None = None
        self._step: Future[None] | None = None  # the run of steps in the worker thread
        # Each step's result, and whether its run ended with it (or the exception a step
        # raised), from the worker thread, in order.
        self._results: asyncio.Queue[tuple[StepResult | BaseException, bool]] = asyncio.Queue()
        # Set on the loop when it has something to apply between steps: the run in flight
        # ends after its current step. Cleared only between runs.
        self._handover = False
        # Steps the worker has posted, and the loop has handled: the worker writes one, the
        # loop the other, so neither needs a lock.
        self._posted = 0
        self._handled = 0
        self._listener: StatsListener | None = None
        self._abort_stats = IterationStats()
        # Engine requests that ended on a stop string, to abort before the next step.
        self._stop_aborts: list[str] = []
        self._monitor = EngineMonitor(
            None if self.core is None else self.core.state,
            core.config.cache.enable_prefix_caching,
        )
        # True while a step runs in the worker thread: engine state is off limits then.
        self._stepping = False
        self.error: BaseException | None = None
        self._closed_reason: str | None = None
        # Choices (and their prompt tokens) not running yet: in the inbox, and in the
        # scheduler's waiting queue as of the last step. Read by admission control.
        self._inbox_load = [0, 0]
        self._waiting_load = [0, 0]
        # With the core in a process of its own: ADD frames sent so far, and those a step has
        # not shown the core to have applied yet, as (frame number, choices, tokens): a step
        # computed before an add reached the core does not count it as waiting, so they are
        # counted on top of its figures.
        self._adds_sent = 0
        self._unseen_adds: deque[tuple[int, int, int]] = deque()
        # Monotonic time of the last finished step, or of the moment work arrived while
        # idle: readiness compares it with now to detect a stalled loop.
        self.last_progress = time.monotonic()

    def _core(self) -> EngineCore:
        assert self.core is not None, "the engine core runs in a process of its own"
        return self.core

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        hooks: EngineHooks | None = None,
        logging_config: dict[str, Any] | None = None,
    ) -> AsyncLLM:
        """Loads the model (blocking: run it in a thread from async code): in an engine core
        process (configured with `logging_config`, a logging.config.dictConfig, if given),
        or with `args.engine_in_process` on the thread that will run the steps
        (engine_thread)."""
        if not args.engine_in_process:
            tokenizer_imports_beside_core()
            return cls._over(CoreProcess.launch(args, hooks, logging_config))
        from engine.core import EngineCore  # torch: a frontend of a core process needs none

        executor = engine_thread()
        try:
            core = executor.submit(EngineCore.from_args, args, hooks).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(core, core.tokenizer, executor)

    @classmethod
    def attach(cls, channel: CoreChannel, pid: int) -> AsyncLLM:
        """A frontend of the engine core process `pid` that a supervisor started for
        several frontends (start_core); blocks until the core has loaded."""
        tokenizer_imports_beside_core()
        return cls._over(CoreProcess.attach(channel, pid))

    @classmethod
    def _over(cls, process: CoreProcess) -> AsyncLLM:
        """The frontend of a loaded core process, with the tokenizer from the core's
        report; read here only where the core's did not pickle."""
        tokenizer = process.tokenizer
        if tokenizer is None:
            try:
                tokenizer = load_tokenizer(process.config.model)
            except BaseException:
                process.close()
                raise
        return cls(process, tokenizer)

    # ---- lifecycle -----------------------------------------------------------------

    def start(self, stats_listener: StatsListener | None = None) -> None:
        """Starts the background loop on the running event loop."""
        if self._task is None:
            self._listener = stats_listener
            loop = asyncio.get_running_loop()
            if self._remote is not None:
                self._remote.connect()
                self._task = loop.create_task(self._run_remote(), name="engine-frontend")
            else:
                self._task = loop.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Cancels the loop; waits for a step in flight without blocking the event loop
        (and without a thread of its own, so a caller may time out on a hung step)."""
        self._handover = True  # a run in flight ends after its current step
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                logger.debug("engine loop cancelled")
        if self._remote is not None:
            await self._remote.shutdown()
            return
        assert self._executor is not None
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._step is not None:
            await asyncio.gather(asyncio.wrap_future(self._step), return_exceptions=True)
        self._core().close()

    def close(self, reason: str) -> None:
        """Cuts off every open request and refuses new ones: their streams, and later
        generate() calls, raise EngineClosedError(reason). The streams then abort their
        choices; the loop runs on (to free their blocks) until stop()."""
        self._closed_reason = reason
        for collector in self._collectors.values():
            collector.put(EngineClosedError(reason))

    @property
    def is_alive(self) -> bool:
        running = self._task is not None and not self._task.done() and self.error is None
        return running and self.fatal_error is None

    @property
    def fatal_error(self) -> str | None:
        """Why the engine can never run a step again though its loop lives (a
        tensor-parallel worker died, the core process exited), or None; a server should exit
        on it."""
        if self._remote is not None:
            return self._remote.failure
        return self._core().failure()

    @property
    def engine_pid(self) -> int:
        """The process whose threads run the steps: the core's, or this one."""
        return self._remote.pid if self._remote is not None else os.getpid()

    @property
    def has_pending_work(self) -> bool:
        return bool(self._collectors) or not self._inbox.empty()

    @property
    def num_queued_requests(self) -> int:
        """Choices queued and not yet running (each of a request's n counts). A counter kept
        on the event loop: no scan, no lock; exact again after every step."""
        return self._inbox_load[0] + self._waiting_load[0]

    @property
    def num_queued_tokens(self) -> int:
        """Tokens the queued choices still have to prefill, counted like num_queued_requests."""
        return self._inbox_load[1] + self._waiting_load[1]

    # ---- requests ------------------------------------------------------------------

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        prompt: str | None = None,
        labels: Mapping[str, str] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queues the request now; its stream yields the outputs (as `params.output_kind`
        says) until it finishes. Closing the stream early aborts every choice. With
        `lora_request`, it runs with that adapter (added with add_lora first).

        Raises RequestValidationError for a prompt that can never run or on an embedding
        engine (see encode), EngineDeadError once the loop has failed. An output constraint
        compiles on the grammar threads while the request waits; one that cannot compile ends
        its choices with "abort", so a caller that must know first (to answer with a 400)
        awaits check_constraints() before this.
        """
        check_task(self.config.model.pooler, None)
        add = _Add(request_id, prompt_token_ids, params, cache_salt, prompt, labels)
        return self._submit(add if lora_request is None else replace(add, lora=lora_request))

    def encode(
        self,
        prompt_token_ids: list[int],
        params: PoolingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> RequestStream:
        """An embedding engine's generate(): queues a prefill-only request now; its stream
        yields one RequestOutput, whose `embedding` is the prompt's. Raises as generate()
        does, and RequestValidationError on an engine that does not embed, or for
        `dimensions` the model cannot give."""
        check_task(self.config.model.pooler, params)
        return self._submit(
            _Add(
                request_id,
                prompt_token_ids,
                EMBEDDING_PARAMS,
                cache_salt,
                None,
                labels,
                pooling_params=params,
            )
        )

    def _submit(self, add: _Add) -> RequestStream:
        if self.error is not None:
            raise EngineDeadError(f"the engine loop has failed: {self.error!r}")
        if self._closed_reason is not None:
            raise EngineClosedError(self._closed_reason)
        self._validate(add.prompt_token_ids, add.pooling_params is not None)
        request_id = add.request_id
        if request_id in self._collectors:
            raise ValueError(f"duplicate request id {request_id!r}")
        collector = OutputCollector(add.params.output_kind)
        self._collectors[request_id] = collector
        self._post(add)
        self._count(self._inbox_load, add, +1)

        def release(abort: bool) -> None:
            self._collectors.pop(request_id, None)
            if abort:
                self.abort(request_id)

        return RequestStream(request_id, collector, release)

    async def check_constraints(self, params: SamplingParams) -> None:
        """Compiles the output constraint of `params` on the grammar threads (cached), so
        the event loop stays free; raises RequestValidationError for one that cannot
        compile. The gateway awaits it before generate(), to answer a bad constraint with
        a 400 rather than an aborted stream."""
        constraint = params.structured_outputs
        if constraint is None:
            return
        if self._remote is not None:
            await self._remote.call("check_constraint", constraint)
            return
        grammars = self._core().grammars
        if grammars is None:
            raise RequestValidationError("this engine has no grammar engine", "structured_outputs")
        await asyncio.wrap_future(grammars.compile(constraint))

    def abort(self, request_id: str) -> None:
        """Asks the loop to end a request; unknown or finished ids are ignored."""
        self._post(_Abort(request_id))

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix between two steps, if no request holds KV blocks
        then; returns whether it did (KV event subscribers get AllBlocksCleared)."""
        return bool(await self._core_call("reset_prefix_cache"))

    async def add_lora(self, lora: LoRARequest) -> None:
        """Reads and checks a LoRA adapter in the engine core, so that requests naming it
        run; raises LoRAError for one that cannot serve (or without --enable-lora)."""
        await self._core_call("add_lora", lora)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drops a LoRA adapter's weights in the engine core; whether they were loaded."""
        return bool(await self._core_call("remove_lora", lora_int_id))

    async def _core_call(self, method: str, *args: Any) -> Any:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._post(_CoreCall(method, args, done))
        return await done

    async def watch(self) -> AsyncIterator[EngineView]:
        """Yields views of the engine's state (ids and counts, never text): an EngineSnapshot
        first, then EngineDeltas, each against the view before it, and a fresh snapshot
        whenever this watcher fell behind. A few views a second at most; ends when the
        engine loop stops. Views are taken only while someone watches."""
        watcher = self._monitor.subscribe()
        try:
            if self._remote is not None and self._monitor.num_watchers == 1:
                # The core process sends its state as views come due (see core_proc).
                monitor = self._monitor
                try:
                    await self._remote.call("watch", (monitor.min_interval, monitor.max_share))
                except RuntimeError:  # the core has exited: nothing to watch
                    return
            while self.is_alive:
                view = await watcher.get(timeout=self._monitor.min_interval)
                if view is not None:
                    yield view
                elif self._remote is None and not self._stepping:
                    # Idle: no step will come to take the view, and none is in flight.
                    self._monitor.capture_if_due()
        finally:
            self._monitor.unsubscribe(watcher)
            if self._remote is not None and self._remote.alive and not self._monitor.num_watchers:
                # Not awaited: this generator may be closing. Only an exited core fails it.
                self._remote.call("watch", None).add_done_callback(_log_call_failure)

    def _post(self, message: _Add | _Abort | _CoreCall) -> None:
        self._inbox.put_nowait(message)
        self._handover = True

    def _validate(self, prompt_token_ids: list[int], pooling: bool) -> None:
        if not prompt_token_ids:
            raise RequestValidationError("the prompt is empty", "input" if pooling else "prompt")
        max_model_len = self.config.scheduler.max_model_len
        check_prompt_length(len(prompt_token_ids), max_model_len, pooling)

    # ---- the loop ------------------------------------------------------------------

    async def _run(self) -> None:
        """Between runs, applies the inbox and the stop aborts and starts the next run of
        steps in the worker thread; while it runs, hands out each step's outputs
        (detokenization, stop strings, streams, metrics), so that host work hides behind
        the model. A run ends at the first step after which the loop has something to apply
        (see _steps); the loop hands out its last step's outputs after it has started the
        next run. A stop string found in step N's outputs ends its choice at once for the
        caller; its engine request is aborted before step N + 2, one wasted token later."""
        loop = asyncio.get_running_loop()
        executor = self._executor
        assert executor is not None
        last: StepResult | None = None  # a run's last step, handled once the next one starts
        try:
            while True:
                self._apply_stop_aborts()
                if last is None and not self._core().has_unfinished_requests():
                    self._apply(await self._inbox.get())
                    self.last_progress = time.monotonic()
                while not self._inbox.empty():
                    self._apply(self._inbox.get_nowait())
                running = self._core().has_unfinished_requests()
                if running:
                    self._handover = False
                    self._stepping = True
                    self._step = executor.submit(self._steps, loop)
                if last is not None:
                    self._handle(last)
                    last = None
                if not running:
                    # Idle (all done, or aborted): publish the gauges as they are now, as
                    # no step will.
                    stats = self._core().stats()
                    self._waiting_load = [stats.num_waiting, stats.num_waiting_tokens]
                    self._publish(stats, IterationStats())
                    continue
                while last is None:
                    result, final = await self._results.get()
                    if isinstance(result, BaseException):
                        raise result
                    self.last_progress = time.monotonic()
                    # Exact as of this step; adds from the inbox count on top of it.
                    self._waiting_load = [result.stats.num_waiting, result.stats.num_waiting_tokens]
                    if not final:
                        self._handle(result)
                        continue
                    self._stepping = False
                    self._monitor.capture_if_due()  # the engine as this run left it
                    last = result
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            logger.exception("engine loop failed")
            self.error = exc
            for collector in self._collectors.values():
                collector.put(EngineDeadError(f"the engine failed: {exc!r}"))

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """A run of steps, on the worker thread: steps back to back, without waking the
        event loop to start each one, for as long as the loop has nothing to apply between
        them (no inbox message or stop abort: _handover), has handed out every step but the
        one just taken, and no view is due. Each result goes to the loop in order."""
        while True:
            final = True
            try:
                result: StepResult | BaseException = self._core().step()
                self._posted += 1
                # _handled before _handover: the loop sets _handover before it counts the
                # step whose stop strings asked for it, so a counted step's ask is seen.
                final = (
                    self._handled < self._posted - 1
                    or self._handover
                    or self._monitor.due()
                    or not self._core().has_unfinished_requests()
                )
            except BaseException as exc:
                result = exc
            try:
                loop.call_soon_threadsafe(self._results.put_nowait, (result, final))
            except RuntimeError:
                return  # the event loop has closed: no one is left to take the result
            if final:
                return

    # ---- the loop, with the core in a process of its own ----------------------------

    async def _run_remote(self) -> None:
        """Reads the core's frames: each step's outputs go through _handle, as in-process;
        stop strings' aborts go back at once. The inbox drains in a task of its own."""
        assert self._remote is not None
        sender = asyncio.get_running_loop().create_task(self._send_inbox(), name="engine-inbox")
        try:
            while True:
                frames = await self._remote.recv()
                kind = frames[0]
                if kind == STEP:
                    result = STEP_DECODER.decode(frames[1])
                    self.last_progress = time.monotonic()
                    self._count_waiting(result.stats, ADDS_SEEN.unpack(frames[2])[0])
                    self._handle(result)
                    if self._stop_aborts:
                        self._remote.send(ABORT, ENCODER.encode(self._stop_aborts))
                        self._stop_aborts = []
                elif kind == REPLY:
                    self._remote.reply(frames[1], frames[2])
                elif kind == VIEW:
                    self._monitor.capture(*pickle.loads(frames[1]))
                elif kind == REJECT:
                    self._reject(msgspec.msgpack.decode(frames[1]), pickle.loads(frames[2]))
                elif kind == FATAL:
                    self._remote.failure = msgspec.msgpack.decode(frames[1])
                elif kind == FAILED:
                    raise RuntimeError(msgspec.msgpack.decode(frames[1]))
                else:
                    raise ValueError(f"unknown frame kind {kind!r} from the engine core")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)
        finally:
            sender.cancel()

    def _fail(self, exc: BaseException) -> None:
        logger.error("engine frontend failed", exc_info=exc)
        self.error = exc
        for collector in self._collectors.values():
            collector.put(EngineDeadError(f"the engine failed: {exc!r}"))

    async def _send_inbox(self) -> None:
        """Sends what the inbox holds, in one batch of adds and one of aborts per wake-up:
        callers that arrive together reach the core in one message."""
        try:
            await self._send_batches()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the engine is unusable without its sender
            self._fail(exc)

    async def _send_batches(self) -> None:
        assert self._remote is not None
        while True:
            messages = [await self._inbox.get()]
            while not self._inbox.empty():
                messages.append(self._inbox.get_nowait())
            if not self._processor:
                # Work arrives at an idle core: a stall counts from now, not from the last
                # step, which may be long ago.
                self.last_progress = time.monotonic()
            adds: list[CoreRequest] = []
            aborts: list[str] = []
            for message in messages:
                if isinstance(message, _Add):
                    adds += self._admit(message)
                    continue
                if adds:  # in order: what came before this message reaches the core first
                    self._send_adds(adds)
                    adds = []
                if isinstance(message, _Abort):
                    aborts += self._abort_choices(message.request_id)
                    continue
                if aborts:
                    self._remote.send(ABORT, ENCODER.encode(aborts))
                    aborts = []
                self._call_core(message)
            if adds:
                self._send_adds(adds)
            if aborts:
                self._remote.send(ABORT, ENCODER.encode(aborts))

    def _send_adds(self, adds: list[CoreRequest]) -> None:
        assert self._remote is not None
        self._remote.send(ADD, ENCODER.encode(adds))
        self._adds_sent += 1
        tokens = sum(len(add.prompt_token_ids) for add in adds)
        self._unseen_adds.append((self._adds_sent, len(adds), tokens))

    def _count_waiting(self, stats: SchedulerStats, adds_seen: int) -> None:
        """The waiting load as of a step of the core in its own process: its waiting queue,
        and the adds sent after the last one it had applied."""
        unseen = self._unseen_adds
        while unseen and unseen[0][0] <= adds_seen:
            unseen.popleft()
        self._waiting_load = [
            stats.num_waiting + sum(choices for _, choices, _ in unseen),
            stats.num_waiting_tokens + sum(tokens for _, _, tokens in unseen),
        ]

    def _admit(self, message: _Add) -> list[CoreRequest]:
        """The engine requests of a caller's request that is still there, tracked by the
        output processor from now on."""
        requests = self._track(message)
        if requests:
            self._count(self._waiting_load, message, +1)
        return [CoreRequest.of(request) for request in requests]

    def _track(self, message: _Add) -> list[Request]:
        """Takes an add out of the inbox's count; returns its engine requests (one per
        choice), now tracked by the output processor, or none if the caller has left."""
        self._count(self._inbox_load, message, -1)
        if message.request_id not in self._collectors:
            return []  # the caller left before the add was applied
        return self._processor.add_request(
            message.request_id,
            message.prompt_token_ids,
            message.params,
            message.cache_salt,
            message.prompt,
            message.labels,
            message.arrival_time,
            message.pooling_params,
            message.lora,
        )

    def _abort_choices(self, request_id: str) -> list[str]:
        engine_ids, stats = self._processor.abort_request(request_id)
        self._abort_stats.finished += stats.finished
        return engine_ids

    def _call_core(self, message: _CoreCall) -> None:
        assert self._remote is not None
        reply = self._remote.call(message.method, *message.args)

        def done(reply: asyncio.Future[Any]) -> None:
            if message.done.done():
                return
            if reply.exception() is not None:
                message.done.set_exception(reply.exception())  # type: ignore[arg-type]
            else:
                message.done.set_result(reply.result())

        reply.add_done_callback(done)

    def _reject(self, engine_id: str, error: BaseException) -> None:
        """The core refused one of a request's choices: the whole request ends with it."""
        request_id = engine_id.rsplit("-", 1)[0]
        collector = self._collectors.get(request_id)
        others = [i for i in self._abort_choices(request_id) if i != engine_id]
        if others:
            assert self._remote is not None
            self._remote.send(ABORT, ENCODER.encode(others))
        if collector is not None:
            collector.put(error)

    # ---- the loop's parts --------------------------------------------------------------

    def _apply(self, message: _Add | _Abort | _CoreCall) -> None:
        if isinstance(message, _Abort):
            self._abort(message.request_id)
            return
        if isinstance(message, _CoreCall):
            if not message.done.done():
                try:
                    message.done.set_result(getattr(self._core(), message.method)(*message.args))
                except Exception as exc:  # the caller's to handle: it awaits `done`
                    message.done.set_exception(exc)
            return
        requests = self._track(message)
        if not requests:
            return
        try:
            for request in requests:
                self._core().add_request(request)
        except ValueError as exc:
            self._abort(message.request_id)
            self._collectors[message.request_id].put(exc)
            return
        self._count(self._waiting_load, message, +1)

    @staticmethod
    def _count(load: list[int], add: _Add, sign: int) -> None:
        """Mutates `load`: adds (or removes) the request's choices and their tokens."""
        load[0] += sign * add.params.n
        load[1] += sign * add.params.n * len(add.prompt_token_ids)

    def _abort(self, request_id: str) -> None:
        self._core().abort_requests(self._abort_choices(request_id))

    def _apply_stop_aborts(self) -> None:
        if self._stop_aborts:
            self._core().abort_requests(self._stop_aborts)
            self._stop_aborts = []

    def _handle(self, result: StepResult) -> None:
        """Runs while the next step may be in flight: touches no engine state (the aborts
        wait for _apply_stop_aborts, between steps)."""
        processed = self._processor.process_outputs(result.outputs)
        if processed.aborts:
            self._stop_aborts += processed.aborts
            self._handover = True
        self._handled += 1
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
        self._monitor.observe(stats, iteration)
