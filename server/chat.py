"""POST /v1/chat/completions: templates, output constraints, tool calls, SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from engine import Logprobs
from server.chat_output import ChoiceReader
from server.chat_template import conversation
from server.errors import OpenAIError
from server.messages import ChatMessage
from server.params import sampling_params
from server.protocol import ChatCompletionRequest
from server.reasoning import Phase, reasoning_tokens
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
from server.structured import (
    Constraint,
    check_constraint,
    from_response_format,
    from_structured_outputs,
)
from server.tool_parsers import template_supports_tools
from server.tools import ToolPlan, plan_tools

# Tokens at the end of a prompt whose text shows whether it opened the model's reasoning.
_PROMPT_TAIL = 24
# Template variables a request's chat_template_kwargs cannot set: the server sets them.
_RESERVED_KWARGS = frozenset(
    {"messages", "conversation", "tools", "add_generation_prompt", "continue_final_message",
     "tokenize", "chat_template", "return_dict", "documents"}
)  # fmt: skip


async def render_chat(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: ToolPlan | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Applies the chat template (--chat-template, else the tokenizer's) and tokenizes the
    result (off the event loop for long conversations). `template_kwargs` are the request's
    extra template variables (`enable_thinking`, ...)."""
    template = ctx.chat_template or getattr(ctx.tokenizer, "chat_template", None)
    if not template:
        raise OpenAIError(400, "this model has no chat template; use /v1/completions", "messages")
    native = template_supports_tools(template)
    turns = conversation(messages, tools, native)
    reserved = sorted(_RESERVED_KWARGS & set(template_kwargs or {}))
    if reserved:
        raise OpenAIError(
            400, f"chat_template_kwargs cannot set {reserved[0]!r}", "chat_template_kwargs"
        )
    extra: dict[str, Any] = dict(template_kwargs or {})
    if ctx.chat_template:
        extra["chat_template"] = ctx.chat_template
    if native and tools is not None:
        extra["tools"] = [t.model_dump(exclude_none=True) for t in tools.tools]

    def render() -> list[int]:
        try:
            text = ctx.tokenizer.apply_chat_template(
                turns,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **extra,
            )
        except Exception as exc:  # a template may raise on a conversation it does not accept
            raise OpenAIError(
                400, f"the chat template rejected the messages: {exc}", "messages"
            ) from None
        return list(ctx.tokenizer.encode(text, add_special_tokens=False))

    size = sum(len(str(t["content"])) for t in turns)
    return await ctx.tokenizer_call(size, render)


def _logprobs(ctx: ServingContext, entries: list[Logprobs]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = ctx.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in entries
    ]
    return {"content": content, "refusal": None}


def _constraint(body: ChatCompletionRequest, plan: ToolPlan | None) -> Constraint | None:
    """The output constraint: from response_format or structured_outputs, or the tools'
    grammar (the two cannot be combined)."""
    if body.structured_outputs is not None:
        constraint = from_structured_outputs(body.structured_outputs)
    elif body.response_format is not None:
        constraint = from_response_format(body.response_format)
    else:
        constraint = None
    if plan is None:
        return constraint
    if constraint is not None:
        raise OpenAIError(
            400, f"{constraint.param} cannot be combined with tools", constraint.param
        )
    return plan.constraint()


def tool_plan(ctx: ServingContext, body: ChatCompletionRequest) -> ToolPlan | None:
    return plan_tools(
        body.tools, body.tool_choice, body.parallel_tool_calls, ctx.tool_format, ctx.tools_refusal
    )


async def chat_prompt(
    ctx: ServingContext, body: ChatCompletionRequest, plan: ToolPlan | None
) -> list[int]:
    """The prompt's token ids, as the request's template options and tools render it."""
    return await render_chat(
        ctx,
        body.messages,
        add_generation_prompt=body.add_generation_prompt is not False
        and not body.continue_final_message,
        continue_final_message=bool(body.continue_final_message),
        tools=plan,
        template_kwargs=body.chat_template_kwargs,
    )


def _reasoning_phase(ctx: ServingContext, prompt: list[int]) -> Phase:
    """Where the output starts, read from the end of the prompt's text."""
    if ctx.reasoning is None:
        return "closed"
    tail = ctx.tokenizer.decode(prompt[-_PROMPT_TAIL:], skip_special_tokens=False)
    return ctx.reasoning.phase(str(tail))


