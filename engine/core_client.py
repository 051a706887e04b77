"""The frontend's handle on an engine core process (engine.core_proc).

`CoreProcess.launch` starts the process and blocks until it has loaded the model (run it in
a thread from async code); `connect` then binds the sockets on the running event loop.
Sends never block: the sockets have no high-water mark, and ZMQ keeps the order of frames.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

import engine
from engine.config import EngineArgs, EngineConfig, EngineHooks
from engine.core_proc import CALL, ENCODER, ENTRY_POINT, QUIT, CoreLaunch, CoreReady

logger = logging.getLogger(__name__)
# After QUIT, how long the core gets to close (its tensor-parallel workers among it)
# before it is killed.
QUIT_TIMEOUT_S = 10.0


class CoreProcess:
    def __init__(self, proc: subprocess.Popen[bytes], config: EngineConfig, directory: str):
        self.proc = proc
        self.config = config
        self._directory = directory
        self._input_address = f"ipc://{directory}/input"
        self._output_address = f"ipc://{directory}/output"
        self._context: zmq.asyncio.Context | None = None
        self._input: zmq.asyncio.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._stopping = False
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
        """Starts the core and waits for its model to load. Re-raises the exception that
        stopped the load (a ValueError for a setting that cannot work, FileNotFoundError
        for a missing model), or RuntimeError when the process died without one."""
        directory = tempfile.mkdtemp(prefix="pagedserve-core-")
        read_end, write_end = os.pipe()
        launch = CoreLaunch(
            args,
            hooks or EngineHooks(),
            f"ipc://{directory}/input",
            f"ipc://{directory}/output",
            write_end,
            logging_config,
        )
        env = dict(os.environ)
        # The same `engine` package as this process, wherever it was imported from.
        root = str(Path(engine.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", ENTRY_POINT],
                stdin=subprocess.PIPE,
                pass_fds=(write_end,),
                env=env,
            )
        except BaseException:
            os.close(read_end)
            shutil.rmtree(directory, ignore_errors=True)
            raise
        finally:
            os.close(write_end)
        assert proc.stdin is not None
        try:
            proc.stdin.write(pickle.dumps(launch))
            proc.stdin.close()
            with os.fdopen(read_end, "rb") as ready:
                report = ready.read()  # until the core has loaded, or died
        except BaseException:
            proc.kill()
            proc.wait()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        result = pickle.loads(report) if report else None
        if not isinstance(result, CoreReady):
            proc.wait()
            shutil.rmtree(directory, ignore_errors=True)
            if isinstance(result, BaseException):
                raise result
            raise RuntimeError(
                f"the engine core process exited with code {proc.returncode} while loading"
            )
        logger.info("engine core: process %d", proc.pid)
        return cls(proc, result.config, directory)

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
            code = self.proc.wait()
            if not loop.is_closed():  # else nobody is left to tell
                loop.call_soon_threadsafe(self._exited, code)

        threading.Thread(target=watch, name="engine-core-watch", daemon=True).start()

    def _exited(self, code: int) -> None:
        self.exit_code = code
        if not self._stopping and self.failure is None:
            self.failure = f"the engine core process exited with code {code}"
            logger.error("%s", self.failure)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(RuntimeError("the engine core process has exited"))
        self._calls.clear()

    @property
    def alive(self) -> bool:
        return self.exit_code is None

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
        """QUIT, then the process's exit (killed after QUIT_TIMEOUT_S), then the sockets."""
        self._stopping = True
        if self.alive and self._input is not None:
            self.send(QUIT)
        try:
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait), QUIT_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("engine core: no exit %.0fs after QUIT; killing it", QUIT_TIMEOUT_S)
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        self.close()

    def close(self) -> None:
        """Kills the process if it still runs; closes the sockets. Idempotent."""
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for socket in (self._input, self._output):
            if socket is not None:
                socket.close(linger=0)
        self._input = self._output = None
        if self._context is not None:
            self._context.term()
            self._context = None
        shutil.rmtree(self._directory, ignore_errors=True)
