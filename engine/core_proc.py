"""EngineCoreProc: the engine core in a process of its own, as vLLM V1 runs it.

The scheduler, the KV cache, the model runner and the grammar compiler live here; the
frontend (AsyncLLM) keeps tokenization, detokenization, stop strings and the `n` fan-out.
The process steps back to back while it has work and sleeps on its input socket while it
has none, so the frontend's host work runs beside the model instead of between its steps.

Wire (ZMQ, two ipc sockets per frontend, which binds both; with --api-server-count N
there are N frontends, each on its own pair, and the core routes each request's outputs,
refusals and call replies to the frontend that sent it):

    frontend PUSH -> core PULL   [ADD, msgpack list[CoreRequest]]  [ABORT, msgpack list[str]]
                                 [CALL, msgpack (call id, method), pickled args]  [QUIT]
    core PUSH -> frontend PULL   [STEP, msgpack StepResult, adds seen]
                                 [REJECT, msgpack id, pickled error]
                                 [REPLY, msgpack (call id, ok), pickled result or message]
                                 [VIEW, pickled (CoreState, seconds it took)]
                                 [FATAL, msgpack message]  [FAILED, msgpack message]

The hot messages (adds, aborts, step results) are msgspec-encoded typed batches. Calls
(prefix-cache reset, constraint checks, watching) are rare and carry pickles. While the
frontend has watchers, the core sends its state for the live view between steps, as often
as the frontend's EngineMonitor would take one in-process: after a step once one is due,
and after min_interval of idleness.
Before the sockets, the process reports its load on a pipe: the EngineConfig and the
tokenizer the core loaded, or the exception that stopped it, as a pickle. The frontend takes
the tokenizer from there: reading it with AutoTokenizer would import torch (transformers'
config machinery does), some 2 s and 250 MB of a frontend that runs no model.

With several frontends, frontend 0 gets every step's result (it publishes the engine's
gauges and counters, once); the others get a step's result when it holds outputs of theirs.

The process outlives no one: it exits when its parent does (it polls getppid, which is
exact for a reparented child, against the pid the frontend sent: one that exited while the
core was still importing has reparented it before its first look), ignores the terminal's
SIGINT and SIGTERM (the frontends drain first, then each sends QUIT; the core exits after
the last), and exits 1 after reporting a step that raised.
"""

from __future__ import annotations

import logging
import logging.config
import multiprocessing
import os
import pickle
import shutil
import signal
import struct
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
from engine.lora.request import LoRARequest
from engine.pooling import PoolingParams
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
ENTRY_POINT = "from engine.core_proc import run_and_exit; run_and_exit()"
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
    pooling_params: PoolingParams | None = None
    lora: LoRARequest | None = None

    @classmethod
    def of(cls, request: Request) -> CoreRequest:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_ids,
            request.cache_salt,
            request.arrival_time,
            request.pooling_params,
            request.lora,
        )

    def to_request(self) -> Request:
        return Request(
            self.request_id,
            self.prompt_token_ids,
            self.sampling_params,
            self.eos_token_ids,
            self.cache_salt,
            arrival_time=self.arrival_time,
            pooling_params=self.pooling_params,
            lora=self.lora,
        )


ENCODER = msgspec.msgpack.Encoder()
ADD_DECODER = msgspec.msgpack.Decoder(list[CoreRequest])
ABORT_DECODER = msgspec.msgpack.Decoder(list[str])
STEP_DECODER = msgspec.msgpack.Decoder(StepResult)
# A STEP's third frame: the ADD frames from its frontend that the core had applied.
ADDS_SEEN = struct.Struct("<Q")


@dataclass(frozen=True)
class CoreChannel:
    """One frontend's link to the core: its two sockets, and a pipe the core reports its
    load on (the core holds the write end, the frontend the read end)."""

    input_address: str
    output_address: str
    ready_fd: int


