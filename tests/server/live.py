"""A real uvicorn server in a background thread, and one in a subprocess for CLI tests."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from engine import AsyncLLM, BlockCounts
from engine.introspection import CoreState
from server.app import create_app
from server.settings import AppState, ServerSettings


async def _call(remote: Any, method: str) -> Any:
    return await remote.call(method)  # on the server's loop, where the core's sockets are


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one sample a server at `url` exports (the model_name label is implied)."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"{name} {labels} is not exported")


def free_port() -> int:
    return free_ports(1)[0]


def _port_block() -> list[int]:
    """The ports this test process hands out: below the kernel's ephemeral range, from which
    every outgoing connection (a test's client, another worker's) takes its own port, and a
    block of its own per xdist worker. (Ports bound to 0 came from that range: a client's
    connection could take one between free_ports and the server's bind, and the server then
    exited with 2, "address already in use".)"""
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    fields = path.read_text().split() if path.exists() else []
    low = int(fields[0]) if fields and fields[0].isdigit() else 32768  # else Linux's default
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    size = 500
    start = 10000 + (index % 16) * size
    if start + size > low:  # a host whose ephemeral range starts low: the kernel's choice
        return []
    ports = list(range(start, start + size))
    random_start = os.getpid() % size  # a rerun of the suite starts elsewhere in the block
    return ports[random_start:] + ports[:random_start]


_BLOCK = _port_block()
_next_port = 0


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now, from this process's own block (_port_block), in turn,
    so that two calls in a row cannot return the same port; else, where the host has no such
    block, ports the kernel picked (each socket stays bound until all are picked)."""
    global _next_port
    picked: list[int] = []
    for _ in range(len(_BLOCK)):
        if len(picked) == count:
            return picked
        port = _BLOCK[_next_port % len(_BLOCK)]
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or in TIME_WAIT from an earlier server)
        picked.append(port)
    if len(picked) == count:
        return picked
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_ready(
    url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None, probe: str = "/ready"
) -> None:
    """Until the probe answers 200 (/health: the process is up, perhaps still loading)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}{probe}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not become ready")


class LiveServer:
    """uvicorn serving create_app(engine, settings) on a free port, in a thread."""

    def __init__(self, engine: AsyncLLM, **settings: Any) -> None:
        # The listening socket is bound here and handed to uvicorn: a port picked first and
        # bound later can be taken in between (another test's connection, under xdist).
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        port = int(self.socket.getsockname()[1])
        self.settings = ServerSettings(host="127.0.0.1", port=port, **settings)
        self.app = create_app(engine, self.settings)
        self.engine = engine
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )
        self.url = f"http://127.0.0.1:{port}"

    @property
    def state(self) -> AppState:
        return self.app.state.gateway

    def engine_is_idle(self) -> bool:
        """Nothing running or waiting, no block held, no request object left anywhere."""
        if self.engine.core is None:  # the core runs in a process of its own: ask it
            state = self.core_state()
            counts = BlockCounts.of(state.states)
            held = counts.in_use + counts.shared
            queued = state.requests
        else:
            scheduler = self.engine.core.scheduler
            held = sum(len(b) for b in scheduler.kv_cache.req_to_blocks.values())
            queued = (*scheduler.running, *scheduler.waiting)
        return (
            not queued
            and held == 0
            and not self.engine.has_pending_work
            and self.state.in_flight == 0
        )

    def core_state(self) -> CoreState:
        """The engine core process's state now, read between two of its steps."""
        remote = self.engine._remote
        assert remote is not None and self.engine._task is not None
        loop = self.engine._task.get_loop()
        call = asyncio.run_coroutine_threadsafe(_call(remote, "core_state"), loop)
        state: CoreState = call.result(timeout=30)
        return state

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.engine_is_idle() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.engine_is_idle()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one exported sample (the model_name label is implied)."""
        return metric(self.url, name, **labels)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_ready(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()


class ServerProcess:
    """`pagedserve serve ...` (python -m server.launch, its entry point) as a subprocess,
    as a container would run it."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        log: Path | None = None,
        probe: str = "/ready",
    ):
        self.probe = probe  # what entering waits for
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "server.launch",
            "serve",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.env = {**os.environ, **(env or {})}
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        out = open(self.log, "wb") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        wait_ready(self.url, proc=self.proc, probe=self.probe)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
