"""Torch's intra-op thread count for the engine's steps on the CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StepThreads:
    """Runs every step on `max_threads` threads.

    The count is set for the duration of a step, on the thread that runs it, and the
    previous count is restored afterwards: with torch's OpenMP backend the setting belongs
    to the calling thread, so the engine's steps never change how other threads of the
    process (the caller's, the event loop's) run torch ops.

    Small steps used to run on one thread, from a served measurement (single-stream ITL
    23 ms on 2 threads, 19 on 1) taken while the model was loaded on another thread than
    the one stepping it. That left the process two OpenMP pools, more pool threads than
    cores, and libgomp then parks its threads after every parallel region (see
    engine.async_llm.engine_thread). With one pool, two threads made a single-stream decode
    step faster for every weight format measured (docs/benchmarks.md, "Threads").
    """

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max(1, max_threads)

    @contextmanager
    def step(self) -> Iterator[int]:
        """Runs the block on the step's thread count; yields it."""
        wanted = self.max_threads
        previous = torch.get_num_threads()
        if wanted != previous:
            torch.set_num_threads(wanted)
        try:
            yield wanted
        finally:
            if wanted != previous:
                torch.set_num_threads(previous)
