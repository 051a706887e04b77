"""The OpenAPI document (/openapi.json): what the routes really take and give.

The generation routes read their raw body and validate it themselves (depth limit,
unencodable text, strict types, OpenAI-shaped 400s), so FastAPI cannot see their body
models. Each route instead declares its body here by reference to the pydantic model in
server/protocol.py, and `install_openapi` adds those models' schemas to the document. The
response models below document the JSON the handlers build; tests run schemathesis
against the document, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, RootModel
from pydantic.json_schema import models_json_schema

from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ResponsesRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)

REF = "#/components/schemas/{model}"
REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ResponsesRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer, as OpenAI shapes it."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # With --reasoning-parser (chat).
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: str
    content: str | None
    # The model's thinking, with --reasoning-parser.
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Embedding(BaseModel):
    object: str
    index: int
    # encoding_format "base64": the little-endian float32 bytes, base64-encoded.
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: str
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ResponseObject(BaseModel):
    """A response of /v1/responses (its output items are OpenAI's)."""

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    error: dict[str, Any] | None


class ResponseDeleted(BaseModel):
    id: str
    object: str
    deleted: bool


class ResponseItemList(BaseModel):
    object: str
    data: list[dict[str, Any]]
    has_more: bool
    first_id: str | None
    last_id: str | None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class RenderedPrompt(BaseModel):
    model: str
    token_ids: list[int]


class RenderedPrompts(RootModel[list[RenderedPrompt]]):
    """One per prompt of a completions request."""


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    # The base model of a LoRA adapter; None for the base model itself.
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class ProbeResponse(BaseModel):
    status: str
    reason: str


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "invalid request"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "body too large"),
        (429, "the tenant's concurrency limit"),
        (500, "the engine failed"),
        (503, "not ready, draining, or the queue is full (see Retry-After)"),
    )
}


def route_docs(
    body: type[BaseModel] | None, response: type[BaseModel] | None, stream: bool = False
) -> dict[str, Any]:
    """Keyword arguments for a route decorator: its body (read raw by the handler), its
    JSON response (or SSE stream; plain text when `response` is None) and its errors."""
    ok: dict[str, Any] = {"model": response}
    if response is None:
        ok = {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "OK"}
    if stream:
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
        ok["description"] = "JSON, or server-sent events when `stream` is true"
    docs: dict[str, Any] = {"responses": {200: ok, **ERRORS}}
    if body is not None:
        schema = {"$ref": REF.format(model=body.__name__)}
        docs["openapi_extra"] = {
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}
        }
    return docs


def install_openapi(app: FastAPI) -> None:
    """Mutates the app: its /openapi.json also carries the request models' schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema(
                [(model, "validation") for model in REQUEST_MODELS], ref_template=REF
            )
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(defs["$defs"])
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
