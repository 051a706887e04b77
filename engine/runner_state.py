"""The model runner's view of its requests, kept in step with the scheduler's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler.output import NewRequestData, SchedulerOutput


@dataclass
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    stop_token_ids: tuple[int, ...]
    token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def sampling_row(self) -> SamplingRow:
        return SamplingRow(
            self.params, self.prompt_token_ids, self.output_token_ids, self.stop_token_ids
        )

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)


@dataclass(frozen=True)
class StepBatch:
    """Host-side inputs of one step, in batch order."""

    request_ids: list[str]
    input_ids: np.ndarray  # (num_tokens,) int64
    num_computed: list[int]
    num_new: list[int]
    block_ids: list[list[int]]
    # Batch rows that sample a token this step (they reached the end of their tokens).
    sample_rows: list[int]
    # Batch rows whose prompt logprobs are wanted this step.
    prompt_logprob_rows: list[int]


class RunnerStates:
    """Mutated only by `update`, `append_sampled` and nothing else."""

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, so: SchedulerOutput) -> StepBatch:
        """Mutates: applies the scheduler's view, then returns this step's batch."""
        for request_id in so.finished_req_ids:
            self.requests.pop(request_id, None)
        request_ids, chunks, computed, new, tables = [], [], [], [], []
        sample_rows, prompt_rows = [], []
        for row, entry in enumerate(so.scheduled):
            if entry.new is not None:
                state = self._create(entry.new)
            else:
                state = self.requests[entry.request_id]
                state.block_ids.extend(entry.new_block_ids)
            start, end = entry.num_computed_tokens, entry.num_computed_tokens + entry.num_new_tokens
            request_ids.append(entry.request_id)
            chunks.append(state.token_ids[start:end])
            computed.append(start)
            new.append(entry.num_new_tokens)
            tables.append(state.block_ids)
            if end == len(state.token_ids):
                sample_rows.append(row)
            if state.params.prompt_logprobs is not None and start < state.num_prompt_tokens - 1:
                prompt_rows.append(row)
        # chain() iterates in C: no Python-level loop per token, even for long prefills.
        input_ids = np.fromiter(chain.from_iterable(chunks), dtype=np.int64, count=sum(new))
        return StepBatch(request_ids, input_ids, computed, new, tables, sample_rows, prompt_rows)

    def _create(self, new: NewRequestData) -> CachedRequestState:
        params = new.sampling_params
        stops = params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
        state = CachedRequestState(
            new.request_id,
            list(new.prompt_token_ids),
            list(new.output_token_ids),
            params,
            list(new.block_ids),
            stops,
        )
        self.requests[new.request_id] = state
        return state

    def append_sampled(self, request_ids: list[str], token_ids: list[int]) -> None:
        """Mutates: records the tokens sampled this step."""
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            self.requests[request_id].append(token_id)
