"""EngineMonitor: views of the engine for its watchers, taken between steps (pure Python).

Costs nothing while nobody watches: every entry point returns at once without a watcher.
With watchers, a view is taken at most every `min_interval` seconds, and less often when
taking one is slow, so that views never take more than `max_share` of the engine loop's
time. Everything runs on the event loop, between steps: the step itself (in the engine's
worker thread) is the only other code that touches the scheduler, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from engine.introspection.capture import CoreState, delta
from engine.introspection.view import (
    BlockCounts,
    EngineDelta,
    EngineRates,
    EngineSnapshot,
    EngineTotals,
    EngineView,
    FinishedView,
)
from engine.outputs import FinishedRequestStats, IterationStats
from engine.scheduler import SchedulerStats

# A finished request stays on view this many seconds, among the latest FINISHED_KEEP.
FINISHED_TTL = 60.0
FINISHED_KEEP = 100


class Watcher:
    """One viewer's mailbox: the newest view it has not taken yet. A watcher that falls
    behind gets a full snapshot in place of the deltas it missed."""

    def __init__(self) -> None:
        self._item: EngineView | None = None
        self._ready = asyncio.Event()
        self._last_seq = -1

    def offer(self, snapshot: EngineSnapshot, change: EngineDelta | None) -> None:
        in_step = self._item is None and self._last_seq == snapshot.seq - 1
        self._item = change if in_step and change is not None else snapshot
        self._ready.set()

    async def get(self, timeout: float) -> EngineView | None:
        """The next view, or None when none came within `timeout` seconds."""
        if self._item is None:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        item, self._item = self._item, None
        assert item is not None
        self._last_seq = item.seq
        return item


class EngineMonitor:
    def __init__(
        self,
        source: Callable[[], CoreState] | None,
        prefix_caching: bool,
        min_interval: float = 0.5,
        max_share: float = 0.005,
    ) -> None:
        """`source` reads the core's state (core_state); None when the core runs in another
        process, whose state the caller fetches and hands to capture()."""
        self.min_interval = min_interval
        self._source = source
        self._prefix_caching = prefix_caching
        self.max_share = max_share
        self._watchers: list[Watcher] = []
        self._last: EngineSnapshot | None = None
        self._last_taken = 0.0  # monotonic time of the last view
        self._last_cost = 0.0  # seconds the last view took
        self._next_due = 0.0
        self._num_tokens = 0  # tokens scheduled since the last view
        self._finished: deque[FinishedView] = deque(maxlen=FINISHED_KEEP)

    def subscribe(self) -> Watcher:
        """A new watcher; the next chance between steps takes a view for it."""
        if not self._watchers:
            self._last = None  # rates over a time nobody watched would be wrong
            self._num_tokens = 0
            self._finished.clear()
        watcher = Watcher()
        self._watchers.append(watcher)
        self._next_due = 0.0
        return watcher

    @property
    def num_watchers(self) -> int:
        return len(self._watchers)

    def unsubscribe(self, watcher: Watcher) -> None:
        self._watchers.remove(watcher)

    def observe(self, stats: SchedulerStats, iteration: IterationStats) -> None:
        """Counts one step's (or one batch of aborts') stats towards the next view's rates."""
        if not self._watchers:
            return
        self._num_tokens += stats.num_scheduled_tokens
        now = time.time()
        self._finished.extend(_finished_view(f, now) for f in iteration.finished)

    def due(self) -> bool:
        """Whether a watcher waits for a view that is due (safe to ask from any thread)."""
        return bool(self._watchers) and time.monotonic() >= self._next_due

    def capture_if_due(self) -> None:
        """Takes a view for the watchers when one is due. Call it between steps only."""
        if self.due():
            self.capture()

    def capture(self, state: CoreState | None = None, cost: float = 0.0) -> None:
        """Takes a view of `state` (by default, of the source now) for the watchers; `cost`
        is the seconds it took to fetch `state` from elsewhere."""
        start = time.perf_counter() - cost
        if state is None:
            assert self._source is not None, "a monitor without a source captures given states"
            state = self._source()
        snapshot = self._snapshot(state)
        change = None if self._last is None else delta(self._last, snapshot)
        for watcher in self._watchers:
            watcher.offer(snapshot, change)
        self._last = snapshot
        self._last_cost = time.perf_counter() - start
        interval = max(self.min_interval, self._last_cost / self.max_share)
        self._last_taken = time.monotonic()
        self._next_due = self._last_taken + interval

    def _snapshot(self, state: CoreState) -> EngineSnapshot:
        now = time.time()
        while self._finished and self._finished[0].finished_at < now - FINISHED_TTL:
            self._finished.popleft()
        return EngineSnapshot(
            seq=0 if self._last is None else self._last.seq + 1,
            time=now,
            num_blocks=state.num_blocks,
            block_size=state.block_size,
            prefix_caching=self._prefix_caching,
            states=state.states,
            eviction_order=state.eviction_order,
            requests=state.requests,
            finished=tuple(self._finished),
            counts=BlockCounts.of(state.states),
            gauges=state.gauges,
            totals=state.totals,
            rates=self._rates(state.totals),
        )

    def _rates(self, totals: EngineTotals) -> EngineRates | None:
        """Mutates: restarts the token count for the next interval."""
        last = self._last
        num_tokens, self._num_tokens = self._num_tokens, 0
        if last is None:
            return None
        interval = max(time.monotonic() - self._last_taken, 1e-9)
        steps = totals.num_steps - last.totals.num_steps
        queries = totals.prefix_cache_queries - last.totals.prefix_cache_queries
        hits = totals.prefix_cache_hits - last.totals.prefix_cache_hits
        return EngineRates(
            interval=interval,
            steps_per_s=steps / interval,
            tokens_per_step=num_tokens / steps if steps else None,
            prefix_cache_hit_rate=hits / queries if queries else None,
            num_preemptions=totals.num_preemptions - last.totals.num_preemptions,
            view_cost=self._last_cost / interval,
        )


def _finished_view(stats: FinishedRequestStats, now: float) -> FinishedView:
    return FinishedView(
        stats.request_id,
        stats.finish_reason,
        stats.num_prompt_tokens,
        stats.num_cached_tokens,
        stats.num_generation_tokens,
        stats.ttft,
        stats.e2e_latency,
        now,
    )
