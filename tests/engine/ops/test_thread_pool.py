"""The native kernels' parallel regions (engine/ops/csrc/thread_pool.cpp, parallel.h): chunks
as at::parallel_for makes them, each index run once whatever the thread count, exceptions
raised in the caller; on the kernels' own pool where OpenMP's threads sleep
(OMP_WAIT_POLICY=PASSIVE, the engine core's default), whose workers sleep once idle and
which a forked child starts afresh. The pool's checks run in a process started with
PASSIVE (libgomp reads the policy once, at load); this process's regions run on OpenMP."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.ops.loader import native_kernels
from tests.threads import torch_threads

pytestmark = pytest.mark.skipif(not native_kernels().available, reason="no native kernels")

CASES = [(0, 1, 1), (0, 7, 1), (5, 1000, 64), (3, 4, 8)]


def probe(begin: int, end: int, grain: int = 1, throw_at: int = -1) -> tuple[list[int], int]:
    counts, threads, _ = torch.ops.pagedserve._parallel_probe(begin, end, grain, throw_at)
    return counts.tolist(), threads


def on_pool() -> bool:
    return bool(torch.ops.pagedserve._parallel_probe(0, 1, 1, -1)[2])


def check_every_index_runs_once() -> None:
    for threads in (1, 2, 3, 4):
        with torch_threads(threads):
            for begin, end, grain in CASES:
                for _ in range(50):  # back to back: workers awake, generations moving on
                    counts, used = probe(begin, end, grain)
                    assert counts == [1] * (end - begin)
                    assert 1 <= used <= min(threads, -(-(end - begin) // grain))
    assert probe(4, 4) == ([], 0)


def check_exceptions_reach_the_caller() -> None:
    with torch_threads(2):
        for at in (0, 999):  # the caller's chunk, a worker's
            with pytest.raises(RuntimeError, match=f"thrown at {at}"):
                probe(0, 1000, 1, at)
        assert probe(0, 1000)[0] == [1] * 1000


def check_idle_workers_sleep() -> None:
    """After a burst of regions the workers spin for microseconds, then sleep: the process
    uses no CPU while idle."""
    with torch_threads(2):
        for _ in range(200):
            probe(0, 64)
        time.sleep(0.05)
        before = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - before < 0.05


def _child(queue: multiprocessing.Queue) -> None:
    torch.set_num_threads(2)
    counts, _, _ = torch.ops.pagedserve._parallel_probe(0, 100, 1, -1)
    queue.put(counts.tolist() == [1] * 100)


def check_a_forked_child_runs_regions() -> None:
    with torch_threads(2):
        probe(0, 100)  # the parent's workers exist
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        raise AssertionError("the forked child hung in a parallel region")
    assert child.exitcode == 0 and queue.get(timeout=5)


def test_regions_on_openmp_where_its_threads_spin() -> None:
    assert os.environ.get("OMP_WAIT_POLICY", "").lower() != "passive"
    assert not on_pool()
    check_every_index_runs_once()
    check_exceptions_reach_the_caller()


def test_regions_on_the_pool_where_openmp_threads_sleep() -> None:
    script = (
        "from tests.engine.ops import test_thread_pool as t\n"
        "assert t.on_pool()\n"
        "t.check_every_index_runs_once()\n"
        "t.check_exceptions_reach_the_caller()\n"
        "t.check_idle_workers_sleep()\n"
        "t.check_a_forked_child_runs_regions()\n"
        "print('pool checks passed')\n"
    )
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pool checks passed" in result.stdout