@dataclass(frozen=True)
class CoreLaunch:
    """Everything the process needs, pickled onto its stdin."""

    args: EngineArgs
    hooks: EngineHooks
    channels: list[CoreChannel]  # one per frontend
    logging_config: dict[str, Any] | None
    # The starting frontend's pid. The core's own getppid() at startup would not do: a
    # frontend that exits while the core is still importing has reparented it already.
    parent: int
    # The directory of the channels' sockets, which the starter made and removes; the core
    # removes it when it outlives the starter (killed, or gone while the model loaded).
    directory: str


@dataclass(frozen=True)
class CoreReady:
    """A loaded core's report. `tokenizer`: the model's, as the core read it (None where it
    does not pickle; the frontend then reads its own)."""

    config: EngineConfig
    tokenizer: Any = None


class EngineCoreProc:
    """The loop of the core process. Not thread-safe: everything runs on its main thread,
    which is also the one that loaded the model (one OpenMP pool; see engine_thread).
    `inputs[i]` and `outputs[i]` are frontend i's sockets."""

    def __init__(self, core: Any, inputs: list[Any], outputs: list[Any], parent: int) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent = parent
        self._client_of = {socket: i for i, socket in enumerate(inputs)}
        self._poller = zmq.Poller()
        for socket in inputs:
            self._poller.register(socket, zmq.POLLIN)
        # The frontend of each unfinished request; None with one frontend.
        self._owner: dict[str, int] | None = {} if len(outputs) > 1 else None
        # Calls that finish on other threads: (frontend, call id, future).
        self._calls: list[tuple[int, int, Future[Any]]] = []
        self._idle_stats_due = False  # an abort may have left the core idle: say so once
        self._fatal_sent = False
        self._quitted: set[int] = set()
        # ADD frames applied from each frontend, sent with each STEP (ADDS_SEEN): a step's
        # waiting queue holds these adds and none after, which the frontend counts itself.
        self._adds_seen = [0] * len(outputs)
        # The live view: (min_interval, max_share) of each frontend that has watchers.
        self._watch: dict[int, tuple[float, float]] = {}
        self._view_due = 0.0  # monotonic time the next view is due
        self._idle_since = time.monotonic()

    def run(self) -> None:
        while len(self._quitted) < len(self.outputs):
            if os.getppid() != self.parent:
                logger.warning("engine core: the frontend has gone; exiting")
                return
            busy = self.core.has_unfinished_requests()
            for socket, _ in self._poller.poll(0 if busy else self._idle_timeout_ms()):
                self._drain(socket)
            if self._calls:
                self._finish_calls()
            if self.core.has_unfinished_requests():
                self._publish(self.core.step())
                self._idle_stats_due = True
                if self._watch and time.monotonic() >= self._view_due:
                    self._send_view()
                self._idle_since = time.monotonic()
            else:
                if self._idle_stats_due:
                    idle = ENCODER.encode(StepResult([], self.core.stats()))
                    for client in range(len(self.outputs)):
                        self._send(client, STEP, idle)
                    self._idle_stats_due = False
                if self._watch and time.monotonic() >= self._idle_view_due():
                    self._send_view()
            failure = self.core.failure()
            if failure is not None and not self._fatal_sent:
                for client in range(len(self.outputs)):
                    self._send(client, FATAL, ENCODER.encode(failure))
                self._fatal_sent = True

    def _publish(self, result: StepResult) -> None:
        """Sends a step's result: whole to a lone frontend; else each frontend its own
        outputs, and frontend 0 every step (the engine's stats are counted once, there)."""
        if self._owner is None:
            self._send(0, STEP, ENCODER.encode(result))
            return
        shares: list[list[Any]] = [[] for _ in self.outputs]
        for output in result.outputs:
            client = self._owner.get(output.request_id)
            if output.finished:
                self._owner.pop(output.request_id, None)
            if client is not None:
                shares[client].append(output)
        for client, share in enumerate(shares):
            if share or client == 0:
                self._send(client, STEP, ENCODER.encode(StepResult(share, result.stats)))

    def _idle_timeout_ms(self) -> int:
        if self._calls:
            return PENDING_POLL_MS
        idle = IDLE_POLL_MS if self.core.tp_group is None else WORKERS_POLL_MS
        if not self._watch:
            return idle
        wait = self._idle_view_due() - time.monotonic()
        return max(0, min(idle, int(wait * 1000) + 1))

    def _idle_view_due(self) -> float:
        min_interval = min(interval for interval, _ in self._watch.values())
        return max(self._view_due, self._idle_since + min_interval)

    def _send_view(self) -> None:
        min_interval = min(interval for interval, _ in self._watch.values())
        max_share = min(share for _, share in self._watch.values())
        start = time.perf_counter()
        state = self.core.state()
        cost = time.perf_counter() - start
        view = pickle.dumps((state, cost))
        for client in self._watch:
            self.outputs[client].send_multipart([VIEW, view])
        self._view_due = time.monotonic() + max(min_interval, cost / max_share)
        self._idle_since = time.monotonic()

    def _drain(self, socket: Any) -> None:
        client = self._client_of[socket]
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._apply(client, frames[0].bytes, [frame.buffer for frame in frames[1:]])
            if client in self._quitted:
                return

    def _apply(self, client: int, kind: bytes, body: list[Any]) -> None:
        if kind == ADD:
            self._adds_seen[client] += 1
            for wire in ADD_DECODER.decode(body[0]):
                try:
                    self.core.add_request(wire.to_request())
                except ValueError as exc:  # RequestValidationError among them
                    error = pickle.dumps(_picklable(exc))
                    self.outputs[client].send_multipart(
                        [REJECT, ENCODER.encode(wire.request_id), error]
                    )
                    continue
                if self._owner is not None:
                    self._owner[wire.request_id] = client
        elif kind == ABORT:
            request_ids = ABORT_DECODER.decode(body[0])
            self.core.abort_requests(request_ids)
            if self._owner is not None:
                for request_id in request_ids:
                    self._owner.pop(request_id, None)
            self._idle_stats_due = True
        elif kind == CALL:
            call_id, method = msgspec.msgpack.decode(body[0])
            self._call(client, call_id, method, pickle.loads(body[1]))
        elif kind == QUIT:
            self._quitted.add(client)
            self._watch.pop(client, None)
            if self._owner is not None:  # what it left running serves nobody now
                left = [rid for rid, owner in self._owner.items() if owner == client]
                self.core.abort_requests(left)
                for request_id in left:
                    del self._owner[request_id]
                self._idle_stats_due = True
        else:
            raise ValueError(f"unknown frame kind {kind!r}")

    def _call(self, client: int, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            if method == "reset_prefix_cache":
                self._reply(client, call_id, True, self.core.reset_prefix_cache())
            elif method in ("add_lora", "remove_lora"):
                self._reply(client, call_id, True, getattr(self.core, method)(*args))
            elif method == "core_state":
                self._reply(client, call_id, True, self.core.state())
            elif method == "watch":  # (min_interval, max_share), or None to stop
                if args[0] is None:
                    self._watch.pop(client, None)
                else:
                    self._watch[client] = args[0]
                    self._view_due = 0.0
                self._reply(client, call_id, True, None)
            elif method == "check_constraint":
                if self.core.grammars is None:
                    raise RequestValidationError(
                        "this engine has no grammar engine", "structured_outputs"
                    )
                self._calls.append((client, call_id, self.core.grammars.compile(*args)))
            else:
                raise ValueError(f"unknown call {method!r}")
        except Exception as exc:
            self._reply(client, call_id, False, exc)

    def _finish_calls(self) -> None:
        pending = []
        for client, call_id, future in self._calls:
            if not future.done():
                pending.append((client, call_id, future))
                continue
            exc = future.exception()
            self._reply(client, call_id, exc is None, exc)
        self._calls = pending

    def _reply(self, client: int, call_id: int, ok: bool, result: Any) -> None:
        try:
            payload = pickle.dumps(result)
        except Exception as exc:  # an exception that does not pickle: send its words
            ok, payload = False, pickle.dumps(RuntimeError(f"{result!r} ({exc})"))
        self.outputs[client].send_multipart([REPLY, ENCODER.encode((call_id, ok)), payload])

    def _send(self, client: int, kind: bytes, payload: bytes) -> None:
        frames = [kind, payload]
        if kind == STEP:
            frames.append(ADDS_SEEN.pack(self._adds_seen[client]))
        self.outputs[client].send_multipart(frames, copy=False)


def main() -> int:
    """The process's work (ENTRY_POINT runs it), with a pickled CoreLaunch on stdin."""
    from engine.core import EngineCore
    from engine.models.hf_config import import_config_machinery

    import_config_machinery()  # a prestarted core's frontend is still starting
    data = sys.stdin.buffer.read()
    if not data:  # a prestarted core (core_client.prestart_core) its frontend did not use
        return 0
    launch: CoreLaunch = pickle.loads(data)
    parent = launch.parent
    # The frontend drains on SIGTERM/SIGINT first and then sends QUIT; a signal sent to the
    # whole process group must not end the core under requests still draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if launch.logging_config is not None:
        logging.config.dictConfig(launch.logging_config)
    else:
        logging.basicConfig(level=logging.INFO)
    if os.getppid() != parent:
        logger.warning("engine core: the frontend had gone before the core started; exiting")
        shutil.rmtree(launch.directory, ignore_errors=True)
        return 1
    loaded = threading.Event()
    threading.Thread(
        target=_exit_with_parent, args=(launch, loaded), name="parent-watch", daemon=True
    ).start()
    context = zmq.Context()
    try:
        core = EngineCore.from_args(launch.args, launch.hooks)
        loaded.set()
    except BaseException as exc:
        logger.exception("engine core: loading failed")
        _report(launch.channels, _picklable(exc))
        return 1
    _report(launch.channels, CoreReady(core.config, core.tokenizer))
    inputs, outputs = [], []
    for channel in launch.channels:
        inputs.append(context.socket(zmq.PULL))
        inputs[-1].connect(channel.input_address)
        outputs.append(context.socket(zmq.PUSH))
        outputs[-1].setsockopt(zmq.LINGER, 2000)
        outputs[-1].connect(channel.output_address)
    proc = EngineCoreProc(core, inputs, outputs, parent)
    code = 0
    try:
        proc.run()
    except Exception as exc:
        logger.exception("engine core: a step failed")
        failed = ENCODER.encode(f"the engine failed: {exc!r}")
        for socket in outputs:
            socket.send_multipart([FAILED, failed])
        code = 1
    finally:
        core.close()
        for socket in inputs:
            socket.close(linger=0)
        for socket in outputs:
            socket.close()
        context.term()
        if os.getppid() != parent:
            shutil.rmtree(launch.directory, ignore_errors=True)
    return code


def run_and_exit() -> None:
    """main(), then the exit without the interpreter's teardown of torch, which takes a
    second or more and would hold up the frontend's shutdown (the core has closed what it
    holds by then; only the logs need flushing)."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report(channels: list[CoreChannel], result: CoreReady | BaseException) -> None:
    """The load's outcome, to every frontend's pipe (one that has gone is skipped)."""
    try:
        payload = pickle.dumps(result)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        assert isinstance(result, CoreReady)  # exceptions are made picklable first
        logger.warning("engine core: the tokenizer does not pickle (%r); frontends read it", exc)
        payload = pickle.dumps(CoreReady(result.config))
    for channel in channels:
        try:
            with os.fdopen(channel.ready_fd, "wb") as ready:
                ready.write(payload)
        except BrokenPipeError:
            logger.warning("engine core: a frontend left before the model loaded")


def _exit_with_parent(launch: CoreLaunch, loaded: threading.Event) -> None:
    """While the model loads, ends the process (and the tensor-parallel workers it started)
    when the frontend has gone; once loaded, the loop sees it between steps and closes the
    core properly."""
    while not loaded.wait(0.2):
        if os.getppid() != launch.parent:
            logger.warning("engine core: the frontend has gone while loading; exiting")
            for child in multiprocessing.active_children():
                child.kill()
            shutil.rmtree(launch.directory, ignore_errors=True)
            os._exit(1)


def _picklable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip, else a RuntimeError with its words."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(repr(exc))
