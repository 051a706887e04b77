"""Torch's intra-op thread count for the engine's steps on the CPU."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# Steps of fewer than 2 ** ADAPTIVE_CLASSES tokens (127) choose their thread count by
# measurement; larger ones (a prefill's chunk) run on every thread, where the arithmetic pays
# for them.
ADAPTIVE_CLASSES = 7
# Each count is tried this many times for steps of a size before the faster one is chosen,
WARMUP_STEPS = 3
# unless its first step ran this much slower than the count warmed before it: then one
# step is its warm-up. A 64-token prefill chunk beside 15 decodes took about 40 ms on two
# threads and 57 on one (Q4_1, a 2-core Zen 5 VM): three such steps, each delaying 15
# streams' next token, are 45 of the 3,800 inter-token gaps of issue 40's "16 at once"
# run (1.2%), enough to reach its 99th percentile.
SLOWER = 1.25
# Then one step in this many of a size runs on the other count, to see whether it has
# become the faster (a neighbour took a core, or left): rarely enough that those steps,
# which may be slower, stay out of the 99th percentile of the inter-token latency.
EXPLORE_EVERY = 200
# The weight of a new step time in its count's moving average.
ALPHA = 0.5


@dataclass
class _Estimate:
    seconds: float = 0.0
    samples: int = 0

    def add(self, seconds: float, fresh: bool = False) -> None:
        """Folds in a step's time; `fresh`: it replaces the average (a count tried again
        after EXPLORE_EVERY steps: older times may be of another load)."""
        if fresh or not self.samples:
            self.seconds = seconds
        else:
            self.seconds += ALPHA * (seconds - self.seconds)
        self.samples += 1


class StepThreads:
    """Runs each step on one thread or on `max_threads`, whichever has been the faster
    for steps of its size.

    A parallel region's threads meet at a barrier at its end, and a decode step crosses a
    few hundred. Where the engine's OpenMP threads sleep at a barrier (OMP_WAIT_POLICY=
    PASSIVE, the engine core process's default, so that it degrades gracefully beside busy
    neighbours), each region first wakes them; on a VM whose idle vCPUs halt, a wake
    costs tens of microseconds. Measured on a 2-core Zen 5 VM (docs/benchmarks.md): one
    stream's decode step took 10.4 ms on 2 threads and 4.5 ms on 1 (Q4_1), while 16 streams
    at once were faster on 2 threads (22.8 against 27.0 ms) until a busy neighbour took a
    core (33.9 against 28.8). Machines differ, and so does the load beside them: so for
    steps of up to 127 tokens, in size classes of powers of two, each count's step time is
    measured (forward and sampling) and the faster chosen: the chosen count's average
    follows every step it runs, and one step in EXPLORE_EVERY tries the other, whose time
    then replaces that count's average. A count whose first step is SLOWER than the other's
    warm-up stops its own warm-up there. Larger steps run on every thread.

    The count is set for the duration of a step, on the thread that runs it, and the
    previous count is restored afterwards: with torch's OpenMP backend the setting belongs
    to the calling thread, so the engine's steps never change how other threads of the
    process (the caller's, the event loop's) run torch ops. The model must be loaded on
    the thread that steps it (engine.async_llm.engine_thread): two OpenMP pools in one
    process make libgomp park its threads after every region.
    """

    def __init__(
        self,
        max_threads: int,
        adaptive: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.adaptive = adaptive and self.max_threads > 1
        self.clock = clock
        self._estimates: dict[tuple[int, int], _Estimate] = {}
        self._steps: dict[int, int] = {}
        # The running step: its size class and thread count, the seconds it has run, and
        # whether it tries the count not chosen.
        self._current: tuple[int, int] | None = None
        self._elapsed = 0.0
        self._exploring = False

    @contextmanager
    def step(self, num_tokens: int | None = None) -> Iterator[int]:
        """Runs the block on the step's thread count; yields it. A step's forward passes
        its token count, which starts the step and chooses the count; its sampling passes
        none and runs on the same count, its time added to the step's."""
        if num_tokens is not None:
            self._finish_step()
            self._current = self._choose(num_tokens)
        wanted = self.max_threads if self._current is None else self._current[1]
        previous = torch.get_num_threads()
        if wanted != previous:
            torch.set_num_threads(wanted)
        start = self.clock()
        try:
            yield wanted
        finally:
            self._elapsed += self.clock() - start
            if wanted != previous:
                torch.set_num_threads(previous)

    def chosen(self, num_tokens: int) -> int | None:
        """The count steps of `num_tokens` tokens run on once measured, None before."""
        size = _size_class(num_tokens)
        counts = self._counts(size)
        if not all(self._warm(size, c) for c in counts):
            return None if len(counts) > 1 else counts[0]
        estimates = [self._estimates[size, c] for c in counts]
        return min(zip(estimates, counts, strict=True), key=lambda ec: ec[0].seconds)[1]

    def _warm(self, size: int, count: int) -> bool:
        """Whether `count` has run enough steps of size class `size` to be compared:
        WARMUP_STEPS, or one SLOWER than a count warmed already."""
        estimate = self._estimates.get((size, count), _Estimate())
        if estimate.samples >= WARMUP_STEPS:
            return True
        if not estimate.samples:
            return False
        for other_count in self._counts(size):
            other = self._estimates.get((size, other_count), _Estimate())
            warmed = other_count != count and other.samples >= WARMUP_STEPS
            if warmed and estimate.seconds > SLOWER * other.seconds:
                return True
        return False

    def _counts(self, size: int) -> tuple[int, ...]:
        """The thread counts steps of size class `size` choose from."""
        if not self.adaptive or size > ADAPTIVE_CLASSES:
            return (self.max_threads,)
        return (self.max_threads, 1)

    def _choose(self, num_tokens: int) -> tuple[int, int]:
        size = _size_class(num_tokens)
        counts = self._counts(size)
        for count in counts:  # every thread first, as without measurements
            if not self._warm(size, count):
                return size, count
        best = self.chosen(num_tokens)
        assert best is not None
        self._steps[size] = self._steps.get(size, 0) + 1
        self._exploring = self._steps[size] % EXPLORE_EVERY == 0
        if self._exploring:
            return size, next(c for c in counts if c != best)
        return size, best

    def _finish_step(self) -> None:
        if self._current is not None and len(self._counts(self._current[0])) > 1:
            estimate = self._estimates.setdefault(self._current, _Estimate())
            estimate.add(self._elapsed, fresh=self._exploring)
        self._current, self._elapsed, self._exploring = None, 0.0, False


def _size_class(num_tokens: int) -> int:
    """1 for one token, 2 for 2-3, 3 for 4-7, ... (at least 1)."""
    return max(1, num_tokens).bit_length()
