"""OutputProcessor: from the engine core's per-step outputs to what callers see.

It owns the caller's side of every request, once, for the offline LLM and the AsyncLLM
alike: the `n` fan-out (one engine request per choice), detokenization and stop strings (a
match ends the choice; the caller then aborts its engine request), the output kind, and the
latencies that become metrics. Pure Python; not thread-safe (one caller at a time).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import StoppableText
from engine.lora.request import LoRARequest
from engine.outputs import (
    CompletionOutput,
    FinishedRequestStats,
    IterationStats,
    Logprobs,
    RequestOutput,
)
from engine.pooling import PoolingParams
from engine.request import Request
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler.output import EngineCoreOutput

# The sampling params of an embedding request's one choice: reported once, when it ends.
# It samples nothing; the scheduler ends it with its embedding after its prefill.
EMBEDDING_PARAMS = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class _Choice:
    """One engine request: the i-th of a prompt's n samples."""

    request_id: str
    index: int
    text: StoppableText
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None
    last_token_time: float | None = None
    first_token_time: float | None = None
    # DELTA bookkeeping: tokens already handed out.
    num_sent: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, delta: bool) -> CompletionOutput:
        """Mutates the DELTA bookkeeping when `delta`."""
        start = self.num_sent if delta else 0
        text = self.text.take_new(self.finished) if delta else self.text.visible(self.finished)
        if delta:
            self.num_sent = len(self.token_ids)
        return CompletionOutput(
            self.index,
            text,
            self.token_ids[start:],
            self.finish_reason,
            self.stop_reason,
            self.logprobs[start:] if self.want_logprobs else None,
        )


