"""Completions and chat completions: one engine request per prompt, streamed or collected.

The engine yields per-prompt RequestOutputs whose choices already carry text deltas, finish
reasons and logprobs; this module only merges a request's prompts, keeps the running totals
usage needs, and frames SSE.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request

from engine import (
    AsyncLLM,
    CompletionOutput,
    EngineClosedError,
    EngineDeadError,
    LoRARequest,
    RequestOutput,
    RequestStream,
    RequestValidationError,
    SamplingParams,
)
from server.admission import Admission, Ticket
from server.errors import OpenAIError, error_body
from server.metrics import ServerMetrics
from server.reasoning import ReasoningFormat
from server.tenants import tenant_cache_salt
from server.tool_parsers import ToolFormat

if TYPE_CHECKING:
    from server.lora import LoRARegistry

T = TypeVar("T")
# Text longer than this is tokenized (or a chat template rendered) off the event loop, so
# the loop keeps streaming other requests' tokens meanwhile; below it, the hop to a thread
# would cost more than the work.
OFF_LOOP_CHARS = 4096


@dataclass
class ServingContext:
    """What the endpoints need: the engine, and the names and limits clients see."""

    engine: AsyncLLM
    model_name: str
    metrics: ServerMetrics
    admission: Admission
    loras: LoRARegistry
    # --chat-template's text (None: the tokenizer's).
    chat_template: str | None = None
    # --tool-call-parser's format, resolved; without one, why tools are refused.
    tool_format: ToolFormat | None = None
    tools_refusal: str = ""
    # --reasoning-parser's format.
    reasoning: ReasoningFormat | None = None
    _token_text: dict[int, str] = field(default_factory=dict)
    # One thread: long inputs are tokenized one at a time, beside the event loop.
    _tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    )

    async def tokenizer_call(self, size: int, func: Callable[..., T], *args: Any) -> T:
        """func(*args), on the tokenizer thread when `size` (characters or tokens) is
        large enough for it to hold up the event loop."""
        if size < OFF_LOOP_CHARS:
            return func(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, func, *args)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.scheduler.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.config.model.arch.vocab_size

    def require_task(self, task: str) -> None:
        """A 400 unless the engine serves `task`: "generate" or "embed" (--task)."""
        if self.engine.config.model.task == task:
            return
        if task == "embed":
            message = (
                f"The model `{self.model_name}` does not serve embeddings: /v1/embeddings "
                "needs an embedding model served with --task embed."
            )
        else:
            message = (
                f"The model `{self.model_name}` serves embeddings only (--task embed): use "
                "/v1/embeddings."
            )
        raise OpenAIError(400, message, "model", code="model_not_supported")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = str(self.tokenizer.decode([token_id]))
        return text


@dataclass(frozen=True)
class Caller:
    """Who sent a request, and the queue room it holds until the engine has it."""

    request_id: str
    ticket: Ticket
    tenant: str | None = None
    # The LoRA adapter the request named as its model; None: the base model.
    lora: LoRARequest | None = None

    def model_name(self, ctx: ServingContext) -> str:
        """The model responses name: the adapter's name, or the served model's."""
        return ctx.model_name if self.lora is None else self.lora.lora_name

    def reserve_tokens(self, runs: list[PromptRun], param: str) -> None:
        """Admission's second check, once the prompts are tokens: 400 or 503."""
        self.ticket.reserve_tokens(sum(len(r.prompt_ids) * r.params.n for r in runs), param)


def admit(
    request: Request, ctx: ServingContext, num_choices: int, lora: LoRARequest | None = None
) -> Caller:
    """Reserves queue room for the request's choices (503 or 400 when there is none) until
    the engine has them, or the exchange ends."""
    ticket = ctx.admission.admit(num_choices)
    request.state.cleanup.callback(ticket.release)
    return Caller(request.state.request_id, ticket, request.state.tenant, lora)


