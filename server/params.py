"""From validated request bodies to engine SamplingParams, with OpenAI-shaped 400s."""

from __future__ import annotations

from engine import (
    RequestOutputKind,
    RequestValidationError,
    SamplingParams,
    StructuredOutputsParams,
)
from server.errors import OpenAIError
from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(400, f"token id {bad[0]} is out of range [0, {vocab_size})", param)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    needed = prompt_len + (max_tokens or 1)
    if prompt_len == 0:
        raise OpenAIError(400, "the prompt is empty", "prompt")
    if needed > max_model_len:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {needed} tokens ({prompt_len} in the prompt, {needed - prompt_len} "
            "for the completion). Please reduce the length of the prompt or the completion.",
            "messages" if max_tokens is None else "max_tokens",
            code="context_length_exceeded",
        )


def _logit_bias(body: SamplingFields, vocab_size: int) -> dict[int, float] | None:
    if not body.logit_bias:
        return None
    bias: dict[int, float] = {}
    for key, value in body.logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise OpenAIError(
                400, f"logit_bias key {key!r} is not a token id", "logit_bias"
            ) from None
        check_token_ids([token_id], vocab_size, "logit_bias")
        bias[token_id] = value
    return bias


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    max_model_len: int,
    vocab_size: int,
    constraint: StructuredOutputsParams | None = None,
    extra_stop: tuple[str, ...] = (),
    keep_special_tokens: bool = False,
) -> SamplingParams:
    """Validates every sampling field; the first bad one becomes a 400 naming it. Streams get
    DELTA outputs, other requests one final output. `constraint` and `extra_stop` come from
    the request's other fields (response_format, tools); `keep_special_tokens` (a tool
    format whose markers are special tokens) makes skip_special_tokens default to false."""
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    check_context(prompt_len, max_tokens, max_model_len)
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    if body.stop_token_ids:
        check_token_ids(body.stop_token_ids, vocab_size, "stop_token_ids")
    fields = {
        "n": body.n,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": False
        if body.skip_special_tokens is None and keep_special_tokens
        else body.skip_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "stop": _stop(body.stop, extra_stop),
        "stop_token_ids": body.stop_token_ids,
    }
    given = {k: v for k, v in fields.items() if v is not None}
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(
            **given,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(body, vocab_size),
            structured_outputs=constraint,
            output_kind=kind,
        )
    except RequestValidationError as exc:
        raise OpenAIError(400, str(exc), _openai_param(body, exc.param)) from None


def _stop(stop: str | list[str] | None, extra: tuple[str, ...]) -> list[str] | None:
    given = [stop] if isinstance(stop, str) else list(stop or [])
    return given + list(extra) if given or extra else None


def _openai_param(body: CompletionRequest | ChatCompletionRequest, param: str | None) -> str | None:
    """The request field behind an engine parameter, as this endpoint names it."""
    if isinstance(body, ChatCompletionRequest):
        if param == "logprobs":
            return "top_logprobs"
        if param == "max_tokens" and body.max_tokens is None:
            return "max_completion_tokens"
    return param
