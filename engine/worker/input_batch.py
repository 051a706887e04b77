"""The model runner's requests and the host-side inputs of one step.

The runner keeps, per running request, the Request itself (shared with the scheduler, which
appends sampled tokens to it after each step) and its block table. Each step's
SchedulerOutput updates them; `InputBatch.update` returns the step's flat batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from engine.request import Request
from engine.scheduler.output import SchedulerOutput
from engine.worker.sampler import SamplingRow


@dataclass
class CachedRequestState:
    request: Request
    block_ids: list[int]
    # EOS (unless ignore_eos) plus the request's stop_token_ids: masked below min_tokens.
    stop_token_ids: tuple[int, ...]
    # A hybrid model's other KV cache groups' tables (engine/kv_cache/groups.py).
    group_block_ids: list[list[int]]

    def sampling_row(self) -> SamplingRow:
        r = self.request
        return SamplingRow(
            r.sampling_params, r.prompt_token_ids, r.output_token_ids, self.stop_token_ids
        )


@dataclass(frozen=True)
class StepBatch:
    """Host-side inputs of one step, in batch order."""

    requests: list[CachedRequestState]
    input_ids: np.ndarray  # (num_tokens,) int64
    num_computed: list[int]
    num_new: list[int]
    # Batch rows that sample a token this step (they reached the end of their tokens); an
    # embedding engine pools them instead.
    sample_rows: list[int]
    # Batch rows whose prompt logprobs are wanted this step.
    prompt_logprob_rows: list[int]
    # (position in input_ids, request id) of each input token the host does not know yet:
    # with async scheduling, the one the step before is still sampling for the request.
    placeholders: list[tuple[int, str]]
    # Per row, the draft tokens it verifies (speculative decoding): its last num_drafts + 1
    # positions each sample a token.
    num_drafts: list[int]

    @property
    def block_ids(self) -> list[list[int]]:
        return [state.block_ids for state in self.requests]

    def group_block_ids(self, group: int) -> list[list[int]]:
        """The requests' tables in KV cache group `group` (1 on: 0's are `block_ids`)."""
        return [state.group_block_ids[group - 1] for state in self.requests]


class InputBatch:
    """The runner's requests by id; changed only by `update`."""

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, scheduler_output: SchedulerOutput) -> StepBatch:
        """Applies the scheduler's decisions, then returns this step's batch."""
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
        states, chunks, computed, new = [], [], [], []
        sample_rows, prompt_rows = [], []
        placeholders: list[tuple[int, str]] = []
        num_drafts: list[int] = []
        offset = 0
        for row, entry in enumerate(scheduler_output.scheduled):
            if entry.new_table:
                state = self._create(entry.request, entry.block_ids, entry.group_block_ids)
            else:
                state = self.requests[entry.request_id]
                state.block_ids.extend(entry.block_ids)
                for table, ids in zip(state.group_block_ids, entry.group_block_ids, strict=False):
                    table.extend(ids)
            request = state.request
            start, end = entry.num_computed_tokens, entry.num_computed_tokens + entry.num_new_tokens
            states.append(state)
            drafts = entry.spec_token_ids
            chunk = request.all_token_ids[start : end - len(drafts)]
            if end - len(drafts) > request.num_tokens:  # the last token is being sampled
                placeholders.append((offset + len(chunk), request.request_id))
                chunk = [*chunk, 0]
            chunks.append([*chunk, *drafts] if drafts else chunk)
            num_drafts.append(len(drafts))
            computed.append(start)
            new.append(entry.num_new_tokens)
            offset += entry.num_new_tokens
            if end >= request.num_tokens:
                sample_rows.append(row)
            wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
            if wants_prompt_logprobs and start < request.num_prompt_tokens - 1:
                prompt_rows.append(row)
        # chain() iterates in C: no Python-level loop per token, even for long prefills.
        input_ids = np.fromiter(chain.from_iterable(chunks), dtype=np.int64, count=offset)
        return StepBatch(
            states, input_ids, computed, new, sample_rows, prompt_rows, placeholders, num_drafts
        )

    def _create(
        self, request: Request, block_ids: list[int], group_block_ids: tuple[list[int], ...]
    ) -> CachedRequestState:
        params = request.sampling_params
        stops = params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
        groups = [list(ids) for ids in group_block_ids]
        state = CachedRequestState(request, list(block_ids), stops, groups)
        self.requests[request.request_id] = state
        return state
