"""Runs the gateway under uvicorn with Kubernetes-style draining on SIGTERM.

First SIGTERM (or SIGINT): readiness turns 503, new requests get 503, in-flight requests
run for up to --shutdown-timeout, then the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from types import FrameType

import uvicorn

from engine.factory import EngineArgs, create_engine
from server.app import create_app
from server.logging_setup import configure_logging
from server.settings import AppState, Phase, ServerSettings

logger = logging.getLogger("pagedserve.server")
# Test-only fault injection: the engine step after this many raises. Off unless set.
FAIL_AFTER_STEPS_ENV = "PAGEDSERVE_TEST_FAIL_AFTER_STEPS"


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task[None] | None = None
        self.exit_code = 0

    async def on_tick(self, counter: int) -> bool:
        """A model that fails to load ends the process (exit 1), so an orchestrator sees a
        crash rather than a live pod that can never become ready."""
        if self.state.phase is Phase.FAILED:
            logger.error("exiting: the model could not be loaded")
            self.exit_code = 1
            return True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self.state.phase is not Phase.READY:
            logger.warning("second shutdown signal or not serving: exiting now")
            self.force_exit = True
            self.should_exit = True
            return
        logger.info(
            "shutdown signal: draining for up to %.0fs", self.state.settings.shutdown_timeout
        )
        self.state.phase = Phase.DRAINING
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.settings.shutdown_timeout
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.in_flight:
            logger.warning("shutdown timeout: %d requests still in flight", self.state.in_flight)
        else:
            logger.info("drained: all in-flight requests finished")
        self.should_exit = True


def settings_from_args(args: argparse.Namespace) -> tuple[ServerSettings, EngineArgs]:
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or None,
        shutdown_timeout=args.shutdown_timeout,
        stall_timeout=args.stall_timeout,
        max_request_bytes=args.max_request_bytes,
        log_level=args.log_level,
        log_format=args.log_format,
        log_requests=args.log_requests,
    )
    engine_args = EngineArgs(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        num_threads=args.num_threads,
    )
    return settings, engine_args


def run_server(args: argparse.Namespace) -> int:
    settings, engine_args = settings_from_args(args)
    log_config = configure_logging(settings.log_level, settings.log_format)
    fail_after = os.environ.get(FAIL_AFTER_STEPS_ENV)
    app = create_app(
        lambda: create_engine(engine_args),
        settings,
        fail_after_steps=int(fail_after) if fail_after else None,
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=log_config,
        timeout_graceful_shutdown=1,
        lifespan="on",
    )
    server = DrainingServer(config, app.state.gateway)
    server.run()
    return server.exit_code
