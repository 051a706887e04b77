"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from engine.output_processor import Delta
from engine.scheduler.output import Logprobs
from server.errors import OpenAIError
from server.params import check_token_ids, sampling_params
from server.protocol import CompletionRequest
from server.serving import Choice, ServingContext, collect, make_choices, merge, now, usage


def tokenize_prompts(
    ctx: ServingContext, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> token id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", "prompt")
    batch: list[Any] = [prompt] if all(isinstance(p, int) for p in prompt) else list(prompt)
    prompts: list[list[int]] = []
    for p in batch:
        ids = list(ctx.tokenizer.encode(p)) if isinstance(p, str) else list(p)
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


def _echo_logprobs(ctx: ServingContext, choice: Choice) -> CompletionLogprobs:
    """Logprobs of the echoed prompt: the first token unscored, the rest from the engine."""
    assert choice.tracker is not None
    logprobs = CompletionLogprobs(ctx, 0).add_unscored(choice.prompt_ids[0])
    return logprobs.add(choice.tracker.prompt_logprobs)


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request_id: str
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    prompts = tokenize_prompts(ctx, body.prompt)
    params = [sampling_params(body, len(p), ctx.max_model_len, ctx.vocab_size) for p in prompts]
    choices = make_choices(prompts, params, body.user)
    response_id = f"cmpl-{request_id}"
    if body.stream:
        return _stream(ctx, body, choices, request_id, response_id)
    return await collect(
        ctx,
        choices,
        request_id,
        body.cache_salt,
        response_id,
        "text_completion",
        lambda choice: _final_choice(ctx, body, choice),
    )


def _final_choice(ctx: ServingContext, body: CompletionRequest, choice: Choice) -> dict[str, Any]:
    tracker = choice.tracker
    assert tracker is not None
    prompt_text = ctx.tokenizer.decode(choice.prompt_ids) if body.echo else ""
    logprobs = None
    if body.logprobs is not None:
        lp = _echo_logprobs(ctx, choice) if body.echo else CompletionLogprobs(ctx, 0)
        logprobs = lp.add(tracker.logprobs).as_dict()
    return {
        "index": choice.index,
        "text": prompt_text + tracker.text,
        "logprobs": logprobs,
        "finish_reason": tracker.finish_reason,
        "stop_reason": tracker.stop_reason,
    }


async def _stream(
    ctx: ServingContext,
    body: CompletionRequest,
    choices: list[Choice],
    request_id: str,
    response_id: str,
) -> AsyncIterator[dict[str, Any]]:
    created = now()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choice_list: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": ctx.model_name,
            "choices": choice_list,
        }
        if include_usage:
            out["usage"] = None
        return out

    echoed: set[int] = set()
    async for choice, delta in merge(ctx, choices, request_id, body.cache_salt):
        text = delta.text
        logprobs = None
        if body.echo and choice.index not in echoed:
            echoed.add(choice.index)
            text = ctx.tokenizer.decode(choice.prompt_ids) + text
        if body.logprobs is not None:
            logprobs = _delta_logprobs(ctx, body, choice, delta)
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
        final["usage"] = usage(choices)
        yield final


def _delta_logprobs(
    ctx: ServingContext, body: CompletionRequest, choice: Choice, delta: Delta
) -> dict[str, Any]:
    assert choice.tracker is not None
    emitted = len(choice.tracker.logprobs) - len(delta.logprobs)
    first = body.echo and emitted == 0
    lp = _echo_logprobs(ctx, choice) if first else CompletionLogprobs(ctx, 0)
    return lp.add(delta.logprobs).as_dict()
