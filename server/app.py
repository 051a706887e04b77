"""create_app: the FastAPI gateway over an AsyncEngine."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import AsyncLLM, LoRARequest
from server import reasoning, responses, tool_parsers
from server.admission import Admission, QueueLimits
from server.body import parse_body
from server.chat import create_chat_completion, render_chat
from server.completions import create_completion, prompt_batch
from server.dashboard import add_dashboard_routes
from server.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected, cancel_on_disconnect
from server.embeddings import create_embedding
from server.errors import OpenAIError, error_body
from server.lora import LoRARegistry
from server.metrics import ServerMetrics
from server.middleware import GatewayMiddleware
from server.openapi import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    EmbeddingResponse,
    ModelList,
    ProbeResponse,
    RenderedPrompt,
    RenderedPrompts,
    TokenizeResponse,
    VersionResponse,
    install_openapi,
    route_docs,
)
from server.params import check_token_ids
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from server.render import render_chat_completion, render_completion
from server.serving import ServingContext, admit, sse_events
from server.settings import AppState, Phase, ServerSettings

logger = logging.getLogger("pagedserve.server")
# How long shutdown waits for the engine's step in flight.
ENGINE_STOP_TIMEOUT_S = 0.5
Body = TypeVar("Body", bound=BaseModel)
T = TypeVar("T")


def package_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "0+unknown"


def in_daemon_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """fn() on a daemon thread of its own, as a future of this loop. Unlike asyncio.to_thread,
    whose executor threads the interpreter joins on exit, it lets the process exit while fn
    still runs: a shutdown signal during a minutes-long model load exits at once."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():  # not cancelled meanwhile
            outcome()

    def run() -> None:
        outcome: Callable[[], None]
        try:
            outcome = functools.partial(future.set_result, fn())
        except BaseException as exc:  # handed to the awaiting task, which decides
            outcome = functools.partial(future.set_exception, exc)
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop has closed: the server exited while fn ran
            logger.info("the server exited before %s finished", getattr(fn, "__name__", fn))

    threading.Thread(target=run, name="pagedserve-load", daemon=True).start()
    return future


