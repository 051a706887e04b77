"""What the engine hands its callers: per-request outputs and per-step statistics (pure Python).

`RequestOutput` is one prompt's result with its `n` choices (`CompletionOutput`). How much of
it each yield carries is the request's `output_kind`: only what is new (DELTA), everything
so far (CUMULATIVE), or one final output (FINAL_ONLY).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprobs:
    """Logprob of the chosen token, its rank, and the top alternatives (token, logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    """One choice. In DELTA outputs, `text`, `token_ids` and `logprobs` are what is new."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # None when the request asked for no logprobs.
    logprobs: list[Logprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    """One prompt's choices. `outputs` holds, in DELTA mode, only the choices that changed."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens served from the prefix cache (the first choice's; the rest share it).
    num_cached_tokens: int = 0
    # Logprobs of prompt tokens 1..P-1, when asked for; in DELTA mode sent once, with the
    # first output that carries a token.
    prompt_logprobs: list[Logprobs] | None = None
    prompt: str | None = None
    # An embedding request's result (its one choice then ends "stop" with no tokens).
    embedding: list[float] | None = None

    def merge(self, later: RequestOutput) -> None:
        """Folds a later DELTA output of the same request into this one."""
        by_index = {c.index: c for c in self.outputs}
        for new in later.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                by_index[new.index] = new
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs


@dataclass(frozen=True)
class FinishedRequestStats:
    """One engine request (one choice) at its end, for metrics and the request log."""

    request_id: str
    finish_reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    ttft: float | None
    # False for the 2nd..nth choice of a prompt: prompt tokens are counted once per prompt.
    first_of_prompt: bool
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass
class IterationStats:
    """Latencies observed while processing one step's outputs (or aborts between steps)."""

    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
