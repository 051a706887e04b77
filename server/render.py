"""vLLM's render endpoints: a request's prompt token ids, without generating.

llm-d's endpoint picker calls them (its `token-producer` with a `vllm` backend) to hash a
request's prompt into the same KV blocks the engine reports in its KV events, for precise
prefix-cache routing. The body is a whole completions or chat request, validated as such;
only `token_ids` is read by the picker.
"""

from __future__ import annotations

from typing import Any

from server.chat import chat_prompt, tool_plan
from server.completions import tokenize_prompts
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.serving import ServingContext


async def render_completion(ctx: ServingContext, body: CompletionRequest) -> list[dict[str, Any]]:
    """One object per prompt, as /v1/completions/render answers."""
    return [
        {"model": ctx.model_name, "token_ids": ids}
        for ids in await tokenize_prompts(ctx, body.prompt)
    ]


async def render_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest
) -> dict[str, Any]:
    """The conversation's prompt after the chat template, as /v1/chat/completions/render
    answers (with the tools' definitions, as the completion would render them)."""
    prompt = await chat_prompt(ctx, body, tool_plan(ctx, body))
    return {"model": ctx.model_name, "token_ids": prompt}
