"""Typed messages between the scheduler, the model runner and the engine (pure Python).

Everything runs in one process, so a scheduled entry carries the Request itself rather than
copies of its token lists: the runner reads the tokens it needs from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import Logprobs
from engine.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int
    # Tokens whose KV is already in the cache before this step.
    num_computed_tokens: int
    # Blocks appended to the request's table this step; for a `new_table` entry (first
    # scheduled, or resumed after preemption) the request's whole table, replacing any old one.
    block_ids: list[int]
    new_table: bool = False
    # Speculative decoding: draft tokens scheduled after the request's known tokens.
    spec_token_ids: tuple[int, ...] = ()
    # A hybrid model's KV cache groups after the first (engine/kv_cache/groups.py): each
    # group's block ids, as `block_ids` are group 0's. Empty for a one-group model, and
    # where no group got a block this step.
    group_block_ids: tuple[list[int], ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def resumed(self) -> bool:
        return self.new_table and self.request.num_preemptions > 0


@dataclass(frozen=True)
class SchedulerOutput:
    """What to run in one step. `scheduled` is in batch order: running first, then admitted."""

    scheduled: list[ScheduledRequest]
    # Requests finished, aborted or preempted since the last step: the runner drops them.
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled tokens (or, in an embedding engine, embeddings) of the requests that reached
    the end of their known tokens."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # Per request, for the prompt positions computed this step (position 0 has none).
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # An embedding engine's: each request that finished its prefill, its embedding.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding: the drafts accepted, which precede the sampled token, and,
    # where logprobs were asked for, one entry per accepted draft and sampled token (such a
    # request has none in `logprobs`).
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # A draft model's proposals for each request's next step, drafted after this step's
    # tokens (spec_decode/draft_model.py cuts them to what the request can use).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCoreOutput:
    """New tokens for one request from one step, plus its finish reason once it ends."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    new_logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Seconds between arrival and first scheduling; set on the request's first output.
    queue_time: float | None = None
    # A prefill-only request's embedding, on its one (finishing) output.
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    """Gauges after a step and counters for the step itself."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    # Tokens the waiting requests have yet to compute (each recomputes from scratch).
    num_waiting_tokens: int = 0
    num_scheduled_tokens: int = 0
    # Deltas over this step.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Speculative decoding, over this step: requests verifying drafts, drafts verified,
    # drafts accepted, and accepted drafts by position (index 0: the first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA adapters of the running and the waiting requests, by name (no repeats), as
    # vllm:lora_requests_info reports them.
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    # The most prompt tokens the next step may carry if it decodes (0: no cap but the
    # budget): --prefill-time-beside-decodes' worth by the steps' times, once known.
    prefill_tokens_beside_decodes: int = 0


@dataclass(frozen=True)
class StepResult:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
