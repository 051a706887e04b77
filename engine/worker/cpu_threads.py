"""Torch's intra-op thread count per step on the CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# A step below both limits is mostly per-op overhead: splitting each small op across cores
# adds a barrier per op and loses more than it gains. Attention over long contexts is
# real work, hence the second limit.
SMALL_STEP_TOKENS = 16
SMALL_STEP_KV_TOKENS = 2048


class StepThreads:
    """One thread for small steps (a few short decodes), `max_threads` for the rest.

    The count is set for the duration of a step, on the thread that runs it, and the
    previous count is restored afterwards: with torch's OpenMP backend the setting belongs
    to the calling thread, so the engine's steps never change how other threads of the
    process (the caller's, the event loop's) run torch ops.
    """

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max(1, max_threads)

    def for_step(self, num_tokens: int, num_kv_tokens: int) -> int:
        """Threads for a step of `num_tokens` new tokens attending over `num_kv_tokens`."""
        small = num_tokens < SMALL_STEP_TOKENS and num_kv_tokens < SMALL_STEP_KV_TOKENS
        return 1 if small else self.max_threads

    @contextmanager
    def step(self, num_tokens: int, num_kv_tokens: int) -> Iterator[int]:
        """Runs the block with this step's thread count; yields it."""
        wanted = self.for_step(num_tokens, num_kv_tokens)
        previous = torch.get_num_threads()
        if wanted != previous:
            torch.set_num_threads(wanted)
        try:
            yield wanted
        finally:
            if wanted != previous:
                torch.set_num_threads(previous)