@dataclass
class Choice:
    """One choice as the client sees it: the running totals of its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Any] = field(default_factory=list)


@dataclass
class PromptRun:
    """One prompt of a request and its n choices (indices index * n ...)."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    choices: list[Choice]
    num_cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None

    def fold(self, output: RequestOutput) -> list[tuple[Choice, CompletionOutput]]:
        """Adds a DELTA output's choices to the totals; returns them, paired."""
        self.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        pairs = []
        for completion in output.outputs:
            choice = self.choices[completion.index]
            choice.text += completion.text
            choice.token_ids += completion.token_ids
            choice.logprobs += completion.logprobs or []
            choice.finish_reason = completion.finish_reason
            choice.stop_reason = completion.stop_reason
            pairs.append((choice, completion))
        return pairs


def make_runs(prompts: list[list[int]], params: list[SamplingParams]) -> list[PromptRun]:
    runs = []
    for p, (ids, prompt_params) in enumerate(zip(prompts, params, strict=True)):
        n = prompt_params.n
        runs.append(PromptRun(p, ids, prompt_params, [Choice(p * n + i) for i in range(n)]))
    return runs


# submit(index, request id, cache salt, labels) queues one engine request.
Submit = Callable[[int, str, str | None, dict[str, str]], RequestStream]


async def stream_outputs(
    ctx: ServingContext,
    runs: list[PromptRun],
    caller: Caller,
    cache_salt: str | None,
    user: str | None,
) -> AsyncIterator[tuple[PromptRun, RequestOutput]]:
    """Runs every prompt as one DELTA engine request and yields their outputs as they come.
    Leaving early (client gone) aborts every prompt still running."""

    def submit(i: int, request_id: str, salt: str | None, labels: dict[str, str]) -> RequestStream:
        run = runs[i]
        return ctx.engine.generate(
            run.prompt_ids,
            run.params,
            request_id,
            cache_salt=salt,
            labels=labels,
            lora_request=caller.lora,
        )

    outputs = engine_outputs(len(runs), submit, caller, cache_salt, user)
    async with aclosing(outputs):  # leaving early aborts at once, not when collected
        async for i, output in outputs:
            yield runs[i], output


async def engine_outputs(
    count: int, submit: Submit, caller: Caller, cache_salt: str | None, user: str | None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Queues `count` engine requests with `submit` (with the tenant's cache salt and the
    log labels) and yields (index, output) as outputs come; engine errors become the
    client's 400, 500 or 503. Leaving early (client gone) aborts every request still
    running."""
    salt = tenant_cache_salt(caller.tenant, cache_salt)
    labels = {k: v for k, v in (("user", user), ("tenant", caller.tenant)) if v}
    streams: list[RequestStream] = []
    try:
        for i in range(count):
            request_id = f"{caller.request_id}-{i}-{uuid.uuid4().hex[:8]}"
            streams.append(submit(i, request_id, salt, labels))
        caller.ticket.release()  # the engine counts them as queued now
        async for i, output in _merge(streams):
            yield i, output
    except RequestValidationError as exc:
        raise OpenAIError(400, str(exc), exc.param) from None
    except EngineDeadError as exc:
        raise OpenAIError(500, str(exc), code="engine_dead") from None
    except EngineClosedError as exc:
        raise OpenAIError(503, str(exc), code="shutting_down") from None
    finally:
        for stream in streams:
            stream.close()


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several engine streams as their outputs arrive; closing it closes (so
    aborts) every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async with aclosing(streams[i]) as stream:
                async for output in stream:
                    queue.put_nowait((i, output))
            queue.put_nowait((i, None))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_to_completion(
    ctx: ServingContext,
    runs: list[PromptRun],
    caller: Caller,
    cache_salt: str | None,
    user: str | None,
) -> None:
    """Mutates `runs`: every choice's final text, logprobs and finish reason."""
    async for run, output in stream_outputs(ctx, runs, caller, cache_salt, user):
        run.fold(output)


def usage(runs: list[PromptRun]) -> dict[str, Any]:
    prompt = sum(len(run.prompt_ids) for run in runs)
    cached = sum(run.num_cached_tokens for run in runs)
    completion = sum(len(c.token_ids) for run in runs for c in run.choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def response_body(
    ctx: ServingContext,
    response_id: str,
    obj: str,
    choices: list[dict[str, Any]],
    runs: list[PromptRun],
    caller: Caller,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": obj,
        "created": now(),
        "model": caller.model_name(ctx),
        "choices": choices,
        "usage": usage(runs),
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
