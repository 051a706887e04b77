"""OpenAI request bodies, validated once at the edge.

Unknown fields are rejected (extra="forbid"), as OpenAI's own API does. A known field that
we do not implement is rejected when it is set to anything but its default; null always
counts as absent. Types are strict: `"n": 17.0` and `"stream": "yes"` are 400s, not
silently converted, and floats must be finite.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.errors import OpenAIError
from server.messages import ChatMessage, check_messages
from server.structured import ResponseFormat, StructuredOutputFields
from server.tools import Tool, ToolChoice


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


def _unsupported(body: BaseModel, defaults: dict[str, Any]) -> None:
    for name, allowed in defaults.items():
        value = getattr(body, name)
        if value is not None and value not in allowed:
            raise OpenAIError(400, f"`{name}` is not supported by this server", param=name)


class SamplingFields(StructuredOutputFields, _Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(
                400, "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise OpenAIError(
                400,
                "continuous_usage_stats is not supported",
                "stream_options.continuous_usage_stats",
            )
        self.check_removed_fields()
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> CompletionRequest:
        _unsupported(self, {"best_of": (1,), "suffix": ("",)})
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # Known OpenAI fields that we do not implement: rejected unless default.
    functions: list[Any] | None = None
    function_call: Any | None = None
    audio: Any | None = None
    modalities: list[str] | None = None
    prediction: Any | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    web_search_options: Any | None = None
    # Chat-template controls (vLLM extensions).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> ChatCompletionRequest:
        _unsupported(
            self,
            {
                "functions": ([],),
                "function_call": ("none",),
                "audio": (),
                "modalities": (["text"],),
                "prediction": (),
                "reasoning_effort": (),
                "service_tier": ("auto", "default"),
                "store": (False,),
                "metadata": (),  # only meaningful with store
                "web_search_options": (),
            },
        )
        check_messages(self.messages)
        if self.response_format is not None and self.structured_outputs is not None:
            raise OpenAIError(
                400, "set response_format or structured_outputs, not both", "structured_outputs"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise OpenAIError(
                400, "set max_tokens or max_completion_tokens, not both", "max_completion_tokens"
            )
        if self.continue_final_message and self.add_generation_prompt:
            raise OpenAIError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        return self


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise OpenAIError(400, "give exactly one of prompt or messages", "prompt")
        if self.messages is not None:
            check_messages(self.messages)
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings: `input` is a text, texts, token ids or lists of them."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    # Matryoshka truncation, where the model declares it (engine.pooling).
    dimensions: int | None = Field(default=None, ge=1)
    encoding_format: Literal["float", "base64"] | None = None
    user: str | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses: server/responses.py reads the items and turns them into a chat
    request, which checks the rest."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    # Known fields that this server does not implement: rejected unless default.
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    stream_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> ResponsesRequest:
        _unsupported(
            self,
            {
                "truncation": ("disabled",),
                "include": ([],),
                "service_tier": ("auto", "default"),
                "top_logprobs": (0,),
                "max_tool_calls": (),
                "prompt": (),
                "conversation": (),
                "prompt_cache_key": (),
                "stream_options": (),
            },
        )
        if self.background and self.store is False:
            raise OpenAIError(400, "background responses must be stored (store: true)", "store")
        if self.background and self.stream:
            raise OpenAIError(400, "streaming a background response is not supported", "stream")
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise OpenAIError(400, "input is empty", "input")
        return self


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/load_lora_adapter (server/lora.py)."""

    lora_name: str
    lora_path: str
    # Replace an adapter already served under this name (with a new id).
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/unload_lora_adapter; the name alone says which."""

    lora_name: str
    lora_int_id: int | None = None