def create_app(
    engine: AsyncLLM | Callable[[], AsyncLLM],
    settings: ServerSettings,
    frontend_index: int | None = None,
) -> FastAPI:
    """Builds the gateway over an engine that is not started yet, or over a loader run in a
    thread at startup (the server answers probes, with /ready at 503, while it loads).
    `frontend_index`: which of several frontends (API server processes) this one is; only
    frontend 0 publishes the engine's own metrics."""
    state = AppState(settings)

    def attach(loaded: AsyncLLM) -> None:
        model_name = settings.served_model_name or loaded.config.model.name
        metrics = ServerMetrics(
            model_name,
            log_requests=settings.log_requests,
            tenant_metrics=settings.tenant_metrics,
            engine_stats=frontend_index in (None, 0),
            engine_pid=loaded.engine_pid,
        )
        cache, scheduler = loaded.config.cache, loaded.config.scheduler
        metrics.set_cache_config(cache.block_size, cache.num_blocks, cache.enable_prefix_caching)
        if loaded.config.speculative is not None:
            metrics.set_speculative(loaded.config.speculative.num_speculative_tokens)
        if loaded.config.lora is not None and metrics.engine_stats:
            metrics.set_lora(loaded.config.lora.max_loras)
        limits = QueueLimits.resolve(
            settings.max_num_queued_reqs,
            settings.max_num_queued_tokens,
            scheduler.max_num_seqs,
            scheduler.max_num_batched_tokens,
            scheduler.max_model_len,
        )
        admission = Admission(loaded, limits, metrics.count_rejection)
        # What the load left (the model, the tokenizer, the imports: some 340k objects) lives
        # as long as the server does; a full garbage collection walked all of it, 250 ms in
        # which the event loop streamed nothing. Frozen, the collector skips it (vLLM does
        # the same after its engine starts).
        gc.collect()
        gc.freeze()
        loaded.start(metrics.record)
        template = settings.chat_template or getattr(loaded.tokenizer, "chat_template", None)
        loras = LoRARegistry(
            loaded,
            model_name,
            runtime_updates=frontend_index is None,
            why_not="this server runs several API server processes (--api-server-count), "
            "and only one would see it",
        )
        state.serving = ServingContext(
            loaded,
            model_name,
            metrics,
            admission,
            loras,
            chat_template=settings.chat_template,
            tool_format=tool_parsers.resolve(settings.tool_call_parser, template, loaded.tokenizer),
            tools_refusal=tool_parsers.refusal(settings.tool_call_parser, template),
            reasoning=None
            if settings.reasoning_parser is None
            else reasoning.FORMATS[settings.reasoning_parser],
        )
        state.phase = Phase.READY
        logger.info("ready: serving %s", model_name)

    async def load(loader: Callable[[], AsyncLLM]) -> None:
        try:
            attach(await in_daemon_thread(loader))
        except Exception as exc:
            logger.exception("model loading failed")
            state.load_error = exc
            state.phase = Phase.FAILED

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = None
        if isinstance(engine, AsyncLLM):
            attach(engine)
        else:
            loading = asyncio.create_task(load(engine))
        yield
        if loading is not None:
            loading.cancel()
        if state.serving is not None:
            try:  # a step that hangs (a stalled device) must not hold up the exit
                await asyncio.wait_for(state.serving.engine.stop(), ENGINE_STOP_TIMEOUT_S)
            except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
                logger.warning("the engine's step did not finish; exiting without it")
            state.serving.close()
            gc.unfreeze()
        await state.responses.close()

    app = FastAPI(title="pagedserve", version=package_version(), lifespan=lifespan)
    app.state.gateway = state
    app.add_middleware(GatewayMiddleware, state=state)
    _install_error_handlers(app)
    _add_routes(app, state)
    if not settings.disable_dashboard:
        add_dashboard_routes(app, state)
    install_openapi(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {exc!r}"), status_code=500)


async def parse(request: Request, model: type[Body]) -> Body:
    return parse_body(await request.body(), model)


async def respond(
    request: Request,
    work: Coroutine[Any, Any, dict[str, Any] | AsyncIterator[dict[str, Any]]],
) -> Response:
    """Runs a generation endpoint's work, cancelled if the client leaves before the
    response starts; a stream then watches the connection itself."""
    result = await cancel_on_disconnect(request.receive, work)
    if isinstance(result, dict):
        return JSONResponse(result)
    return EventSourceResponse(sse_events(result), ping=15)


def _add_routes(app: FastAPI, state: AppState) -> None:
    def serving() -> ServingContext:
        if state.serving is None:
            raise OpenAIError(503, f"the server is not ready ({state.phase.value})")
        return state.serving

    def check_model(ctx: ServingContext, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for an unknown name."""
        return ctx.loras.resolve(model)

    responses.add_routes(app, state.responses, serving, check_model)

    @app.post("/v1/completions", **route_docs(CompletionRequest, CompletionResponse, True))
    async def completions(request: Request) -> Any:
        ctx = serving()
        body = await parse(request, CompletionRequest)
        lora = check_model(ctx, body.model)
        ctx.require_task("generate")
        caller = admit(request, ctx, len(prompt_batch(body.prompt)) * (body.n or 1), lora)
        return await respond(request, create_completion(ctx, body, caller))

    @app.post(
        "/v1/chat/completions", **route_docs(ChatCompletionRequest, ChatCompletionResponse, True)
    )
    async def chat_completions(request: Request) -> Any:
        ctx = serving()
        body = await parse(request, ChatCompletionRequest)
        lora = check_model(ctx, body.model)
        ctx.require_task("generate")
        caller = admit(request, ctx, body.n or 1, lora)
        return await respond(request, create_chat_completion(ctx, body, caller))

    @app.post("/v1/embeddings", **route_docs(EmbeddingRequest, EmbeddingResponse))
    async def embeddings(request: Request) -> Any:
        ctx = serving()
        body = await parse(request, EmbeddingRequest)
        check_model(ctx, body.model)
        ctx.require_task("embed")
        caller = admit(request, ctx, len(prompt_batch(body.input, "input")))
        return await respond(request, create_embedding(ctx, body, caller))

    def render_route(path: str, model: type[Body], response: type[BaseModel], render: Any) -> None:
        """vLLM's render endpoints, for llm-d's endpoint picker (server/render.py)."""

        @app.post(path, **route_docs(model, response))
        async def rendered(request: Request) -> Any:
            ctx = serving()
            body = await parse(request, model)
            check_model(ctx, body.model)  # type: ignore[attr-defined]
            return await render(ctx, body)

    render_route("/v1/completions/render", CompletionRequest, RenderedPrompts, render_completion)
    render_route(
        "/v1/chat/completions/render", ChatCompletionRequest, RenderedPrompt, render_chat_completion
    )

    @app.get("/v1/models", **route_docs(None, ModelList))
    async def models() -> dict[str, Any]:
        ctx = serving()
        card = {
            "id": ctx.model_name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "pagedserve",
            "root": ctx.model_name,
            "parent": None,
            "max_model_len": ctx.max_model_len,
        }
        adapters = ctx.loras.model_cards(int(state.started), ctx.max_model_len)
        return {"object": "list", "data": [card, *adapters]}

    @app.post("/v1/load_lora_adapter", **route_docs(LoadLoRAAdapterRequest, None))
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        ctx = serving()
        body = await parse(request, LoadLoRAAdapterRequest)
        return PlainTextResponse(await ctx.loras.load(body))

    @app.post("/v1/unload_lora_adapter", **route_docs(UnloadLoRAAdapterRequest, None))
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        ctx = serving()
        body = await parse(request, UnloadLoRAAdapterRequest)
        return PlainTextResponse(await ctx.loras.unload(body))

    @app.post("/tokenize", **route_docs(TokenizeRequest, TokenizeResponse))
    async def tokenize(request: Request) -> dict[str, Any]:
        ctx = serving()
        body = await parse(request, TokenizeRequest)
        check_model(ctx, body.model)
        if body.messages is not None:
            ids = await render_chat(ctx, body.messages, body.add_generation_prompt is not False)
        else:
            add_special = body.add_special_tokens is not False
            encode = functools.partial(ctx.tokenizer.encode, add_special_tokens=add_special)
            ids = list(await ctx.tokenizer_call(len(body.prompt), encode, body.prompt))
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize", **route_docs(DetokenizeRequest, DetokenizeResponse))
    async def detokenize(request: Request) -> dict[str, Any]:
        ctx = serving()
        body = await parse(request, DetokenizeRequest)
        check_model(ctx, body.model)
        check_token_ids(body.tokens, ctx.vocab_size, "tokens")
        text = await ctx.tokenizer_call(len(body.tokens), ctx.tokenizer.decode, body.tokens)
        return {"prompt": text}

    @app.get("/version", **route_docs(None, VersionResponse))
    async def get_version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/health", **route_docs(None, ProbeResponse))
    async def health() -> Response:
        alive, reason = state.liveness()
        return JSONResponse(
            {"status": "ok" if alive else "unhealthy", "reason": reason}, 200 if alive else 503
        )

    @app.get("/ready", **route_docs(None, ProbeResponse))
    async def ready() -> Response:
        ok, reason = state.readiness()
        return JSONResponse(
            {"status": "ready" if ok else "not ready", "reason": reason}, 200 if ok else 503
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        if state.serving is None:
            return PlainTextResponse("", media_type=CONTENT_TYPE_LATEST)
        return Response(state.serving.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
