"""What a viewer of the engine sees: plain, frozen data, ids and counts only (pure Python).

Never text: prompts and completions may be private, so a view carries request ids, token
counts and block ids, nothing a tokenizer could turn back into words.

A watcher first receives an EngineSnapshot, then EngineDeltas, each against the item it
received just before. Applying a delta: overwrite `states` at every (start, codes) run,
replace the eviction order when it is given, take `requests`, `counts`, `gauges`, `totals`
and `rates` as they are, and append `finished`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BlockState(enum.Enum):
    """What one KV block holds. The value is the block's character in a view's `states`."""

    NEVER_USED = "0"  # free, never allocated since the engine started
    FREE = "1"  # free, holds nothing reusable (a partial block, a duplicate, or caching off)
    CACHED = "2"  # free, but holds a cached full block of some prefix until it is evicted
    IN_USE = "3"  # held by one request
    SHARED = "4"  # held by several requests (ref_cnt > 1): a shared prefix


@dataclass(frozen=True)
class BlockCounts:
    """How many blocks are in each BlockState."""

    never_used: int
    free: int
    cached: int
    in_use: int
    shared: int

    @classmethod
    def of(cls, states: str) -> BlockCounts:
        return cls(*(states.count(state.value) for state in BlockState))


@dataclass(frozen=True)
class RequestView:
    """A running or waiting engine request (one choice of a prompt)."""

    request_id: str
    status: str  # "running", "waiting" or "preempted" (waiting to resume)
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is in the cache
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache at admission
    num_preemptions: int
    block_ids: tuple[int, ...]  # its block table, in order


@dataclass(frozen=True)
class FinishedView:
    """An engine request that ended, kept on view for a short while."""

    request_id: str
    finish_reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    ttft: float | None  # seconds; None when it ended before its first token
    e2e_latency: float  # seconds
    finished_at: float  # wall-clock seconds since the epoch


@dataclass(frozen=True)
class EngineGauges:
    """The values /metrics exports under the same names, at the moment of the view."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # share of blocks with ref_cnt > 0, as vllm:kv_cache_usage_perc


@dataclass(frozen=True)
class EngineTotals:
    """Counters since the engine started (prefix-cache figures in prompt tokens)."""

    num_steps: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


@dataclass(frozen=True)
class EngineRates:
    """Activity over the `interval` seconds since the previous view."""

    interval: float
    steps_per_s: float
    tokens_per_step: float | None  # None when no step ran
    prefix_cache_hit_rate: float | None  # hits / queries; None when nothing was looked up
    num_preemptions: int
    # Share of the interval spent taking views: what watching costs the engine loop.
    view_cost: float


@dataclass(frozen=True)
class EngineSnapshot:
    """The whole view. `states[i]` is block i's BlockState value."""

    seq: int  # increases by one per view taken
    time: float  # wall-clock seconds since the epoch
    num_blocks: int
    block_size: int
    prefix_caching: bool
    states: str
    # Free blocks that hold a cached prefix, next evicted first, each with its position in
    # the whole free queue: it is reused after that many other blocks are handed out.
    eviction_order: tuple[tuple[int, int], ...]
    requests: tuple[RequestView, ...]  # running in batch order, then waiting in queue order
    finished: tuple[FinishedView, ...]  # the latest FINISHED_KEEP of the last FINISHED_TTL s
    counts: BlockCounts
    gauges: EngineGauges
    totals: EngineTotals
    rates: EngineRates | None  # None for the first view taken


@dataclass(frozen=True)
class EngineDelta:
    """What changed since the view with sequence number `seq - 1`."""

    seq: int
    time: float
    # (first block id, the new states from there): runs that cover every changed block.
    blocks: tuple[tuple[int, str], ...]
    eviction_order: tuple[tuple[int, int], ...] | None  # None: unchanged
    requests: tuple[RequestView, ...]
    finished: tuple[FinishedView, ...]  # only those that ended since the previous view
    counts: BlockCounts
    gauges: EngineGauges
    totals: EngineTotals
    rates: EngineRates | None


EngineView = EngineSnapshot | EngineDelta
