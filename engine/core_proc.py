"""EngineCoreProc: the engine core in a process of its own, as vLLM V1 runs it.

The scheduler, the KV cache, the model runner and the grammar compiler live here; the
frontend (AsyncLLM) keeps tokenization, detokenization, stop strings and the `n` fan-out.
The process steps back to back while it has work and sleeps on its input socket while it
has none, so the frontend's host work runs beside the model instead of between its steps.

Wire (ZMQ, two ipc sockets, the frontend binds both):

    frontend PUSH -> core PULL   [ADD, msgpack list[CoreRequest]]  [ABORT, msgpack list[str]]
                                 [CALL, msgpack (call id, method), pickled args]  [QUIT]
    core PUSH -> frontend PULL   [STEP, msgpack StepResult]  [REJECT, msgpack id, pickled error]
                                 [REPLY, msgpack (call id, ok), pickled result or message]
                                 [VIEW, pickled (CoreState, seconds it took)]
                                 [FATAL, msgpack message]  [FAILED, msgpack message]

The hot messages (adds, aborts, step results) are msgspec-encoded typed batches. Calls
(prefix-cache reset, constraint checks, watching) are rare and carry pickles. While the
frontend has watchers, the core sends its state for the live view between steps, as often
as the frontend's EngineMonitor would take one in-process: after a step once one is due,
and after min_interval of idleness.
Before the sockets, the process reports its load on a pipe: the EngineConfig, or the
exception that stopped it, as a pickle.

The process outlives no one: it exits when its parent does (it polls getppid, which is
exact for a reparented child), ignores the terminal's SIGINT and SIGTERM (the frontend
drains first, then sends QUIT), and exits 1 after reporting a step that raised.
"""

from __future__ import annotations

import logging
import logging.config
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from engine.config import EngineArgs, EngineConfig, EngineHooks
from engine.errors import RequestValidationError
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.output import StepResult

logger = logging.getLogger(__name__)

# Frame kinds.
ADD, ABORT, CALL, QUIT = b"A", b"X", b"C", b"Q"
STEP, REJECT, REPLY, VIEW, FATAL, FAILED = b"S", b"J", b"R", b"V", b"T", b"F"
# How long an idle core sleeps on its input before it looks at its parent again; with
# a call in flight (a grammar compiling) it looks back sooner.
IDLE_POLL_MS = 500
# Not `-m engine.core_proc`: this module's classes must pickle under their own name.
ENTRY_POINT = "import sys; from engine.core_proc import main; sys.exit(main())"
PENDING_POLL_MS = 5
# With tensor-parallel workers, an idle core looks this often for one that died (the
# group's watchdog thread notices it), so the frontend fails its probes at once.
WORKERS_POLL_MS = 20


