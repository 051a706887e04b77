"""The single home of per-request scheduling state (pure Python)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.errors import RequestValidationError
from engine.kv_cache.block import BlockHash
from engine.lora.request import LoRARequest
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from engine.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Queued, but its grammar is still compiling: the scheduler passes over it.
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish reason: "stop", "length" or "abort"; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """A prompt and what has been generated for it so far.

    There are no prefill or decode phases: each step moves `num_computed_tokens` (tokens
    whose KV is in the cache once the scheduled steps have run) towards `num_tokens` plus
    `num_output_placeholders`. `block_hashes` holds the chained hash of every full block of
    `all_token_ids`, extended by the KV cache manager. `structured` carries the grammar
    state of a constrained request.

    A request with `pooling_params` (an embedding engine's) is prefill-only: it samples
    nothing and ends once its prompt is computed, with its embedding; its sampling_params
    (EMBEDDING_PARAMS) only tell the frontend to report it once, at its end.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Tokens sampled in a step that is still running, their ids not yet known: with async
    # scheduling the next step is scheduled before the last one's tokens come back.
    num_output_placeholders: int = 0
    # Speculative decoding: the proposer's drafts of the next tokens, verified next step.
    spec_token_ids: list[int] = field(default_factory=list)
    # Tokens served from the prefix cache when the request was first scheduled (-1: not yet).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    stop_reason: int | None = None
    # Highest prompt index whose logprob has been sent (survives preemption).
    num_prompt_logprobs_sent: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Set by the engine core when the request has an output constraint.
    structured: StructuredOutputRequest | None = None
    pooling_params: PoolingParams | None = None
    # The LoRA adapter the request runs with; None: the base model.
    lora: LoRARequest | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """The tokens known plus those a running step is sampling."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


def check_prompt_length(num_tokens: int, max_model_len: int, pooling: bool) -> None:
    """Raises RequestValidationError for a prompt that could never run: a generation needs
    room for one token after its prompt, an embedding's prompt may fill max_model_len."""
    if pooling and num_tokens > max_model_len:
        raise RequestValidationError(
            f"the input has {num_tokens} tokens; max_model_len is {max_model_len}", "input"
        )
    if not pooling and num_tokens >= max_model_len:
        raise RequestValidationError(
            f"the prompt has {num_tokens} tokens; max_model_len is {max_model_len}, which "
            "leaves no room to generate",
            "prompt",
        )
