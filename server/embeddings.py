"""POST /v1/embeddings: one prefill-only engine request per input (--task embed).

The engine pools each input (engine.pooling: the last token's final hidden state,
normalised) through the same scheduler as generations; this module checks the inputs,
asks for the `dimensions` the model allows, and shapes OpenAI's answer: floats, or with
`encoding_format: "base64"` the little-endian float32 bytes, base64-encoded.
"""

from __future__ import annotations

import base64
import struct
from contextlib import aclosing
from typing import Any

from engine import PoolingParams, RequestStream, RequestValidationError
from server.completions import prompt_batch
from server.errors import OpenAIError
from server.params import check_token_ids
from server.protocol import EmbeddingRequest
from server.serving import Caller, ServingContext, engine_outputs


async def create_embedding(
    ctx: ServingContext, body: EmbeddingRequest, caller: Caller
) -> dict[str, Any]:
    params = pooling_params(ctx, body)
    inputs = await tokenize_inputs(ctx, body)
    num_tokens = sum(len(ids) for ids in inputs)
    caller.ticket.reserve_tokens(num_tokens, "input")

    def submit(i: int, request_id: str, salt: str | None, labels: dict[str, str]) -> RequestStream:
        return ctx.engine.encode(inputs[i], params, request_id, cache_salt=salt, labels=labels)

    vectors: list[list[float]] = [[] for _ in inputs]
    outputs = engine_outputs(len(inputs), submit, caller, None, body.user)
    async with aclosing(outputs):  # a client that leaves aborts its inputs at once
        async for i, output in outputs:
            assert output.embedding is not None, "an embedding request ends with its embedding"
            vectors[i] = output.embedding
    data = [
        {"object": "embedding", "index": i, "embedding": encode(vector, body.encoding_format)}
        for i, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return {"object": "list", "data": data, "model": ctx.model_name, "usage": usage}


def pooling_params(ctx: ServingContext, body: EmbeddingRequest) -> PoolingParams:
    """The engine's params; a 400 naming `dimensions` where the model cannot give them."""
    pooler = ctx.engine.config.model.pooler
    assert pooler is not None, "the route serves embedding engines only"
    try:
        params = PoolingParams(body.dimensions)
        pooler.check(params)
    except RequestValidationError as exc:
        raise OpenAIError(400, str(exc), exc.param) from None
    return params


async def tokenize_inputs(ctx: ServingContext, body: EmbeddingRequest) -> list[list[int]]:
    """Token ids per input (long texts off the event loop). As OpenAI's, an empty input or
    one longer than the model's context is a 400, never truncated."""
    inputs = []
    for item in prompt_batch(body.input, "input"):
        if not item:
            raise OpenAIError(400, "input must not contain an empty string or list", "input")
        if isinstance(item, str):
            ids = list(await ctx.tokenizer_call(len(item), ctx.tokenizer.encode, item))
        else:
            ids = list(item)
        check_token_ids(ids, ctx.vocab_size, "input")
        if len(ids) > ctx.max_model_len:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {ctx.max_model_len} tokens, however "
                f"you requested {len(ids)} tokens in the input. Please reduce your input.",
                "input",
                code="context_length_exceeded",
            )
        inputs.append(ids)
    return inputs


def encode(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """The vector as the client asked: floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
