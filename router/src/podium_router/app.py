"""The router's FastAPI app: ``create_app(settings)``; no global state.

    POST /v1/chat/completions, /v1/completions   routed (proxy.py), ahead of FastAPI (RouterApp)
    GET  /v1/models                              the models the healthy replicas serve, LoRA adapters
                                                 too (``parent``: their base model)
    GET  /health                                 200 while some replica is in routing, else 503
    GET  /metrics                                Prometheus (metrics.py)
    GET  /admin/replicas                         the replica set and what the router knows of each
    POST /admin/replicas {"url", "name"?}        add a replica
    DELETE /admin/replicas?url=URL               drain a replica, then drop it

With an API key, everything but ``/health`` and ``/metrics`` needs ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from . import __version__
from .metrics import RouterMetrics
from .policy import Router
from .pool import ReplicaPool
from .proxy import Proxy, error_response
from .settings import ReplicaFile, ReplicaSpec, RouterSettings
from .upstream import Upstream

logger = logging.getLogger("podium_router")
_OPEN_PATHS = ("/health", "/metrics")
_PROXIED = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# idle connections to a replica dropped after 2 s: before any replica's server closes them (uvicorn's
# default keep-alive is 5 s), so a reused connection is never one the replica just closed
_KEEPALIVE_S = 2.0


def create_app(settings: RouterSettings, on_start=None) -> FastAPI:
    """``on_start(pool)``: called in the lifespan once the pool exists (``podium fleet`` feeds it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512, keepalive_expiry=_KEEPALIVE_S)
        upstream = Upstream(settings.connect_timeout_s, settings.request_timeout_s, _KEEPALIVE_S)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0)) as client:
            pool = ReplicaPool(settings, client)
            metrics = RouterMetrics()
            metrics.watch(lambda: list(pool.replicas))
            app.state.pool = pool
            app.state.proxy = Proxy(pool, Router(settings.policy, settings.default_prefill_rate,
                                                 settings.decode_cap), metrics, upstream)
            app.state.metrics = metrics
            for spec in settings.replicas:
                pool.add(spec)
            tasks = []
            if settings.replica_file is not None:
                tasks.append(asyncio.ensure_future(_watch_file(pool, ReplicaFile(settings.replica_file))))
            if on_start is not None:
                tasks.append(asyncio.ensure_future(on_start(pool)))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await pool.close()
                await upstream.close()

    app = RouterApp(settings.api_key, title="Podium router", version=__version__, lifespan=lifespan)
    app.add_middleware(KeyMiddleware, api_key=settings.api_key)
    _add_routes(app)
    return app


class RouterApp(FastAPI):
    """FastAPI, but a POST to a proxied path goes straight to the proxy (after the key check): a
    streamed chunk then costs one ``send`` to the server, not a trip through a response class and
    every middleware. Everything else is FastAPI's."""

    def __init__(self, api_key: str | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._key = _expected_authorization(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = _PROXIED.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await super().__call__(scope, receive, send)
        elif not _authorized(scope, self._key):
            await _refuse(scope, receive, send)
        elif scope["method"] != "POST":  # as an OpenAI server answers: the path exists, for POST only
            response = error_response(405, f"{scope['method']} is not allowed on {scope['path']}; send a POST",
                                      "method_not_allowed", {"Allow": "POST"})
            await response(scope, receive, send)
        else:
            await self.state.proxy.serve(scope, receive, send, endpoint)


async def _watch_file(pool: ReplicaPool, watched: ReplicaFile) -> None:
    """Reread the replica file when it changes; a bad version is logged and the last good one kept."""
    while True:
        if watched.changed():
            try:
                pool.sync(watched.read(), "file")
            except (OSError, ValueError) as exc:
                logger.error("replica file %s: %s (keeping the replicas it listed before)", watched.path, exc)
        await asyncio.sleep(pool.settings.poll_interval_s)


def _add_routes(app: FastAPI) -> None:
    async def models(request: Request) -> JSONResponse:
        pool: ReplicaPool = request.app.state.pool
        cards: dict[str, dict] = {}
        for replica in pool.replicas:
            if not replica.routable:
                continue
            if replica.is_podium:
                model, max_len = replica.report.get("model"), replica.report.get("max_model_len")
                cards.setdefault(model, {"id": model, "object": "model", "owned_by": "podium", "root": model,
                                         "max_model_len": max_len})
                for name, adapter in replica.adapters.items():  # as the replica's own /v1/models lists them
                    cards.setdefault(name, {"id": name, "object": "model", "owned_by": "podium",
                                            "root": adapter.get("path"), "parent": model, "max_model_len": max_len})
                continue
            try:
                listed = (await pool.client.get(f"{replica.url}/v1/models", timeout=5.0)).json().get("data", [])
            except (httpx.HTTPError, ValueError):
                continue
            for card in listed:
                cards.setdefault(card.get("id"), card)
        return JSONResponse({"object": "list", "data": list(cards.values())})

    async def health(request: Request) -> Response:
        healthy = sum(r.routable for r in request.app.state.pool.replicas)
        if not healthy:
            return error_response(503, "no replica is healthy", "no_healthy_replica")
        return JSONResponse({"status": "ok", "healthy_replicas": healthy})

    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def list_replicas(request: Request) -> JSONResponse:
        return JSONResponse({"replicas": [r.describe() for r in request.app.state.pool.replicas]})

    async def add_replica(request: Request) -> Response:
        try:
            data = await request.json()
            spec = ReplicaSpec(str(data["url"]), str(data.get("name", "")))
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"give {{'url': 'http://host:port', 'name': optional}}: {exc}")
        replica = request.app.state.pool.add(spec, "admin")
        return JSONResponse(replica.describe(), status_code=201)

    async def remove_replica(request: Request, url: str) -> Response:
        replica = request.app.state.pool.remove(url)
        if replica is None:
            return error_response(404, f"no replica {url!r}; GET /admin/replicas lists them")
        return JSONResponse(replica.describe())

    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/admin/replicas", list_replicas, methods=["GET"])
    app.add_api_route("/admin/replicas", add_replica, methods=["POST"])
    app.add_api_route("/admin/replicas", remove_replica, methods=["DELETE"])


class KeyMiddleware:
    """``Authorization: Bearer KEY`` on everything but the open paths, compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self._key = _expected_authorization(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS or _authorized(scope, self._key):
            await self.app(scope, receive, send)
        else:
            await _refuse(scope, receive, send)


def _expected_authorization(api_key: str | None) -> bytes | None:
    return f"Bearer {api_key}".encode() if api_key else None


def _authorized(scope: Scope, key: bytes | None) -> bool:
    """No key set, or the request's ``Authorization`` is it (compared in constant time)."""
    return key is None or hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), key)


async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
    response = error_response(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                              "invalid_api_key", {"WWW-Authenticate": "Bearer"})
    await response(scope, receive, send)
