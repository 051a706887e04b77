"""The frontend's handle on an engine core process (engine.core_proc).

`CoreProcess.launch` starts the process for a lone frontend and blocks until it has loaded
the model (run it in a thread from async code). With several frontends (API server
processes), their supervisor starts the core with `start_core` and hands each frontend its
CoreChannel, which `CoreProcess.attach` waits on. `connect` then binds the sockets on the
running event loop. Sends never block: the sockets have no high-water mark, and ZMQ keeps
the order of frames.

`pagedserve serve` starts the core's interpreter before it reads its flags
(`prestart_core`, from server/launch.py), and start_core hands that process its launch.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

import engine
from engine.config import EngineArgs, EngineHooks
from engine.core_proc import (
    CALL,
    ENCODER,
    ENTRY_POINT,
    QUIT,
    CoreChannel,
    CoreLaunch,
    CoreReady,
)

logger = logging.getLogger(__name__)
# After QUIT, how long the core gets to close (its tensor-parallel workers among it)
# before it is killed.
QUIT_TIMEOUT_S = 10.0


@dataclass
class CoreStart:
    """A core process that is loading: its frontends' channels (with the read ends of
    their load pipes) and the directory of its sockets, which the starter removes."""

    proc: subprocess.Popen[bytes]
    channels: list[CoreChannel]
    directory: str


# The core's OpenMP wait policy, where the environment sets none (see start_core).
OMP_WAIT_POLICY = "PASSIVE"


def core_env() -> dict[str, str]:
    """The core process's environment: this one's, with the OpenMP wait policy and the
    path to this process's `engine` package."""
    env = dict(os.environ)
    # OpenMP threads that wait at a step's barriers sleep rather than spin (unless the user
    # says otherwise). On a shared CPU a spinning thread burns its group's share while the
    # one it waits for is parked: with one busy neighbour in another session (a container
    # beside another), a default-model token took 1.2 s against 12 ms passive. Quiet, a
    # short spin is faster (single-stream ITL 7.7 against 9.2 ms with GOMP_SPINCOUNT=1000)
    # but doubled it beside such a neighbour (docs/benchmarks.md, "A shared or throttled
    # CPU" and the OpenMP wait policy, again), so sleeping is the default. What the wakes
    # cost small steps, StepThreads wins back by running them on one thread where that
    # measures faster (engine/worker/cpu_threads.py).
    # A GOMP_SPINCOUNT of the user's is a choice too: PASSIVE would make libgomp ignore it.
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["OMP_WAIT_POLICY"] = OMP_WAIT_POLICY
    # The same `engine` package as this process, wherever it was imported from.
    root = str(Path(engine.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


@dataclass
class Prestarted:
    """A core interpreter started before its frontend knew its settings (prestart_core):
    importing torch, the models and transformers while the frontend imports its own. It
    holds the write end of one load pipe (`ready_write`, its number in the child) and
    waits for its CoreLaunch on stdin."""

    proc: subprocess.Popen[bytes]
    ready_read: int
    ready_write: int
    env: dict[str, str]

    def discard(self) -> None:
        self.proc.kill()
        self.proc.wait()
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        os.close(self.ready_read)


_prestarted: Prestarted | None = None


def prestart_core() -> None:
    """Starts a core's interpreter now, for the next start_core of a lone frontend to
    use: its imports (about 3.7 s of a 2-core VM) then overlap the frontend's own, which
    `pagedserve serve` runs before it has read its flags. start_core takes it only for
    one frontend and the same environment; discard_prestarted (also at this process's
    exit) ends it otherwise. If this process dies first, the core reads an empty stdin and
    exits."""
    global _prestarted
    discard_prestarted()
    env = core_env()
    read, write = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", ENTRY_POINT], stdin=subprocess.PIPE, pass_fds=[write], env=env
        )
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    _prestarted = Prestarted(proc, read, write, env)
    atexit.unregister(discard_prestarted)  # once, however many prestarts
    atexit.register(discard_prestarted)


def discard_prestarted() -> None:
    """Ends the prestarted core, if one is waiting."""
    global _prestarted
    prestarted, _prestarted = _prestarted, None
    if prestarted is not None:
        prestarted.discard()


def _take_prestarted(num_frontends: int, env: dict[str, str]) -> Prestarted | None:
    global _prestarted
    prestarted, _prestarted = _prestarted, None
    if prestarted is None:
        return None
    if num_frontends == 1 and prestarted.env == env and prestarted.proc.poll() is None:
        return prestarted
    prestarted.discard()
    return None


def start_core(
    args: EngineArgs,
    hooks: EngineHooks | None,
    logging_config: dict[str, Any] | None,
    num_frontends: int = 1,
) -> CoreStart:
    """Starts the core process for `num_frontends` frontends (or hands its launch to the
    prestarted one); returns at once."""
    env = core_env()
    prestarted = _take_prestarted(num_frontends, env)
    directory = tempfile.mkdtemp(prefix="pagedserve-core-")
    if prestarted is not None:
        pipes = [(prestarted.ready_read, prestarted.ready_write)]
    else:
        pipes = [os.pipe() for _ in range(num_frontends)]
    addresses = [
        (f"ipc://{directory}/input-{i}", f"ipc://{directory}/output-{i}")
        for i in range(num_frontends)
    ]
    launch = CoreLaunch(
        args,
        hooks or EngineHooks(),
        [CoreChannel(*pair, write) for pair, (_, write) in zip(addresses, pipes, strict=True)],
        logging_config,
        os.getpid(),
        directory,
    )
    if prestarted is not None:
        proc = prestarted.proc
        logger.info("engine core: process %d, started before the flags were read", proc.pid)
    else:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", ENTRY_POINT],
                stdin=subprocess.PIPE,
                pass_fds=[write for _, write in pipes],
                env=env,
            )
        except BaseException:
            for read, _ in pipes:
                os.close(read)
            shutil.rmtree(directory, ignore_errors=True)
            raise
        finally:
            for _, write in pipes:
                os.close(write)
    assert proc.stdin is not None
    try:
        proc.stdin.write(pickle.dumps(launch))
        proc.stdin.close()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    channels = [CoreChannel(*pair, read) for pair, (read, _) in zip(addresses, pipes, strict=True)]
    return CoreStart(proc, channels, directory)