class CoreRequest(msgspec.Struct, array_like=True, frozen=True):
    """One engine request (one choice) as it crosses to the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    cache_salt: str | None
    arrival_time: float  # time.monotonic(): one clock for every process on the host

    @classmethod
    def of(cls, request: Request) -> CoreRequest:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_ids,
            request.cache_salt,
            request.arrival_time,
        )

    def to_request(self) -> Request:
        return Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            self.eos_token_ids,
            self.cache_salt,
            arrival_time=self.arrival_time,
        )


ENCODER = msgspec.msgpack.Encoder()
ADD_DECODER = msgspec.msgpack.Decoder(list[CoreRequest])
ABORT_DECODER = msgspec.msgpack.Decoder(list[str])
STEP_DECODER = msgspec.msgpack.Decoder(StepResult)


@dataclass(frozen=True)
class CoreLaunch:
    """Everything the process needs, pickled onto its stdin."""

    args: EngineArgs
    hooks: EngineHooks
    input_address: str
    output_address: str
    ready_fd: int  # the pipe the load result goes to
    logging_config: dict[str, Any] | None


@dataclass(frozen=True)
class CoreReady:
    config: EngineConfig


class EngineCoreProc:
    """The loop of the core process. Not thread-safe: everything runs on its main thread,
    which is also the one that loaded the model (one OpenMP pool; see engine_thread)."""

    def __init__(self, core: Any, input_socket: Any, output_socket: Any, parent: int) -> None:
        self.core = core
        self.input = input_socket
        self.output = output_socket
        self.parent = parent
        self._poller = zmq.Poller()
        self._poller.register(input_socket, zmq.POLLIN)
        self._calls: list[tuple[int, Future[Any]]] = []  # calls that finish on other threads
        self._idle_stats_due = False  # an abort may have left the core idle: say so once
        self._fatal_sent = False
        self._quit = False
        # The live view: (min_interval, max_share) while the frontend has watchers.
        self._watch: tuple[float, float] | None = None
        self._view_due = 0.0  # monotonic time the next view is due
        self._idle_since = time.monotonic()

    def run(self) -> None:
        while not self._quit:
            if os.getppid() != self.parent:
                logger.warning("engine core: the frontend has gone; exiting")
                return
            busy = self.core.has_unfinished_requests()
            if self._poller.poll(0 if busy else self._idle_timeout_ms()):
                self._drain()
            if self._calls:
                self._finish_calls()
            if self.core.has_unfinished_requests():
                self._send(STEP, ENCODER.encode(self.core.step()))
                self._idle_stats_due = True
                if self._watch is not None and time.monotonic() >= self._view_due:
                    self._send_view()
                self._idle_since = time.monotonic()
            else:
                if self._idle_stats_due:
                    self._send(STEP, ENCODER.encode(StepResult([], self.core.stats())))
                    self._idle_stats_due = False
                if self._watch is not None and time.monotonic() >= self._idle_view_due():
                    self._send_view()
            failure = self.core.failure()
            if failure is not None and not self._fatal_sent:
                self._send(FATAL, ENCODER.encode(failure))
                self._fatal_sent = True

    def _idle_timeout_ms(self) -> int:
        if self._calls:
            return PENDING_POLL_MS
        idle = IDLE_POLL_MS if self.core.tp_group is None else WORKERS_POLL_MS
        if self._watch is None:
            return idle
        wait = self._idle_view_due() - time.monotonic()
        return max(0, min(idle, int(wait * 1000) + 1))

    def _idle_view_due(self) -> float:
        assert self._watch is not None
        return max(self._view_due, self._idle_since + self._watch[0])

    def _send_view(self) -> None:
        assert self._watch is not None
        min_interval, max_share = self._watch
        start = time.perf_counter()
        state = self.core.state()
        cost = time.perf_counter() - start
        self.output.send_multipart([VIEW, pickle.dumps((state, cost))])
        self._view_due = time.monotonic() + max(min_interval, cost / max_share)
        self._idle_since = time.monotonic()

    def _drain(self) -> None:
        while not self._quit:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._apply(frames[0].bytes, [frame.buffer for frame in frames[1:]])

    def _apply(self, kind: bytes, body: list[Any]) -> None:
        if kind == ADD:
            for wire in ADD_DECODER.decode(body[0]):
                try:
                    self.core.add_request(wire.to_request())
                except ValueError as exc:  # RequestValidationError among them
                    self.output.send_multipart(
                        [REJECT, ENCODER.encode(wire.request_id), pickle.dumps(_picklable(exc))]
                    )
        elif kind == ABORT:
            self.core.abort_requests(ABORT_DECODER.decode(body[0]))
            self._idle_stats_due = True
        elif kind == CALL:
            call_id, method = msgspec.msgpack.decode(body[0])
            self._call(call_id, method, pickle.loads(body[1]))
        elif kind == QUIT:
            self._quit = True
        else:
            raise ValueError(f"unknown frame kind {kind!r}")

    def _call(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            if method == "reset_prefix_cache":
                self._reply(call_id, True, self.core.reset_prefix_cache())
            elif method == "core_state":
                self._reply(call_id, True, self.core.state())
            elif method == "watch":  # (min_interval, max_share), or None to stop
                self._watch = args[0]
                self._view_due = 0.0
                self._reply(call_id, True, None)
            elif method == "check_constraint":
                if self.core.grammars is None:
                    raise RequestValidationError(
                        "this engine has no grammar engine", "structured_outputs"
                    )
                self._calls.append((call_id, self.core.grammars.compile(*args)))
            else:
                raise ValueError(f"unknown call {method!r}")
        except Exception as exc:
            self._reply(call_id, False, exc)

    def _finish_calls(self) -> None:
        pending = []
        for call_id, future in self._calls:
            if not future.done():
                pending.append((call_id, future))
                continue
            exc = future.exception()
            self._reply(call_id, exc is None, exc)
        self._calls = pending

    def _reply(self, call_id: int, ok: bool, result: Any) -> None:
        try:
            payload = pickle.dumps(result)
        except Exception as exc:  # an exception that does not pickle: send its words
            ok, payload = False, pickle.dumps(RuntimeError(f"{result!r} ({exc})"))
        self.output.send_multipart([REPLY, ENCODER.encode((call_id, ok)), payload])

    def _send(self, kind: bytes, payload: bytes) -> None:
        self.output.send_multipart([kind, payload], copy=False)


def main() -> int:
    """The process's entry point (ENTRY_POINT), with a pickled CoreLaunch on stdin."""
    from engine.core import EngineCore

    launch: CoreLaunch = pickle.load(sys.stdin.buffer)
    parent = os.getppid()
    # The frontend drains on SIGTERM/SIGINT first and then sends QUIT; a signal sent to the
    # whole process group must not end the core under requests still draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if launch.logging_config is not None:
        logging.config.dictConfig(launch.logging_config)
    else:
        logging.basicConfig(level=logging.INFO)
    loaded = threading.Event()
    threading.Thread(
        target=_exit_with_parent, args=(parent, loaded), name="parent-watch", daemon=True
    ).start()
    context = zmq.Context()
    with os.fdopen(launch.ready_fd, "wb") as ready:
        try:
            core = EngineCore.from_args(launch.args, launch.hooks)
            loaded.set()
        except BaseException as exc:
            logger.exception("engine core: loading failed")
            pickle.dump(_picklable(exc), ready)
            return 1
        pickle.dump(CoreReady(core.config), ready)
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(launch.input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, 2000)
    output_socket.connect(launch.output_address)
    proc = EngineCoreProc(core, input_socket, output_socket, parent)
    code = 0
    try:
        proc.run()
    except Exception as exc:
        logger.exception("engine core: a step failed")
        output_socket.send_multipart([FAILED, ENCODER.encode(f"the engine failed: {exc!r}")])
        code = 1
    finally:
        core.close()
        input_socket.close(linger=0)
        output_socket.close()
        context.term()
    return code


def _exit_with_parent(parent: int, loaded: threading.Event) -> None:
    """While the model loads, ends the process (and the tensor-parallel workers it started)
    when the frontend has gone; once loaded, the loop sees it between steps and closes the
    core properly."""
    while not loaded.wait(0.2):
        if os.getppid() != parent:
            logger.warning("engine core: the frontend has gone while loading; exiting")
            for child in multiprocessing.active_children():
                child.kill()
            os._exit(1)


def _picklable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip, else a RuntimeError with its words."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(repr(exc))
