"""Reading a view out of the scheduler and the block pool, and diffing two views (pure Python).

Read-only: nothing here changes engine state. Called between steps only, when nothing else
touches the scheduler, so no lock is taken.

Block states come from each block's ref_cnt and hash, in one pass over the blocks that were
ever allocated; the rest are known to be NEVER_USED (see BlockPool.num_ever_used). The
eviction order walks the free queue from its back and stops at the never-used blocks at its
front:

    free queue:  front [ 7  8  9 | 3  0  5 ] back      num_ever_used = 7
                         never used   used, freed      3 and 5 cached, 0 partial
    eviction_order = ((3, 3), (5, 5)): block 3 is reused after 3 other blocks are handed out
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

from engine.introspection.view import (
    BlockState,
    EngineDelta,
    EngineGauges,
    EngineSnapshot,
    EngineTotals,
    RequestView,
)
from engine.kv_cache import BlockPool, KVCacheBlock
from engine.request import Request
from engine.scheduler import Scheduler

_FREE, _CACHED, _IN_USE, _SHARED = (
    BlockState.FREE.value,
    BlockState.CACHED.value,
    BlockState.IN_USE.value,
    BlockState.SHARED.value,
)
# Delta runs are whole chunks of this many blocks: comparing slices runs at C speed, so a
# diff costs microseconds even for a pool of a hundred thousand blocks.
RUN = 64


@dataclass(frozen=True)
class CoreState:
    """What a view reads out of the engine core, between steps. With the core in a process
    of its own, this is what crosses to the frontend, which adds the finished requests and
    the rates."""

    num_blocks: int
    block_size: int
    states: str
    eviction_order: tuple[tuple[int, int], ...]
    requests: tuple[RequestView, ...]
    gauges: EngineGauges
    totals: EngineTotals


def core_state(scheduler: Scheduler, num_steps: int) -> CoreState:
    kv = scheduler.kv_cache
    return CoreState(
        kv.num_blocks,
        kv.block_size,
        block_states(kv.pool),
        eviction_order(kv.pool),
        request_views(scheduler),
        EngineGauges(len(scheduler.running), len(scheduler.waiting), kv.usage()),
        EngineTotals(num_steps, kv.counters.queries, kv.counters.hits, scheduler.total_preemptions),
    )


def block_states(pool: BlockPool) -> str:
    """One BlockState value per block, by block id."""
    used = pool.num_ever_used
    states = "".join(
        [
            (_IN_USE if b.ref_cnt == 1 else _SHARED)
            if b.ref_cnt
            else (_FREE if b.block_hash is None else _CACHED)
            for b in pool.blocks[:used]
        ]
    )
    return states + BlockState.NEVER_USED.value * (pool.num_blocks - used)


def eviction_order(pool: BlockPool) -> tuple[tuple[int, int], ...]:
    """(block id, position in the free queue) of each free cached block, front first."""
    order = []
    position = pool.num_free_blocks
    for block in reversed(pool.free_queue):
        position -= 1
        if block.block_id >= pool.num_ever_used:
            break  # the never-used blocks lead the queue: no cached block is ahead
        if block.block_hash is not None:
            order.append((block.block_id, position))
    order.reverse()
    return tuple(order)


def request_views(scheduler: Scheduler) -> tuple[RequestView, ...]:
    tables = scheduler.kv_cache.req_to_blocks
    return tuple(
        _request_view(request, tables.get(request.request_id, ()))
        for request in chain(scheduler.running, scheduler.waiting)
    )


def _request_view(request: Request, blocks: Iterable[KVCacheBlock]) -> RequestView:
    return RequestView(
        request.request_id,
        request.status.value,
        request.num_prompt_tokens,
        request.num_computed_tokens,
        request.num_output_tokens,
        max(request.num_cached_tokens, 0),
        request.num_preemptions,
        tuple(block.block_id for block in blocks),
    )


def changed_runs(old: str, new: str) -> tuple[tuple[int, str], ...]:
    """(start, new[start:end]) runs, in RUN-block chunks, covering every i where old[i] differs."""
    runs: list[tuple[int, str]] = []
    for start in range(0, len(new), RUN):
        chunk = new[start : start + RUN]
        if chunk == old[start : start + RUN]:
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + chunk)
        else:
            runs.append((start, chunk))
    return tuple(runs)


def delta(old: EngineSnapshot, new: EngineSnapshot) -> EngineDelta:
    """What a watcher holding `old` needs to arrive at `new`; `new.finished` minus the
    requests `old` already listed stand for the ones that ended in between."""
    known = {f.request_id for f in old.finished}
    return EngineDelta(
        seq=new.seq,
        time=new.time,
        blocks=changed_runs(old.states, new.states),
        eviction_order=None if new.eviction_order == old.eviction_order else new.eviction_order,
        requests=new.requests,
        finished=tuple(f for f in new.finished if f.request_id not in known),
        counts=new.counts,
        gauges=new.gauges,
        totals=new.totals,
        rates=new.rates,
    )
