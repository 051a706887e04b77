"""A served tensor-parallel engine: it answers through two ranks, and a rank that dies
makes the server fail its probes and exit rather than hang."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from tests.server.live import ServerProcess

TP_ARGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256"]


def children(pid: int) -> list[int]:
    """The processes any of `pid`'s threads started (the model loads on one)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return [int(child) for task in tasks for child in (task / "children").read_text().split()]


def descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [d for child in found for d in descendants(child)]


def worker_pids(pid: int) -> list[int]:
    """The server's tensor-parallel workers: processes under it (under its engine core
    process) started by multiprocessing's spawn (its resource tracker is one too, but not a
    worker)."""
    return [
        child
        for child in descendants(pid)
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


def test_a_dead_rank_fails_the_probes_and_ends_the_server(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    env = {"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "2"}
    with ServerProcess(
        [str(tiny_model_dir), *TP_ARGS], env=env, log=tmp_path / "server.log"
    ) as server:
        assert server.proc is not None
        body = {"prompt": "t10 t11 t12", "max_tokens": 4, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        (worker,) = worker_pids(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        probes = []
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                probes.append(httpx.get(f"{server.url}/health", timeout=2).status_code)
            except httpx.HTTPError:
                probes.append(0)  # no answer: the server is going away
            time.sleep(0.05)
        assert server.proc.wait(timeout=30) == 1
    assert 200 not in probes[1:]  # after the first probe, never healthy again
    log = (tmp_path / "server.log").read_text()
    assert "tensor-parallel worker pagedserve-tp1 exited" in log