def _after_reasoning(
    ctx: ServingContext, constraint: Constraint | None, phase: Phase
) -> Constraint | None:
    """With a reasoning parser, the constraint applies from the end of the thinking."""
    if constraint is None or ctx.reasoning is None:
        return constraint
    bounds = ctx.reasoning.bounds(ctx.tokenizer, phase)
    return replace(constraint, params=replace(constraint.params, reasoning=bounds))


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, caller: Caller
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    plan = tool_plan(ctx, body)
    prompt = await chat_prompt(ctx, body, plan)
    phase = _reasoning_phase(ctx, prompt)
    constraint = _after_reasoning(ctx, _constraint(body, plan), phase)
    params = sampling_params(
        body,
        len(prompt),
        ctx.max_model_len,
        ctx.vocab_size,
        constraint=None if constraint is None else constraint.params,
        extra_stop=() if plan is None else plan.stop(),
        keep_special_tokens=plan is not None and plan.fmt.keep_special_tokens,
    )
    await check_constraint(ctx, params, constraint)
    runs = make_runs([prompt], [params])
    caller.reserve_tokens(runs, "messages")
    response_id = f"chatcmpl-{caller.request_id}"
    if body.stream:
        return _stream(ctx, body, runs, caller, response_id, plan, phase)
    await run_to_completion(ctx, runs, caller, body.cache_salt, body.user)
    choices = [
        _final_choice(ctx, body, c, ChoiceReader(ctx.reasoning, phase, plan))
        for c in runs[0].choices
    ]
    out = response_body(ctx, response_id, "chat.completion", choices, runs, caller)
    await _add_reasoning_tokens(ctx, out["usage"], runs, phase)
    return out


async def _add_reasoning_tokens(
    ctx: ServingContext, totals: dict[str, Any], runs: list[PromptRun], phase: Phase
) -> None:
    """Mutates `totals`: completion_tokens_details.reasoning_tokens, with a reasoning
    parser (counting decodes the output a few times: off the loop for long ones)."""
    fmt = ctx.reasoning
    if fmt is None:
        return

    def count() -> int:
        total = 0
        for run in runs:
            skip = run.params.skip_special_tokens

            def decode(ids: list[int], skip: bool = skip) -> str:
                return str(ctx.tokenizer.decode(ids, skip_special_tokens=skip))

            total += sum(reasoning_tokens(c.token_ids, decode, fmt, phase) for c in run.choices)
        return total

    size = sum(len(c.token_ids) for run in runs for c in run.choices)
    totals["completion_tokens_details"] = {
        "reasoning_tokens": await ctx.tokenizer_call(size, count)
    }


def _final_choice(
    ctx: ServingContext, body: ChatCompletionRequest, choice: Choice, reader: ChoiceReader
) -> dict[str, Any]:
    fields, has_calls = reader.message(choice.text, choice.finish_reason)
    message: dict[str, Any] = {"role": "assistant", **fields, "refusal": None}
    finish_reason = _finish_with_calls(choice.finish_reason) if has_calls else choice.finish_reason
    return {
        "index": choice.index,
        "message": message,
        "logprobs": _logprobs(ctx, choice.logprobs) if body.logprobs else None,
        "finish_reason": finish_reason,
        "stop_reason": _stop_reason(reader.plan, choice.stop_reason),
    }


def _finish_with_calls(finish_reason: str | None) -> str | None:
    """A choice that ended normally after calling tools finished with "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _stop_reason(plan: ToolPlan | None, reason: int | str | None) -> int | str | None:
    """The matched stop, unless it is the plan's own (not something the client asked for)."""
    return None if plan is not None and reason in plan.stop() else reason


async def _stream(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    runs: list[PromptRun],
    caller: Caller,
    response_id: str,
    plan: ToolPlan | None,
    phase: Phase,
) -> AsyncIterator[dict[str, Any]]:
    created = now()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        out: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": caller.model_name(ctx),
            "choices": [choice | extra],
        }
        if include_usage:
            out["usage"] = None
        return out

    # The role comes first, in its own chunk per choice, as OpenAI sends it.
    for choice in runs[0].choices:
        yield chunk(choice.index, {"role": "assistant", "content": "", "refusal": None})
    plain = plan is None and ctx.reasoning is None
    readers = {c.index: ChoiceReader(ctx.reasoning, phase, plan) for c in runs[0].choices}
    outputs = stream_outputs(ctx, runs, caller, body.cache_salt, body.user)
    async for run, output in outputs:
        for choice, delta in run.fold(output):
            logprobs = _logprobs(ctx, delta.logprobs or []) if body.logprobs else None
            finished = delta.finish_reason is not None
            if plain:
                deltas = [{"content": delta.text}] if delta.text or logprobs else []
            else:
                deltas = readers[choice.index].deltas(choice.text, finished)
                if logprobs is not None and not deltas:
                    deltas = [{}]
            for i, piece in enumerate(deltas):
                yield chunk(choice.index, piece, logprobs=logprobs if i == 0 else None)
            if finished:
                reason = delta.finish_reason
                if readers[choice.index].has_calls:
                    reason = _finish_with_calls(reason)
                stop = _stop_reason(plan, delta.stop_reason)
                yield chunk(choice.index, {}, finish_reason=reason, stop_reason=stop)
    if include_usage:
        final = chunk(0, {})
        final["choices"] = []
        final["usage"] = usage(runs)
        await _add_reasoning_tokens(ctx, final["usage"], runs, phase)
        yield final
