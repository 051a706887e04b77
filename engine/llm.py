"""The offline API: `LLM(...).generate(prompts, params)`, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from engine.factory import EngineArgs, create_engine
from engine.output_processor import RequestTracker
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.output import Logprobs

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprobs] | None = None
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)


class LLM:
    """Runs the engine in-process. `model=None` means the bundled default model."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = create_engine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        core = self.engine.core
        trackers: dict[str, RequestTracker] = {}
        groups: list[tuple[str, Prompt, list[int], list[str]]] = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            ids = self._tokenize(prompt)
            parent = str(self._next_id)
            self._next_id += 1
            children = []
            for i in range(params.n):
                request_id = f"{parent}-{i}"
                child = params.for_child(i)
                request = Request(request_id, ids, child, self.config.arch.eos_token_ids)
                core.add_request(request)
                trackers[request_id] = RequestTracker(self.tokenizer, ids, child)
                children.append(request_id)
            groups.append((parent, prompt, ids, children))

        progress = tqdm(total=len(trackers), desc="Generating", disable=not use_tqdm)
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tracker = trackers[out.request_id]
                tracker.process(out)
                if tracker.needs_abort:
                    core.abort_requests([out.request_id])
                if tracker.finished:
                    progress.update()
        progress.close()
        return [self._output(group, trackers) for group in groups]

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    @staticmethod
    def _output(
        group: tuple[str, Prompt, list[int], list[str]], trackers: dict[str, RequestTracker]
    ) -> RequestOutput:
        parent, prompt, ids, children = group
        done = [trackers[c] for c in children]
        completions = [
            CompletionOutput(
                i,
                t.text,
                t.token_ids,
                t.finish_reason,
                t.stop_reason,
                t.logprobs if t.params.logprobs is not None else None,
            )
            for i, t in enumerate(done)
        ]
        first = done[0]
        return RequestOutput(
            parent,
            prompt if isinstance(prompt, str) else None,
            ids,
            completions,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=first.prompt_logprobs
            if first.params.prompt_logprobs is not None
            else None,
        )


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
