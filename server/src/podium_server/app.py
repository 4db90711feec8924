"""The FastAPI app: ``create_app(settings, engine=None)``; no global state, several apps may coexist.

The lifespan launches the engine if none was given (off the event loop; in a thread or a child
process, as ``settings.engine_mode`` says), starts it and the handlers, and on shutdown stops it
after uvicorn has let in-flight requests end. ``podium serve`` drains on SIGTERM first (drain.py):
``drain_and_stop(app, stop_server)`` starts it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import podium

from . import __version__
from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .async_engine import AsyncEngine
from .audit import AuditLog
from .drain import Drain
from .errors import APIError, install_error_handlers, logger
from .json_limits import JsonLimits
from .logprobs import TokenText
from .logs import configure_logging
from .metrics import OPENMETRICS, ServerMetrics
from .middleware import GuardMiddleware
from .openapi import declare_request_bodies
from .process_engine import ProcessEngine
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from .replica import KVEventLog, add_replica_routes
from .service_middleware import ServiceMiddleware, TenantMetrics
from .serving_base import ServerContext
from .serving_chat import ChatHandler
from .serving_completions import CompletionsHandler
from .serving_embeddings import EmbeddingsHandler
from .serving_lora import LoRAAdaptersHandler
from .serving_messages import CountTokensHandler, MessagesHandler
from .serving_responses import ResponsesHandler, ResponsesRequest
from .serving_tokens import DetokenizeHandler, TokenizeHandler
from .settings import ServerSettings
from .tenants import TenantRegistry
from .thread_engine import ThreadEngine


def build_engine(settings: ServerSettings, own_process: bool = False) -> Any:
    """The engine, with the LoRA adapters of ``--lora-modules`` loaded; in its own process (spawned:
    no logging set up) its log lines go to stderr too."""
    from podium.engine import LLMEngine

    if own_process:
        configure_logging(settings.log_level)
    engine = LLMEngine(settings.engine)
    try:
        for name, path in settings.lora_modules:
            engine.load_lora(name, path)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def launch_engine(settings: ServerSettings) -> AsyncEngine:
    """The engine of ``settings``, built and ready to start (blocking: loads the model)."""
    if settings.engine_mode == "process":
        return ProcessEngine.launch(functools.partial(build_engine, settings, own_process=True))
    return ThreadEngine(build_engine(settings))


def _context(engine: AsyncEngine, settings: ServerSettings) -> ServerContext:
    info = engine.info
    aliases = frozenset({settings.engine.model, info.model})
    return ServerContext(engine=engine, model_name=info.model_name, model_aliases=aliases,
                         max_model_len=info.max_model_len, tokenizer=info.tokenizer,
                         token_text=TokenText(info.tokenizer), tool_call_parser=settings.tool_call_parser,
                         auto_tool_choice=settings.enable_auto_tool_choice, reasoning_parser=settings.reasoning_parser)


def create_app(settings: ServerSettings | None = None, engine: Any = None) -> FastAPI:
    """An app serving ``engine``: an ``AsyncEngine`` not started yet (``launch_engine``), an
    ``LLMEngine`` (served from a thread), or None: launched from ``settings`` at startup."""
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is None:
            served = await asyncio.to_thread(launch_engine, settings)
        else:
            served = engine if isinstance(engine, AsyncEngine) else ThreadEngine(engine)
        app.state.drain.attach(asyncio.get_running_loop())
        metrics = ServerMetrics(served.info.model_name, compat=settings.metrics_compat,
                                max_model_len=served.info.max_model_len)
        metrics.registry.register(tenant_metrics)
        ctx = _context(served, settings)
        metrics.watch_engine(lambda: ctx.engine.stats)
        app.state.ctx, app.state.metrics, app.state.kv_log = ctx, metrics, KVEventLog()
        served.on_kv_events = app.state.kv_log.append
        app.state.handlers = {"completions": CompletionsHandler(ctx), "chat": ChatHandler(ctx),
                              "tokenize": TokenizeHandler(ctx), "detokenize": DetokenizeHandler(ctx),
                              "embeddings": EmbeddingsHandler(ctx),
                              "messages": MessagesHandler(ctx), "count_tokens": CountTokensHandler(ctx),
                              "responses": ResponsesHandler(ctx), "lora": LoRAAdaptersHandler(ctx)}
        ctx.engine.start(metrics)
        try:
            yield
        finally:
            if ctx.engine.num_open_requests:
                logger.info("aborting %d requests still open at shutdown", ctx.engine.num_open_requests)
            await ctx.engine.stop()
            if audit is not None:
                audit.close()

    app = FastAPI(title="Podium", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API of the Podium inference engine")
    app.state.drain = Drain(settings.shutdown_timeout)
    limits = JsonLimits(settings.max_json_depth, settings.max_json_string_chars, settings.max_json_array_items)
    # with a keys file the service middleware checks every key (--api-key among them); the guard
    # (drain, body size, JSON limits) runs inside it, so its refusals carry a request id and are audited
    guard_key = None if settings.api_keys_file else settings.api_key
    app.add_middleware(GuardMiddleware, api_key=guard_key, max_body_bytes=settings.max_request_bytes,
                       json_limits=limits, drain=app.state.drain)
    tenants = TenantRegistry(settings.api_keys_file, settings.api_key if settings.api_keys_file else None)
    audit = AuditLog(settings.audit) if settings.audit is not None else None
    tenant_metrics = TenantMetrics()
    app.add_middleware(ServiceMiddleware, tenants=tenants, audit=audit, metrics=tenant_metrics,
                       json_limits=limits)
    if settings.allowed_origins:  # outermost, so refusals (401, 413, 429) carry the CORS headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers))
    install_error_handlers(app)
    _add_routes(app)
    add_replica_routes(app)
    return app


def drain_and_stop(app: FastAPI, stop_server) -> bool:
    """SIGTERM (from a signal handler): drain the app (drain.py), then call ``stop_server``.
    False if the app never started (nothing to drain)."""
    ctx = getattr(app.state, "ctx", None)
    if ctx is None:
        return False
    def stop() -> None:
        app.state.kv_log.wake()  # a router's long poll answers now, not after its timeout
        asyncio.ensure_future(ctx.engine.stop())  # nothing is in flight: stop the engine while uvicorn stops
        stop_server()

    return app.state.drain.begin_threadsafe(ctx.engine.end_open_requests, stop)


def _add_routes(app: FastAPI) -> None:
    def ctx_of(request: Request) -> ServerContext:
        return request.app.state.ctx

    async def completions(request: Request) -> Response:
        return await request.app.state.handlers["completions"].handle(request)

    async def chat(request: Request) -> Response:
        return await request.app.state.handlers["chat"].handle(request)

    async def embeddings(request: Request) -> Response:
        return await request.app.state.handlers["embeddings"].handle(request)

    async def tokenize(request: Request) -> Response:
        return await request.app.state.handlers["tokenize"].handle(request)

    async def detokenize(request: Request) -> Response:
        return await request.app.state.handlers["detokenize"].handle(request)

    def handled_by(name: str):
        async def route(request: Request) -> Response:
            return await request.app.state.handlers[name].handle(request)
        return route

    async def models(request: Request) -> ModelList:
        ctx = ctx_of(request)
        base = ModelCard(id=ctx.model_name, root=ctx.engine.info.model, max_model_len=ctx.max_model_len)
        return ModelList(data=[base, *request.app.state.handlers["lora"].cards()])

    async def model(request: Request, model_id: str) -> ModelCard:
        ctx = ctx_of(request)
        adapter = next((c for c in request.app.state.handlers["lora"].cards() if c.id == model_id), None)
        if adapter is not None:
            return adapter
        if model_id != ctx.model_name and model_id not in ctx.model_aliases:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return ModelCard(id=model_id, root=ctx.engine.info.model, max_model_len=ctx.max_model_len)

    async def load_lora(request: Request) -> Response:
        return await request.app.state.handlers["lora"].load(request)

    async def unload_lora(request: Request) -> Response:
        return await request.app.state.handlers["lora"].unload(request)

    async def health(request: Request) -> Response:
        engine = ctx_of(request).engine
        if not engine.alive:
            return APIError(503, "the engine loop is not running", code="engine_dead").response()
        if request.app.state.drain.draining:  # up, but leaving: a load balancer or router stops sending
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok"})

    async def version() -> dict:
        return {"version": __version__, "podium": podium.__version__}

    async def metrics(request: Request) -> Response:
        if "application/openmetrics-text" in request.headers.get("accept", ""):  # with exemplars (request ids)
            return Response(request.app.state.metrics.render(openmetrics=True), media_type=OPENMETRICS)
        return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    app.add_api_route("/v1/messages", handled_by("messages"), methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", handled_by("count_tokens"), methods=["POST"])
    app.add_api_route("/v1/responses", handled_by("responses"), methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/load_lora_adapter", load_lora, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload_lora, methods=["POST"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    declare_request_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                                 "/v1/embeddings": EmbeddingRequest, "/tokenize": TokenizeRequest,
                                 "/detokenize": DetokenizeRequest,
                                 "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest,
                                 "/v1/responses": ResponsesRequest,
                                 "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
                                 "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest})
