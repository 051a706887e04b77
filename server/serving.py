"""Completions and chat completions: run choices on the engine, stream or collect them."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.output_processor import Delta, RequestTracker
from engine.sampling_params import SamplingParams
from server.errors import OpenAIError, error_body
from server.metrics import RequestTimer, ServerMetrics

logger = logging.getLogger("pagedserve.requests")


@dataclass
class Choice:
    """One engine request: a prompt and the params of the i-th of n samples."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    first_of_prompt: bool
    # The client's end-user id (OpenAI's `user`), logged with the request.
    user: str | None = None
    tracker: RequestTracker | None = None


@dataclass
class ServingContext:
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    log_requests: bool = True
    _token_text: dict[int, str] = field(default_factory=dict)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = str(self.tokenizer.decode([token_id]))
        return text


def make_choices(
    prompts: list[list[int]], params: list[SamplingParams], user: str | None
) -> list[Choice]:
    choices = []
    for p, (ids, prompt_params) in enumerate(zip(prompts, params, strict=True)):
        for i in range(prompt_params.n):
            child = prompt_params.for_child(i)
            choices.append(Choice(p * prompt_params.n + i, ids, child, i == 0, user))
    return choices


async def run_choice(
    ctx: ServingContext, choice: Choice, request_id: str, cache_salt: str | None
) -> AsyncIterator[Delta]:
    """Yields the visible deltas of one choice; leaving early aborts the engine request."""
    tracker = RequestTracker(ctx.tokenizer, choice.prompt_ids, choice.params)
    choice.tracker = tracker
    timer = ctx.metrics.request(len(choice.prompt_ids))
    engine_id = f"{request_id}-{choice.index}-{uuid.uuid4().hex[:8]}"
    stream = ctx.engine.generate(engine_id, choice.prompt_ids, choice.params, cache_salt)
    try:
        async for out in stream:
            delta = tracker.process(out)
            timer.on_tokens(len(out.new_token_ids), out.queue_time)
            if tracker.finished:
                timer.on_finish(tracker.finish_reason or "stop", choice.first_of_prompt)
                yield delta
                return
            if delta.text or delta.token_ids:
                yield delta
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from None
    except EngineDeadError as exc:
        raise OpenAIError(500, str(exc), code="engine_dead") from None
    finally:
        await stream.aclose()
        if not tracker.finished:
            timer.on_finish("abort", choice.first_of_prompt)
        if ctx.log_requests:
            log_request(engine_id, choice.user, tracker, timer)


def log_request(
    engine_id: str, user: str | None, tracker: RequestTracker, timer: RequestTimer
) -> None:
    """One line per engine request; never the prompt or completion text."""
    ttft = None if timer.first_token is None else round(timer.first_token - timer.start, 4)
    logger.info(
        "request finished",
        extra={
            "request_id": engine_id,
            "user": user,
            "prompt_tokens": timer.num_prompt_tokens,
            "cached_tokens": tracker.num_cached_tokens,
            "output_tokens": len(tracker.token_ids),
            "ttft_s": ttft,
            "total_s": round(time.monotonic() - timer.start, 4),
            "finish_reason": tracker.finish_reason or "abort",
        },
    )


async def merge(
    ctx: ServingContext, choices: list[Choice], request_id: str, salt: str | None
) -> AsyncIterator[tuple[Choice, Delta]]:
    """Interleaves the deltas of all choices as they arrive. Cancels the rest on exit."""
    queue: asyncio.Queue[tuple[Choice, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in run_choice(ctx, choice, request_id, salt):
                queue.put_nowait((choice, delta))
            queue.put_nowait((choice, None))
        except Exception as exc:
            queue.put_nowait((choice, exc))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(tasks)
        while remaining:
            choice, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(
    ctx: ServingContext,
    choices: list[Choice],
    request_id: str,
    salt: str | None,
    response_id: str,
    obj: str,
    final_choice: Callable[[Choice], dict[str, Any]],
) -> dict[str, Any]:
    """Runs every choice to completion, then builds the non-streamed response body."""
    async for _ in merge(ctx, choices, request_id, salt):
        pass
    return {
        "id": response_id,
        "object": obj,
        "created": now(),
        "model": ctx.model_name,
        "choices": [final_choice(c) for c in choices],
        "usage": usage(choices),
    }


def usage(choices: list[Choice]) -> dict[str, Any]:
    prompt = sum(len(c.prompt_ids) for c in choices if c.first_of_prompt)
    cached = sum(c.tracker.num_cached_tokens for c in choices if c.first_of_prompt and c.tracker)
    completion = sum(len(c.tracker.token_ids) for c in choices if c.tracker)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def sse_events(
    chunks: AsyncIterator[dict[str, Any]],
) -> AsyncIterator[dict[str, str]]:
    """OpenAI's stream framing: one JSON object per event, an error event, then [DONE]."""
    try:
        async for chunk in chunks:
            yield {"data": json.dumps(chunk, ensure_ascii=False)}
    except OpenAIError as exc:
        yield {"data": json.dumps(exc.body())}
    except Exception as exc:  # an unexpected failure mid-stream still ends the stream cleanly
        yield {"data": json.dumps(error_body(500, f"internal error: {exc!r}"))}
    yield {"data": "[DONE]"}


def now() -> int:
    return int(time.time())
