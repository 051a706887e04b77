"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from engine import Logprobs
from server.errors import OpenAIError
from server.params import check_token_ids, sampling_params
from server.protocol import CompletionRequest
from server.serving import (
    Caller,
    Choice,
    PromptRun,
    ServingContext,
    make_runs,
    now,
    response_body,
    run_to_completion,
    stream_outputs,
    usage,
)
from server.structured import check_constraint, from_structured_outputs


def prompt_batch(
    prompt: str | list[str] | list[int] | list[list[int]], param: str = "prompt"
) -> list[str | list[int]]:
    """The prompts of a request: a string, strings, token ids or lists of them. `param`:
    the field's name, for errors."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, f"{param} must not be empty", param)
    if all(isinstance(p, int) for p in prompt):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


async def tokenize_prompts(
    ctx: ServingContext, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    """Token id lists, one per prompt (long texts are tokenized off the event loop)."""
    prompts: list[list[int]] = []
    for p in prompt_batch(prompt):
        if isinstance(p, str):
            ids = list(await ctx.tokenizer_call(len(p), ctx.tokenizer.encode, p))
        else:
            ids = list(p)
        check_token_ids(ids, ctx.vocab_size, "prompt")
        prompts.append(ids)
    return prompts


class CompletionLogprobs:
    """Accumulates the legacy completions logprobs object for one choice."""

    def __init__(self, ctx: ServingContext, text_offset: int) -> None:
        self.ctx = ctx
        self.offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add_unscored(self, token_id: int) -> CompletionLogprobs:
        """The first prompt token, which has no logprob (nothing precedes it)."""
        self._append(token_id, None, None)
        return self

    def add(self, entries: list[Logprobs]) -> CompletionLogprobs:
        for lp in entries:
            top = {self.ctx.token_text(t): v for t, v in lp.top}
            self._append(lp.token_id, lp.logprob, top)
        return self

    def _append(
        self, token_id: int | None, logprob: float | None, top: dict[str, float] | None
    ) -> None:
        text = "" if token_id is None else self.ctx.token_text(token_id)
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def _echo_logprobs(ctx: ServingContext, run: PromptRun) -> CompletionLogprobs:
    """Logprobs of the echoed prompt: the first token unscored, the rest from the engine."""
    logprobs = CompletionLogprobs(ctx, 0).add_unscored(run.prompt_ids[0])
    return logprobs.add(run.prompt_logprobs or [])


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, caller: Caller
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    prompts = await tokenize_prompts(ctx, body.prompt)
    so = body.structured_outputs
    constraint = None if so is None else from_structured_outputs(so)
    engine_constraint = None if constraint is None else constraint.params
    params = [
        sampling_params(body, len(p), ctx.max_model_len, ctx.vocab_size, engine_constraint)
        for p in prompts
    ]
    await check_constraint(ctx, params[0], constraint)
    runs = make_runs(prompts, params)
    caller.reserve_tokens(runs, "prompt")
    response_id = f"cmpl-{caller.request_id}"
    if body.stream:
        return _stream(ctx, body, runs, caller, response_id)
    await run_to_completion(ctx, runs, caller, body.cache_salt, body.user)
    choices = [_final_choice(ctx, body, run, c) for run in runs for c in run.choices]
    return response_body(ctx, response_id, "text_completion", choices, runs, caller)


def _final_choice(
    ctx: ServingContext, body: CompletionRequest, run: PromptRun, choice: Choice
) -> dict[str, Any]:
    prompt_text = ctx.tokenizer.decode(run.prompt_ids) if body.echo else ""
    logprobs = None
    if body.logprobs is not None:
        lp = _echo_logprobs(ctx, run) if body.echo else CompletionLogprobs(ctx, 0)
        logprobs = lp.add(choice.logprobs).as_dict()
    return {
        "index": choice.index,
        "text": prompt_text + choice.text,
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
    }


async def _stream(
    ctx: ServingContext,
    body: CompletionRequest,
    runs: list[PromptRun],
    caller: Caller,
    response_id: str,
) -> AsyncIterator[dict[str, Any]]:
    created = now()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choice_list: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": caller.model_name(ctx),
            "choices": choice_list,
        }
        if include_usage:
            out["usage"] = None
        return out

    echoed: set[int] = set()
    outputs = stream_outputs(ctx, runs, caller, body.cache_salt, body.user)
    async for run, output in outputs:
        for choice, delta in run.fold(output):
            text, logprobs = delta.text, None
            first = body.echo and choice.index not in echoed
            if first:
                echoed.add(choice.index)
                text = ctx.tokenizer.decode(run.prompt_ids) + text
            if body.logprobs is not None:
                lp = _echo_logprobs(ctx, run) if first else CompletionLogprobs(ctx, 0)
                logprobs = lp.add(delta.logprobs or []).as_dict()
            yield chunk(
                [
                    {
                        "index": choice.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": delta.finish_reason,
                        "stop_reason": delta.stop_reason,
                    }
                ]
            )
    if include_usage:
        final = chunk([])
        final["usage"] = usage(runs)
        yield final
