"""`--api-server-count N`: N HTTP frontends (API server processes) on one port, over one
engine core process.

The `pagedserve serve` process becomes a supervisor. It reserves the port, starts the engine
core for N frontends (engine.start_core) and N frontend processes, each with its own
listening socket on the port (SO_REUSEPORT: the kernel spreads connections over them) and
its own pair of sockets to the core. Each frontend is a whole gateway: tokenization,
detokenization, streaming, probes, admission and /metrics, which prometheus-client's
multiprocess mode sums over the frontends (the engine's own gauges and counters come from
frontend 0 alone, so they count once).

The supervisor forwards SIGTERM and SIGINT to the frontends, which drain as a lone server
does and then tell the core to quit; the frontends run in a process group of their own, so
a terminal's Ctrl-C reaches them once. A frontend that dies, or exits while nobody asked,
ends everything with exit 1; so does the core's death (each frontend watches it).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from engine import AsyncLLM, CoreChannel, EngineArgs, EngineHooks, start_core
from server.logging_setup import configure_logging, process_logging_config
from server.settings import ServerSettings

logger = logging.getLogger("pagedserve.server")
FRONTEND_ENTRY = (
    "import sys; from server.api_servers import frontend_main; sys.exit(frontend_main())"
)
# After the frontends have exited, how long the core gets to see their QUITs and close;
# after a failure, a frontend that died never sent its QUIT, so the core gets a moment only.
CORE_EXIT_TIMEOUT_S = 15.0
FAILED_CORE_EXIT_TIMEOUT_S = 1.0
# After a failure, how long the other processes get to exit on SIGTERM before SIGKILL.
KILL_AFTER_S = 10.0


@dataclass(frozen=True)
class FrontendLaunch:
    settings: ServerSettings
    index: int
    port: int  # the port the supervisor reserved (--port, or the one 0 picked)
    channel: CoreChannel
    core_pid: int


def listening_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """A TCP socket on (host, port) that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
    return sock


def run_api_servers(settings: ServerSettings, engine_args: EngineArgs, hooks: EngineHooks) -> int:
    count = settings.api_server_count
    try:
        # Bound, not listening: it holds the port (and checks it is free) for as long as
        # the server runs, and takes no connection itself.
        reserved = listening_socket(settings.host, settings.port, listen=False)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc)
        return 2
    port = reserved.getsockname()[1]
    metrics_dir = tempfile.mkdtemp(prefix="pagedserve-metrics-")
    logging_config = process_logging_config(settings.log_level, settings.log_format)
    try:
        start = start_core(engine_args, hooks, logging_config, count)
    except BaseException:
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        raise
    logger.info("engine core: process %d, %d frontends on port %d", start.proc.pid, count, port)
    frontends: list[subprocess.Popen[bytes]] = []
    try:
        for index, channel in enumerate(start.channels):
            launch = FrontendLaunch(settings, index, port, channel, start.proc.pid)
            frontends.append(spawn_frontend(launch, metrics_dir))
            os.close(channel.ready_fd)  # the frontend holds its own copy
        return supervise(start.proc, frontends)
    finally:
        for proc in [*frontends, start.proc]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reserved.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(start.directory, ignore_errors=True)


def spawn_frontend(launch: FrontendLaunch, metrics_dir: str) -> subprocess.Popen[bytes]:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    # Read by prometheus-client when it is imported: every metric lives in a file there.
    env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    proc = subprocess.Popen(
        [sys.executable, "-c", FRONTEND_ENTRY],
        stdin=subprocess.PIPE,
        pass_fds=(launch.channel.ready_fd,),
        env=env,
        process_group=0,
    )
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(launch))
    proc.stdin.close()
    return proc


def supervise(core: subprocess.Popen[bytes], frontends: list[subprocess.Popen[bytes]]) -> int:
    """Waits for the frontends; returns the exit code (0 after a signal they all drained)."""
    signalled = False

    def forward(sig: int, frame: FrameType | None) -> None:
        nonlocal signalled
        signalled = True
        for proc in frontends:
            if proc.poll() is None:
                proc.send_signal(sig)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = 0
        while any(proc.poll() is None for proc in frontends):
            # Exit 0 only on a signal: a frontend that ends on its own has failed.
            failed = [p for p in frontends if p.poll() is not None and (p.poll() or not signalled)]
            if failed:
                proc = failed[0]
                logger.error("exiting: frontend %d exited with code %s", proc.pid, proc.returncode)
                code = 1
                _end(frontends)
                break
            time.sleep(0.1)
        if any(proc.returncode != 0 for proc in frontends):
            code = 1
        try:
            core.wait(timeout=FAILED_CORE_EXIT_TIMEOUT_S if code else CORE_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("engine core: still running after its frontends; killing it")
            core.kill()
            core.wait()
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _end(processes: list[subprocess.Popen[bytes]]) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + KILL_AFTER_S
    for proc in processes:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def frontend_main() -> int:
    """A frontend process's entry point (FRONTEND_ENTRY), a FrontendLaunch on stdin."""
    from server.runner import serve_app

    launch: FrontendLaunch = pickle.load(sys.stdin.buffer)
    settings = launch.settings
    log_config = configure_logging(settings.log_level, settings.log_format)
    # Attached before it listens: the kernel hands connections to every listening frontend,
    # so one still attaching would answer them 503 while the others serve.
    try:
        engine = AsyncLLM.attach(launch.channel, launch.core_pid)
    except Exception:
        logger.exception("model loading failed")
        code = 1
    else:
        sock = listening_socket(settings.host, launch.port)
        code = serve_app(engine, settings, log_config, sockets=[sock], frontend_index=launch.index)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