def wait_loaded(channel: CoreChannel) -> CoreReady | BaseException | None:
    """Blocks until the core reports its load on the channel's pipe (closing it): the
    CoreReady, the exception that stopped the load, or None when the core died silently."""
    with os.fdopen(channel.ready_fd, "rb") as ready:
        report = ready.read()
    result = pickle.loads(report) if report else None
    assert result is None or isinstance(result, CoreReady | BaseException)
    return result


class CoreProcess:
    def __init__(
        self,
        ready: CoreReady,
        channel: CoreChannel,
        pid: int,
        proc: subprocess.Popen[bytes] | None = None,
        directory: str | None = None,
    ):
        """`proc` and `directory` when this frontend started the core (and stops it);
        without them, a supervisor owns both and this frontend only leaves."""
        self.config = ready.config
        self.tokenizer = ready.tokenizer  # the core's, or None (see core_proc.CoreReady)
        self.pid = pid
        self.proc = proc
        self._directory = directory
        self._input_address = channel.input_address
        self._output_address = channel.output_address
        self._context: zmq.asyncio.Context | None = None
        self._input: zmq.asyncio.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._stopping = False
        self._exited_event = threading.Event()
        # Why the core can never step again though this process lives: a message from the
        # core (a dead tensor-parallel rank), or its unexpected exit.
        self.failure: str | None = None
        self.exit_code: int | None = None

    @classmethod
    def launch(
        cls,
        args: EngineArgs,
        hooks: EngineHooks | None = None,
        logging_config: dict[str, Any] | None = None,
    ) -> CoreProcess:
        """Starts a core for this frontend alone and waits for its model to load.
        Re-raises the exception that stopped the load (a ValueError for a setting that
        cannot work, FileNotFoundError for a missing model), or RuntimeError when the
        process died without one."""
        start = start_core(args, hooks, logging_config)
        try:
            result = wait_loaded(start.channels[0])
        except BaseException:
            start.proc.kill()
            start.proc.wait()
            shutil.rmtree(start.directory, ignore_errors=True)
            raise
        if not isinstance(result, CoreReady):
            start.proc.wait()
            shutil.rmtree(start.directory, ignore_errors=True)
            if isinstance(result, BaseException):
                raise result
            raise RuntimeError(
                f"the engine core process exited with code {start.proc.returncode} while loading"
            )
        logger.info("engine core: process %d", start.proc.pid)
        return cls(result, start.channels[0], start.proc.pid, start.proc, start.directory)

    @classmethod
    def attach(cls, channel: CoreChannel, pid: int) -> CoreProcess:
        """Waits for the core a supervisor started (process `pid`) to load, as one of its
        frontends. Raises as launch does."""
        result = wait_loaded(channel)
        if isinstance(result, BaseException):
            raise result
        if result is None:
            raise RuntimeError("the engine core process exited while loading")
        return cls(result, channel, pid)

    # ---- on the event loop -----------------------------------------------------------

    def connect(self) -> None:
        """Binds the sockets on the running loop and starts watching the process."""
        loop = asyncio.get_running_loop()
        self._context = zmq.asyncio.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(self._input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(self._output_address)

        def watch() -> None:
            code = self._wait_exit()
            self._exited_event.set()
            if not loop.is_closed():  # else nobody is left to tell
                loop.call_soon_threadsafe(self._exited, code)

        threading.Thread(target=watch, name="engine-core-watch", daemon=True).start()

    def _wait_exit(self) -> int | None:
        """Blocks until the core exits: its exit code, or None when it is not our child
        (a pidfd turns readable when any process exits)."""
        if self.proc is not None:
            return self.proc.wait()
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return None
        try:
            select.select([pidfd], [], [])
        finally:
            os.close(pidfd)
        return None

    def _exited(self, code: int | None) -> None:
        self.exit_code = -1 if code is None else code
        if not self._stopping and self.failure is None:
            self.failure = (
                "the engine core process exited"
                if code is None
                else f"the engine core process exited with code {code}"
            )
            logger.error("%s", self.failure)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(RuntimeError("the engine core process has exited"))
        self._calls.clear()

    @property
    def alive(self) -> bool:
        return self.exit_code is None and not self._exited_event.is_set()

    def send(self, kind: bytes, *frames: bytes) -> None:
        assert self._input is not None
        self._input.send_multipart([kind, *frames], copy=False)

    async def recv(self) -> list[bytes]:
        assert self._output is not None
        return list(await self._output.recv_multipart())

    def call(self, method: str, *args: Any) -> asyncio.Future[Any]:
        """Runs `method` in the core between two steps; the future has its result."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self.alive:
            future.set_exception(RuntimeError("the engine core process has exited"))
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self.send(CALL, ENCODER.encode((call_id, method)), pickle.dumps(args))
        return future

    def reply(self, header: bytes, payload: bytes) -> None:
        call_id, ok = msgspec.msgpack.decode(header)
        future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        result = pickle.loads(payload)
        if ok:
            future.set_result(result)
        else:
            future.set_exception(result)

    async def shutdown(self) -> None:
        """QUIT; then, for a core this frontend started, its exit (killed after
        QUIT_TIMEOUT_S); then the sockets."""
        self._stopping = True
        if self.alive and self._input is not None:
            self.send(QUIT)
        if self.proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), QUIT_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning("engine core: no exit %.0fs after QUIT; killing it", QUIT_TIMEOUT_S)
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        self.close()

    def close(self) -> None:
        """Kills a core this frontend started if it still runs; closes the sockets.
        Idempotent."""
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for socket in (self._input, self._output):
            if socket is not None:
                socket.close(linger=0 if self.proc is not None else 1000)
        self._input = self._output = None
        if self._context is not None:
            self._context.term()
            self._context = None
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
