"""Runs the gateway under uvicorn with Kubernetes-style draining on SIGTERM.

First SIGTERM (or SIGINT): readiness turns 503, new requests get 503, in-flight requests
run for up to --shutdown-timeout; whatever still runs then is cut off (an SSE error event,
or 503), and the process exits 0. A second signal cuts off at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn

from engine import AsyncLLM, EngineArgs, EngineHooks
from server.app import create_app
from server.logging_setup import configure_logging, process_logging_config
from server.settings import AppState, Phase, ServerSettings

logger = logging.getLogger("pagedserve.server")
# Test-only hooks, off unless set: the engine step after this many raises; every step
# first sleeps this many seconds; the block pool's invariants are checked after every step;
# loading the model first sleeps this many seconds.
FAIL_AFTER_STEPS_ENV = "PAGEDSERVE_TEST_FAIL_AFTER_STEPS"
STEP_DELAY_ENV = "PAGEDSERVE_TEST_STEP_DELAY"
CHECK_INVARIANTS_ENV = "PAGEDSERVE_TEST_CHECK_INVARIANTS"
LOAD_DELAY_ENV = "PAGEDSERVE_TEST_LOAD_DELAY"
# After the drain deadline, how long cut-off requests get to send their last words.
CUTOFF_GRACE_S = 0.5


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task[None] | None = None
        self.exit_code = 0

    async def on_tick(self, counter: int) -> bool:
        """A model that fails to load, or an engine that can never step again (a dead
        tensor-parallel rank), ends the process (exit 1), so an orchestrator sees a crash
        rather than a live pod that can never serve."""
        if self.state.phase is Phase.FAILED:
            logger.error("exiting: the model could not be loaded")
            self.exit_code = 1
            return True
        serving = self.state.serving
        if serving is not None and serving.engine.fatal_error is not None:
            logger.error("exiting: %s", serving.engine.fatal_error)
            if serving.engine.has_pending_work:
                serving.engine.close(serving.engine.fatal_error)
            self.exit_code = 1
            return True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT through the event loop's own signal handling, so the handler
        runs as a loop callback (where it may start the drain task), not between bytecodes."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = asyncio.get_running_loop()
        if self.state.phase is Phase.DRAINING:
            logger.warning("second shutdown signal: cutting off in-flight requests now")
            if self._drain_task is not None:
                self._drain_task.cancel()
            self._drain_task = loop.create_task(self._cut_off())
            return
        if self.state.phase is not Phase.READY:
            # Nothing to drain. The lifespan's shutdown still runs: it cancels a load in
            # progress, whose thread does not hold the process (app.in_daemon_thread);
            # force_exit would skip it, and uvicorn then logs the lifespan's cancellation
            # as an error.
            logger.warning("shutdown signal while not serving: exiting now")
            self.should_exit = True
            return
        logger.info(
            "shutdown signal: draining for up to %.0fs", self.state.settings.shutdown_timeout
        )
        self.state.phase = Phase.DRAINING
        self._drain_task = loop.create_task(self._drain())

    async def _drain(self) -> None:
        """Waits for in-flight requests up to the deadline, then cuts off the rest."""
        await self._wait_in_flight(time.monotonic() + self.state.settings.shutdown_timeout)
        if self.state.in_flight:
            logger.warning(
                "shutdown timeout: cutting off %d requests still in flight", self.state.in_flight
            )
            await self._cut_off()
        else:
            logger.info("drained: all in-flight requests finished")
            self.should_exit = True

    async def _cut_off(self) -> None:
        """Ends every request: streams with an error event and [DONE], waiting ones with
        503. Only then does uvicorn shut down, so no request task is left to cancel."""
        if self.state.serving is not None:
            self.state.serving.engine.close("the server is shutting down")
        await self._wait_in_flight(time.monotonic() + CUTOFF_GRACE_S)
        self.should_exit = True

    async def _wait_in_flight(self, deadline: float) -> None:
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def test_hooks() -> EngineHooks:
    fail_after = os.environ.get(FAIL_AFTER_STEPS_ENV)
    return EngineHooks(
        check_invariants=os.environ.get(CHECK_INVARIANTS_ENV) == "1",
        fail_after_steps=int(fail_after) if fail_after else None,
        step_delay=float(os.environ.get(STEP_DELAY_ENV) or 0),
    )


def run_server(settings: ServerSettings, engine_args: EngineArgs) -> int:
    log_config = configure_logging(settings.log_level, settings.log_format)
    hooks = test_hooks()
    if settings.api_server_count > 1:
        from server.api_servers import run_api_servers

        return run_api_servers(settings, engine_args, hooks)
    load_delay = float(os.environ.get(LOAD_DELAY_ENV) or 0)

    def load() -> AsyncLLM:
        if load_delay > 0:
            time.sleep(load_delay)
        return AsyncLLM.from_engine_args(
            engine_args, hooks, process_logging_config(settings.log_level, settings.log_format)
        )

    return serve_app(load, settings, log_config)


def serve_app(
    load: AsyncLLM | Callable[[], AsyncLLM],
    settings: ServerSettings,
    log_config: dict[str, Any],
    sockets: list[socket.socket] | None = None,
    frontend_index: int | None = None,
) -> int:
    """Serves the gateway over the engine `load` returns, or over `load` itself, loaded (on
    the given listening sockets, or on --host/--port) until a signal or a failure; returns
    the exit code."""
    try:
        app = create_app(load, settings, frontend_index)
    except (OSError, ValueError) as exc:  # a bad --api-keys-file
        logger.error("cannot start: %s", exc)
        return 2
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=log_config,
        timeout_graceful_shutdown=1,
        lifespan="on",
    )
    server = DrainingServer(config, app.state.gateway)
    server.run(sockets=sockets)
    return server.exit_code
