"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from engine import Logprobs
from server.errors import OpenAIError
from server.params import sampling_params
from server.protocol import ChatCompletionRequest, ChatMessage
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


async def render_chat(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """Applies the tokenizer's chat template and tokenizes the result (off the event loop
    for long conversations)."""
    if not getattr(ctx.tokenizer, "chat_template", None):
        raise OpenAIError(400, "this model has no chat template; use /v1/completions", "messages")
    conversation = [
        {"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
        for m in messages
    ]

    def render() -> list[int]:
        try:
            text = ctx.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
        except Exception as exc:  # a template may raise on a conversation it does not accept
            raise OpenAIError(
                400, f"the chat template rejected the messages: {exc}", "messages"
            ) from None
        return list(ctx.tokenizer.encode(text, add_special_tokens=False))

    size = sum(len(m["content"]) for m in conversation)
    return await ctx.tokenizer_call(size, render)


def _logprob_entries(ctx: ServingContext, entries: list[Logprobs]) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = ctx.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [
        entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in entries
    ]


async def chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids, as the request's template options render it."""
    return await render_chat(
        ctx,
        body.messages,
        add_generation_prompt=body.add_generation_prompt is not False
        and not body.continue_final_message,
        continue_final_message=bool(body.continue_final_message),
    )


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, caller: Caller
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    prompt = await chat_prompt(ctx, body)
    params = sampling_params(body, len(prompt), ctx.max_model_len, ctx.vocab_size)
    runs = make_runs([prompt], [params])
    caller.reserve_tokens(runs, "messages")
    response_id = f"chatcmpl-{caller.request_id}"
    if body.stream:
        return _stream(ctx, body, runs, caller, response_id)
    await run_to_completion(ctx, runs, caller, body.cache_salt, body.user)
    choices = [_final_choice(ctx, body, c) for c in runs[0].choices]
    return response_body(ctx, response_id, "chat.completion", choices, runs)


def _final_choice(
    ctx: ServingContext, body: ChatCompletionRequest, choice: Choice
) -> dict[str, Any]:
    logprobs = {"content": _logprob_entries(ctx, choice.logprobs)} if body.logprobs else None
    return {
        "index": choice.index,
        "message": {"role": "assistant", "content": choice.text},
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
    }


async def _stream(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    runs: list[PromptRun],
    caller: Caller,
    response_id: str,
) -> AsyncIterator[dict[str, Any]]:
    created = now()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        out: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": ctx.model_name,
            "choices": [choice | extra],
        }
        if include_usage:
            out["usage"] = None
        return out

    # The role comes first, in its own chunk per choice, as OpenAI sends it.
    for choice in runs[0].choices:
        yield chunk(choice.index, {"role": "assistant", "content": ""})
    outputs = stream_outputs(ctx, runs, caller, body.cache_salt, body.user)
    async for run, output in outputs:
        for choice, delta in run.fold(output):
            entries = delta.logprobs or []
            logprobs = {"content": _logprob_entries(ctx, entries)} if body.logprobs else None
            if delta.text or logprobs:
                yield chunk(choice.index, {"content": delta.text}, logprobs=logprobs)
            if delta.finish_reason is not None:
                yield chunk(
                    choice.index,
                    {},
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
    if include_usage:
        final = chunk(0, {})
        final["choices"] = []
        final["usage"] = usage(runs)
        yield final