@dataclass
class _Prompt:
    """A caller's request: one prompt, `n` choices."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    arrival_time: float
    labels: Mapping[str, str]
    choices: list[_Choice] = field(default_factory=list)
    prompt_logprobs: list[Logprobs] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    # Engine requests that ended on a stop string: the caller must abort them.
    aborts: list[str]
    stats: IterationStats


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._prompts: dict[str, _Prompt] = {}
        self._choices: dict[str, tuple[_Prompt, _Choice]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._prompts

    def __len__(self) -> int:
        """Callers' requests tracked (not finished, not aborted)."""
        return len(self._prompts)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        prompt: str | None = None,
        labels: Mapping[str, str] | None = None,
        arrival_time: float | None = None,
        pooling_params: PoolingParams | None = None,
        lora: LoRARequest | None = None,
    ) -> list[Request]:
        """Starts tracking a caller's request; returns its n engine requests to schedule.

        Choice i runs as engine request f"{request_id}-{i}" (unique as long as caller ids
        are: the suffix after the last dash is the choice). With `pooling_params`, an
        embedding request: its one choice ends with the embedding (see EMBEDDING_PARAMS)."""
        if request_id in self._prompts:
            raise ValueError(f"duplicate request id {request_id!r}")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        parent = _Prompt(request_id, prompt_token_ids, prompt, params, arrival, labels or {})
        requests = []
        for i in range(params.n):
            child = params.for_child(i)
            engine_id = f"{request_id}-{i}"
            text = StoppableText(self.tokenizer, prompt_token_ids, child)
            choice = _Choice(engine_id, i, text, child.logprobs is not None)
            parent.choices.append(choice)
            self._choices[engine_id] = (parent, choice)
            requests.append(
                Request(
                    engine_id,
                    prompt_token_ids,
                    child,
                    self.eos_token_ids,
                    cache_salt,
                    arrival_time=arrival,
                    pooling_params=pooling_params,
                    lora=lora,
                )
            )
        self._prompts[request_id] = parent
        return requests

    def abort_request(self, request_id: str) -> tuple[list[str], IterationStats]:
        """Stops tracking a caller's request; returns its unfinished engine requests (to
        abort in the core) and their end as "abort". Unknown ids give nothing."""
        stats = IterationStats()
        parent = self._prompts.pop(request_id, None)
        if parent is None:
            return [], stats
        now, unfinished = time.monotonic(), []
        for choice in parent.choices:
            self._choices.pop(choice.request_id, None)
            if not choice.finished:
                choice.finish_reason = "abort"
                unfinished.append(choice.request_id)
                stats.finished.append(self._finished_stats(parent, choice, now))
        return unfinished, stats

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Folds one step's outputs in; returns what each caller gets to see."""
        now = time.monotonic()
        stats, aborts = IterationStats(), []
        changed: dict[str, tuple[_Prompt, list[_Choice]]] = {}
        for out in outputs:
            entry = self._choices.get(out.request_id)
            if entry is None:  # its caller has gone
                continue
            parent, choice = entry
            if self._apply(parent, choice, out, now, stats):
                aborts.append(choice.request_id)
            if out.new_token_ids or choice.finished:
                changed.setdefault(parent.request_id, (parent, []))[1].append(choice)
            if choice.finished:
                del self._choices[choice.request_id]
                stats.finished.append(self._finished_stats(parent, choice, now))
        results = []
        for parent, choices in changed.values():
            output = self._request_output(parent, choices)
            if output is not None:
                results.append(output)
            if parent.finished:
                del self._prompts[parent.request_id]
        return ProcessedOutputs(results, aborts, stats)

    def _apply(
        self,
        parent: _Prompt,
        choice: _Choice,
        out: EngineCoreOutput,
        now: float,
        stats: IterationStats,
    ) -> bool:
        """Mutates the choice and `stats`; True when a stop string ended the choice."""
        choice.prompt_logprobs += out.prompt_logprobs
        choice.num_cached_tokens = out.num_cached_tokens
        if out.new_token_ids:
            self._observe_latency(parent, choice, out, now, stats)
            if parent.prompt_logprobs is None and parent.params.prompt_logprobs is not None:
                parent.prompt_logprobs = choice.prompt_logprobs
        elif out.embedding is not None:  # no token, so no latency but the queue's
            choice.embedding = out.embedding
            if out.queue_time is not None:
                stats.queue_times.append(out.queue_time)
        stopped = False
        for i, token_id in enumerate(out.new_token_ids):
            choice.token_ids.append(token_id)
            stats.num_generation_tokens += 1
            if i < len(out.new_logprobs):
                choice.logprobs.append(out.new_logprobs[i])
            if choice.text.add(token_id):
                choice.finish_reason, choice.stop_reason = "stop", choice.text.matched_stop
                stopped = True
                break
        if out.finish_reason is not None and not choice.finished:
            choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason
        return stopped

    @staticmethod
    def _observe_latency(
        parent: _Prompt, choice: _Choice, out: EngineCoreOutput, now: float, stats: IterationStats
    ) -> None:
        if choice.last_token_time is None:
            choice.first_token_time = now
            stats.time_to_first_tokens.append(now - parent.arrival_time)
        else:
            stats.inter_token_latencies.append(now - choice.last_token_time)
        if out.queue_time is not None:
            stats.queue_times.append(out.queue_time)
        choice.last_token_time = now

    def _request_output(self, parent: _Prompt, changed: list[_Choice]) -> RequestOutput | None:
        kind = parent.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        choices = changed if delta else parent.choices
        prompt_logprobs = parent.prompt_logprobs
        if delta and prompt_logprobs is not None:
            # Sent once, with the first output that carries them.
            prompt_logprobs = None if parent.prompt_logprobs_sent else prompt_logprobs
            parent.prompt_logprobs_sent = True
        return RequestOutput(
            parent.request_id,
            parent.prompt_token_ids,
            [c.completion(delta) for c in sorted(choices, key=lambda c: c.index)],
            parent.finished,
            num_cached_tokens=parent.choices[0].num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            prompt=parent.prompt,
            embedding=parent.choices[0].embedding,
        )

    @staticmethod
    def _finished_stats(parent: _Prompt, choice: _Choice, now: float) -> FinishedRequestStats:
        first = choice.first_token_time
        return FinishedRequestStats(
            request_id=choice.request_id,
            finish_reason=choice.finish_reason or "abort",
            num_prompt_tokens=len(parent.prompt_token_ids),
            num_cached_tokens=choice.num_cached_tokens,
            num_generation_tokens=len(choice.token_ids),
            e2e_latency=now - parent.arrival_time,
            ttft=None if first is None else first - parent.arrival_time,
            first_of_prompt=choice.index == 0,
            labels=parent.labels,
        )
