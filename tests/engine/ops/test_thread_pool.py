"""The native kernels' thread pool (engine/ops/csrc/thread_pool.cpp, parallel.h): chunks as
at::parallel_for makes them, each index run once whatever the thread count, exceptions
raised in the caller, workers that sleep once idle, and a forked child that starts a pool
of its own."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from engine.ops.loader import native_kernels
from tests.threads import torch_threads

pytestmark = pytest.mark.skipif(not native_kernels().available, reason="no native kernels")


def probe(begin: int, end: int, grain: int = 1, throw_at: int = -1) -> tuple[list[int], int]:
    counts, threads = torch.ops.pagedserve._parallel_probe(begin, end, grain, throw_at)
    return counts.tolist(), threads


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("begin", "end", "grain"), [(0, 1, 1), (0, 7, 1), (5, 1000, 64), (3, 4, 8)]
)
def test_every_index_runs_once(threads: int, begin: int, end: int, grain: int) -> None:
    with torch_threads(threads):
        for _ in range(50):  # back to back: workers awake, and the generations move on
            counts, used = probe(begin, end, grain)
            assert counts == [1] * (end - begin)
            assert 1 <= used <= min(threads, -(-(end - begin) // grain))


def test_nothing_runs_for_an_empty_range() -> None:
    assert probe(4, 4) == ([], 0)


def test_a_tasks_exception_reaches_the_caller_and_the_pool_goes_on() -> None:
    with torch_threads(2):
        for at in (0, 999):  # the caller's chunk, a worker's
            with pytest.raises(RuntimeError, match=f"thrown at {at}"):
                probe(0, 1000, 1, at)
        assert probe(0, 1000)[0] == [1] * 1000


def test_idle_workers_sleep() -> None:
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
    counts, _ = torch.ops.pagedserve._parallel_probe(0, 100, 1, -1)
    queue.put(counts.tolist() == [1] * 100)


def test_a_forked_child_runs_regions_on_a_pool_of_its_own() -> None:
    with torch_threads(2):
        probe(0, 100)  # the parent's workers exist
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in a parallel region")
    assert child.exitcode == 0 and queue.get(timeout=5)
