"""The V1 scheduler: one token-budget loop per step, no prefill/decode phases (pure Python)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheBlock, KVCacheManager, other_group_ids
from engine.outputs import Logprobs
from engine.request import Request, RequestStatus, check_prompt_length
from engine.scheduler.output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    StepResult,
)
from engine.scheduler.prefill_slots import PrefillSlots, decodes_first, is_prefilling
from engine.scheduler.step_cost import StepCost

# The states whose requests take a step's output: preempted ones too, since with async
# scheduling a request may be preempted while a step that samples for it is still running.
_TAKES_OUTPUT = (RequestStatus.RUNNING, RequestStatus.PREEMPTED)


class Scheduler:
    """Decides which requests run in each step and how many tokens each gets.

    `schedule()` and `update_from_output()` alternate; `add_request()` and
    `finish_requests()` are called between steps. Nothing here touches tensors.
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        needed = kv_cache.blocks_for_one_request(
            config.max_model_len, config.max_num_batched_tokens
        )
        if kv_cache.num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {kv_cache.num_blocks * kv_cache.block_size} tokens, "
                f"fewer than max_model_len={config.max_model_len}: one request could never fit"
            )
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()
        self._num_preemptions = 0
        self.total_preemptions = 0
        self._last_queries = 0
        self._last_hits = 0
        self._failed: list[EngineCoreOutput] = []
        # Speculative decoding since the last stats(): [requests with drafts, drafts,
        # accepted drafts], and accepted drafts by position.
        self._spec_counts = [0, 0, 0]
        self._spec_accepted_per_pos: list[int] = []
        # What a step's decodes and prompt tokens take (--prefill-time-beside-decodes), and
        # the last step's decoding requests and prompt tokens, for observe_step_time.
        self.step_cost = StepCost()
        self._last_mix = (0, 0)

    # ---- between steps -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a new request (FCFS). Raises RequestValidationError for one that could
        never run, ValueError for a duplicate id."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        pooling = request.pooling_params is not None
        check_prompt_length(request.num_tokens, self.config.max_model_len, pooling)
        if request.structured is not None and not request.structured.ready():
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """Ends the given requests (unknown ids are ignored) and frees their blocks."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks this step's requests, allocating blocks and preempting if needed: running
        decodes first, then running prefills, then admissions from `waiting`, each prefill
        within the partial-prefill limits (PrefillSlots)."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        slots = PrefillSlots(self.config, self.prefill_tokens_beside_decodes())
        budget, preempted = self._schedule_running(budget, scheduled, slots)
        if not preempted:
            self._schedule_waiting(budget, scheduled, slots)
        finished, self._finished_ids = self._finished_ids, set()
        self._last_mix = (slots.num_decodes, slots.num_prompt_tokens)
        return SchedulerOutput(scheduled, finished)

    def prefill_tokens_beside_decodes(self) -> int:
        """The next step's cap on prompt tokens, all prefills together, if it decodes (0:
        none). With --prefill-time-beside-decodes R, once the steps' times are known: the
        tokens that take R times a step of the running decodes alone (at least
        step_cost.MIN_TOKENS); else the cap in tokens."""
        ratio = self.config.prefill_time_beside_decodes
        fallback = self.config.prefill_chunk_beside_decodes
        if not ratio:
            return fallback
        decodes = sum(1 for r in self.running if not is_prefilling(r))
        decode_ms = self.step_cost.decode_ms(decodes) if decodes else None
        tokens = None if decode_ms is None else self.step_cost.tokens_within(ratio * decode_ms)
        return fallback if tokens is None else tokens

    @property
    def last_step_mix(self) -> tuple[int, int]:
        """The last scheduled step's decoding requests and prompt tokens."""
        return self._last_mix

    def observe_step_time(self, seconds: float) -> None:
        """The time the last scheduled step took to run (the model runner's execute),
        which teaches --prefill-time-beside-decodes what decodes and prompt tokens cost."""
        self.step_cost.observe(*self._last_mix, seconds)

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledRequest], slots: PrefillSlots
    ) -> tuple[int, bool]:
        """Schedules the running requests, decodes before prefills, so that a prefill chunk
        never takes the budget a decode needs. Returns the budget left and whether a request
        was preempted."""
        preempted = False
        done: set[str] = set()  # the ids scheduled so far this step
        for request in decodes_first(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if self._ends_with_placeholders(request):
                continue
            ahead = request.num_tokens_with_placeholders + len(request.spec_token_ids)
            remaining = ahead - request.num_computed_tokens
            prefilling = is_prefilling(request)
            num_new = slots.chunk(remaining, budget) if prefilling else min(remaining, budget)
            if num_new == 0:
                continue
            new_blocks, preempted_any = self._allocate_or_preempt(request, num_new, done)
            preempted |= preempted_any
            if new_blocks is None:
                continue
            if prefilling:
                slots.take(remaining, num_new)
            else:
                slots.decode()
            block_ids = [b.block_id for b in new_blocks]
            groups = other_group_ids(new_blocks)
            scheduled.append(self._scheduled(request, num_new, block_ids, group_block_ids=groups))
            done.add(request.request_id)
            budget -= num_new
        return budget, preempted

    def _allocate_or_preempt(
        self, request: Request, num_new: int, done: set[str]
    ) -> tuple[list[KVCacheBlock] | None, bool]:
        """Allocates `num_new` slots for a running request (and a draft model's lookahead
        slots), preempting the last running request not scheduled this step (`done`) until
        they fit or the victim is `request` itself. Returns the new blocks (None when
        `request` was preempted) and whether any request was preempted."""
        lookahead = self._lookahead(request, request.num_computed_tokens + num_new)
        new_blocks = self.kv_cache.allocate_slots(request, num_new, None, lookahead)
        preempted = False
        while new_blocks is None:
            index = next(
                i
                for i in range(len(self.running) - 1, -1, -1)
                if self.running[i].request_id not in done
            )
            victim = self.running.pop(index)
            self._preempt(victim)
            preempted = True
            if victim is request:
                return None, True
            new_blocks = self.kv_cache.allocate_slots(request, num_new, None, lookahead)
        return new_blocks, preempted

    def _schedule_waiting(
        self, budget: int, scheduled: list[ScheduledRequest], slots: PrefillSlots
    ) -> None:
        """Admits from `waiting`, first come first served, while budget and seats last.
        Requests whose grammar is still compiling step aside and keep their place; so do
        those whose LoRA adapter would exceed --max-loras running at once, and those whose
        prefill would be partial when the partial-prefill slots are taken."""
        skipped: deque[Request] = deque()
        max_loras = self.config.max_loras
        loras = self._running_loras() if max_loras else set()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            head = self.waiting[0]
            if head.status is RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(head):
                self.waiting.popleft()
                if not head.is_finished:
                    skipped.append(head)
                continue
            lora = head.lora
            if lora is not None and lora.lora_int_id not in loras and len(loras) >= max_loras:
                skipped.append(self.waiting.popleft())
                continue
            hits, num_hit = self.kv_cache.get_computed_blocks(head)
            remaining = head.num_tokens - num_hit
            num_new = slots.chunk(remaining, budget)
            if num_new == 0:
                skipped.append(self.waiting.popleft())
                continue
            entry = self._admit(head, hits, num_hit, num_new)
            if entry is None:
                break
            slots.take(remaining, num_new)
            if lora is not None:
                loras.add(lora.lora_int_id)
            scheduled.append(entry)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _lookahead(self, request: Request, end: int) -> int:
        """The KV slots a draft model needs after `request`'s scheduled tokens, which end
        at `end`: its drafts follow the token this step samples, so only a step that reaches
        the end of the request's tokens needs them; none past the model's length."""
        lookahead = self.config.num_lookahead_tokens
        if not lookahead or end < request.num_tokens_with_placeholders:
            return 0
        return max(0, min(lookahead, self.config.max_model_len - end))

    def _running_loras(self) -> set[int]:
        return {r.lora.lora_int_id for r in self.running if r.lora is not None}

    @staticmethod
    def _scheduled(
        request: Request,
        num_new: int,
        block_ids: list[int],
        new_table: bool = False,
        group_block_ids: tuple[list[int], ...] = (),
    ) -> ScheduledRequest:
        """The step's entry for `request`, with the drafts that fit (speculative decoding);
        advances its computed tokens, and counts the token it samples (it reaches the end
        of its tokens) as a placeholder until the step's output comes back."""
        end = request.num_tokens_with_placeholders
        num_drafts = max(0, request.num_computed_tokens + num_new - end)
        drafts = tuple(request.spec_token_ids[:num_drafts])
        request.spec_token_ids = []
        entry = ScheduledRequest(
            request,
            num_new,
            request.num_computed_tokens,
            block_ids,
            new_table,
            drafts,
            group_block_ids,
        )
        request.num_computed_tokens += num_new
        if request.num_computed_tokens >= end and request.pooling_params is None:
            request.num_output_placeholders += 1
        return entry

    def _ends_with_placeholders(self, request: Request) -> bool:
        """Whether the token a running step samples for `request` is its last by length
        (max_tokens or max_model_len): then nothing more is scheduled for it. Only async
        scheduling meets placeholders here."""
        if not request.num_output_placeholders:
            return False
        max_tokens = request.sampling_params.max_tokens
        outputs = request.num_output_tokens + request.num_output_placeholders
        if max_tokens is not None and outputs >= max_tokens:
            return True
        return request.num_tokens_with_placeholders >= self.config.max_model_len

    def _grammar_ready(self, request: Request) -> bool:
        """False while the request's grammar compiles. One that failed to compile ends the
        request as aborted (the gateway compiles before it submits, so only a direct engine
        caller meets this); its output goes out with the step's."""
        assert request.structured is not None
        if not request.structured.ready():
            return False
        if request.structured.error is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._failed.append(EngineCoreOutput(request.request_id, [], finish_reason="abort"))
            return False
        request.status = RequestStatus.WAITING
        return True

    def _admit(
        self, request: Request, hits: list[KVCacheBlock], num_hit: int, num_new: int
    ) -> ScheduledRequest | None:
        """Moves the head of `waiting` to `running` if `num_new` tokens after its prefix-cache
        hit (`hits`, covering `num_hit` tokens) fit."""
        lookahead = self._lookahead(request, num_hit + num_new)
        if self.kv_cache.allocate_slots(request, num_new, hits, lookahead) is None:
            return None
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)
        block_ids = self.kv_cache.block_ids(request.request_id)
        groups = self.kv_cache.other_group_block_ids(request.request_id)
        return self._scheduled(request, num_new, block_ids, True, groups)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: frees the victim's blocks; it resumes first."""
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.spec_token_ids = []
        self._num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.appendleft(request)
        self._finished_ids.add(request.request_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> StepResult:
        """Applies a step's sampled tokens and the stop conditions. With async scheduling
        the next step has been scheduled already: a request preempted by it still gets the
        token this step sampled for it, and one that ends here wastes its next step's row."""
        outputs, self._failed = self._failed, []
        preempted_ended = False
        for entry in scheduler_output.scheduled:
            request = self.requests.get(entry.request_id)
            if request is None or request.status not in _TAKES_OUTPUT:
                continue
            was_preempted = request.status is RequestStatus.PREEMPTED
            if entry.request_id in runner_output.sampled_token_ids:
                request.num_output_placeholders -= 1
            if entry.spec_token_ids:
                self._count_drafts(request, entry, runner_output)
            output = self._apply_output(request, entry.num_computed_tokens, runner_output)
            if output is not None:
                outputs.append(output)
            preempted_ended |= was_preempted and request.is_finished
        if any(r.is_finished for r in self.running):
            self.running = [r for r in self.running if not r.is_finished]
        if preempted_ended:  # async scheduling only: the waiting queue is left alone else
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
        return StepResult(outputs, self.stats(scheduler_output.total_num_scheduled_tokens))

    def _count_drafts(
        self, request: Request, entry: ScheduledRequest, runner_output: ModelRunnerOutput
    ) -> None:
        """Rolls the request's computed tokens back over its rejected drafts (their KV
        slots are written again later), and counts the drafts for the metrics."""
        accepted = len(runner_output.accepted_draft_ids.get(request.request_id, ()))
        drafted = len(entry.spec_token_ids)
        request.num_computed_tokens -= drafted - accepted
        counts = self._spec_counts
        counts[0] += 1
        counts[1] += drafted
        counts[2] += accepted
        per_pos = self._spec_accepted_per_pos
        per_pos.extend([0] * (accepted - len(per_pos)))
        for i in range(accepted):
            per_pos[i] += 1

    def _apply_output(
        self, request: Request, start: int, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        request_id = request.request_id
        prompt_logprobs = self._new_prompt_logprobs(request, start, runner_output)
        embedding = runner_output.pooled.get(request_id)
        if embedding is not None:
            return self._finish_pooled(request, embedding)
        token = runner_output.sampled_token_ids.get(request_id)
        if token is None:
            if not prompt_logprobs:
                return None
            return EngineCoreOutput(request_id, [], prompt_logprobs=prompt_logprobs)
        # Accepted drafts first (speculative decoding), up to the first that ends it.
        tokens = [*runner_output.accepted_draft_ids.get(request_id, ()), token]
        first = request.num_output_tokens == 0
        new_tokens = []
        status: RequestStatus | None = None
        for token in tokens:
            request.append_output_token(token)
            new_tokens.append(token)
            # A complete grammar allows nothing more: the request ends as a normal stop.
            if request.structured is not None and request.structured.advance(token):
                status = RequestStatus.FINISHED_STOPPED
            else:
                status = self._stop_status(request, token)
            if status is not None:
                break
        if status is not None:
            self._finish(request, status)
        logprobs = runner_output.logprobs.get(request_id)
        new_logprobs = runner_output.spec_logprobs.get(request_id) or (
            [logprobs] if logprobs is not None else []
        )
        return EngineCoreOutput(
            request_id,
            new_tokens,
            finish_reason=status.finish_reason if status else None,
            stop_reason=request.stop_reason,
            new_logprobs=new_logprobs[: len(new_tokens)],
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            queue_time=self._queue_time(request) if first else None,
        )

    def _finish_pooled(self, request: Request, embedding: list[float]) -> EngineCoreOutput:
        """A prefill-only request ends with its embedding, as a normal stop."""
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return EngineCoreOutput(
            request.request_id,
            [],
            finish_reason="stop",
            num_cached_tokens=max(request.num_cached_tokens, 0),
            queue_time=self._queue_time(request),
            embedding=embedding,
        )

    @staticmethod
    def _queue_time(request: Request) -> float | None:
        if request.first_scheduled_time is None:
            return None
        return request.first_scheduled_time - request.arrival_time

    @staticmethod
    def _new_prompt_logprobs(
        request: Request, start: int, runner_output: ModelRunnerOutput
    ) -> list[Logprobs]:
        """Prompt logprobs computed from position `start`, minus any sent before a preemption.

        Entry i is the logprob of prompt token start + 1 + i.
        """
        entries = runner_output.prompt_logprobs.get(request.request_id, [])
        if not entries:
            return []
        fresh = entries[max(0, request.num_prompt_logprobs_sent - start) :]
        request.num_prompt_logprobs_sent = max(
            request.num_prompt_logprobs_sent, start + len(entries)
        )
        return fresh

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        # The sampler masks stop tokens below min_tokens; this keeps the rule without it.
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    def stats(self, num_scheduled_tokens: int = 0) -> SchedulerStats:
        """Mutates the delta counters: gauges now, counters since the previous call."""
        counters = self.kv_cache.counters
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage(),
            num_waiting_tokens=sum(r.num_tokens for r in self.waiting),
            num_scheduled_tokens=num_scheduled_tokens,
            prefix_cache_queries=counters.queries - self._last_queries,
            prefix_cache_hits=counters.hits - self._last_hits,
            num_preemptions=self._num_preemptions,
            spec_num_drafts=self._spec_counts[0],
            spec_num_draft_tokens=self._spec_counts[1],
            spec_num_accepted_tokens=self._spec_counts[2],
            spec_accepted_per_pos=tuple(self._spec_accepted_per_pos),
            running_loras=_lora_names(self.running) if self.config.max_loras else (),
            waiting_loras=_lora_names(self.waiting) if self.config.max_loras else (),
            prefill_tokens_beside_decodes=self.prefill_tokens_beside_decodes(),
        )
        self._spec_counts = [0, 0, 0]
        self._spec_accepted_per_pos = []
        self._last_queries, self._last_hits = counters.queries, counters.hits
        self._num_preemptions = 0
        return stats


def _lora_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The adapters of `requests`, by name, each once, in the order first seen."""
    return tuple(dict.fromkeys(r.lora.lora_name for r in requests if r.lora is not None))
