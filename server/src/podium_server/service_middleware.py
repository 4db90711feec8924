"""Running the API as a shared service: request ids, tenants and their limits, the audit log.

One plain ASGI middleware, outermost, so even a refusal (401, 413, 429; the guard's drain 503 and
JSON-limit 400) carries an id and is audited. For each HTTP request it

1. takes the client's ``X-Request-Id`` or makes one, and returns it as a response header;
2. on the API paths, with ``--api-keys-file``: finds the tenant of the key (401 if none); a POST
   (the requests that make the engine work) also asks the tenant's limits (429 with ``Retry-After``
   in OpenAI's error shape if over one). GETs (models, a router's polls of the replica report) are
   authenticated only, neither limited nor audited;
3. lets the request run with a ``CallContext`` the handlers read (``current_call``): the tenant
   reaches the engine's fair share and its ``max_tokens`` limit, and the engine streams the
   handler adds are noted, for the token counts;
4. when the response is sent: gives the tenant's concurrency slot back, counts its tokens, the
   per-tenant metrics, and writes the audit line.

The context is a ``ContextVar`` set for the request's task only: it is how one request's
identity reaches the handler code shared by every endpoint, without each handler passing it on.
"""

from __future__ import annotations

import json
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from podium.pooling_params import PoolingParams
from podium.tenant import Tenant

from .audit import AuditLog, AuditRecord
from .errors import APIError
from .json_limits import JsonLimits, json_depth
from .request_id import current_request_id, request_id_from
from .tenants import Rejection, TenantPolicy, TenantRegistry

OPEN_PATHS = ("/health", "/version", "/metrics", "/ping")


@dataclass
class CallContext:
    """What the service knows of the HTTP request being served."""

    request_id: str
    tenant: TenantPolicy | None = None  # None: no keys file (everyone is the engine's default tenant)
    streams: list = field(default_factory=list)  # the engine requests its handler added (RequestStream)


current_call: ContextVar[CallContext | None] = ContextVar("podium_call", default=None)


def engine_tenant(call: CallContext | None, params: list) -> Tenant | None:
    """The engine's view of the call's tenant (None: the default tenant); applies the tenant's
    max_tokens limit to ``params`` (unset: clamped to it; larger: refused with a 400); an embedding
    request's ``PoolingParams`` generate no tokens and have no such limit."""
    if call is None or call.tenant is None:
        return None
    policy = call.tenant
    if policy.max_tokens is not None:
        for p in params:
            if isinstance(p, PoolingParams):
                continue
            if p.max_tokens is None:
                p.max_tokens = policy.max_tokens
            elif p.max_tokens > policy.max_tokens:
                raise APIError(400, f"max_tokens is {p.max_tokens}, but tenant {policy.name!r} may ask at most "
                                    f"{policy.max_tokens}", param="max_tokens", code="max_tokens_exceeded")
    return Tenant(policy.name, policy.weight)


class TenantMetrics(Collector):
    """Per-tenant counters (tenant names only, never keys), collected into the app's /metrics."""

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.requests = Counter("podium:tenant_requests", "API requests by tenant and HTTP status",
                                ["tenant", "status"], registry=reg)
        self.prompt_tokens = Counter("podium:tenant_prompt_tokens", "Prompt tokens by tenant", ["tenant"], registry=reg)
        self.generation_tokens = Counter("podium:tenant_generation_tokens", "Generated tokens by tenant", ["tenant"],
                                         registry=reg)
        self.rejections = Counter("podium:tenant_rejections", "Requests refused with 429, by tenant and limit",
                                  ["tenant", "reason"], registry=reg)

    def collect(self):
        return self.registry.collect()


class ServiceMiddleware:
    def __init__(self, app: ASGIApp, tenants: TenantRegistry, audit: AuditLog | None,
                 metrics: TenantMetrics, json_limits: JsonLimits | None = None) -> None:
        self.app, self.tenants, self.audit, self.metrics = app, tenants, audit, metrics
        self.json_limits = json_limits or JsonLimits()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope["headers"])
        id_token = current_request_id.set(request_id)
        status = 500  # if the app fails before it answers
        id_header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), id_header]}
            await send(message)

        try:
            if scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
                await self.app(scope, receive, send_with_id)
            else:
                await self._serve_api(scope, receive, send_with_id, request_id, lambda: status)
        finally:
            current_request_id.reset(id_token)

    async def _serve_api(self, scope: Scope, receive: Receive, send: Send, request_id: str, status) -> None:
        arrival, started = time.time(), time.perf_counter()
        call = CallContext(request_id)
        work = scope["method"] == "POST"  # limited and audited; GETs are authenticated only
        body = bytearray() if work and self.audit is not None and self.audit.content else None
        error = self._check_tenant(scope, call, limit=work)
        try:
            if error is not None:
                await _send_error(send, error)
                return
            token = current_call.set(call)
            try:
                await self.app(scope, _recording(receive, body) if body is not None else receive, send)
            finally:
                current_call.reset(token)
        finally:
            if work:
                self._account(call, admitted=error is None, status=status())
                if self.audit is not None:
                    self._audit(scope, call, arrival, time.perf_counter() - started, status(), body)

    def _account(self, call: CallContext, admitted: bool, status: int) -> None:
        """The tenant's concurrency slot back, its tokens counted, its metrics."""
        if call.tenant is None:
            return
        name, tokens = call.tenant.name, _tokens(call.streams)
        if admitted:
            self.tenants.done(call.tenant, sum(tokens))
            self.metrics.prompt_tokens.labels(name).inc(tokens[0])
            self.metrics.generation_tokens.labels(name).inc(tokens[1])
        self.metrics.requests.labels(name, str(status)).inc()

    def _audit(self, scope: Scope, call: CallContext, arrival: float, latency_s: float, status: int,
               body: bytearray | None) -> None:
        prompt_tokens, completion_tokens = _tokens(call.streams)
        record = AuditRecord(arrival, call.request_id, call.tenant.name if call.tenant else None, _model_name(scope),
                             scope["path"], _client(scope), status, latency_s, prompt_tokens, completion_tokens,
                             _finish_reasons(call.streams))
        if self.audit.content:
            record.prompt, record.output = _prompt_of(body, self.json_limits), _outputs(call.streams)
        self.audit.write(record)

    def _check_tenant(self, scope: Scope, call: CallContext, limit: bool) -> APIError | None:
        if not self.tenants.enabled:
            return None
        authorization = dict(scope["headers"]).get(b"authorization", b"")
        tenant = self.tenants.authenticate(authorization)
        if tenant is None:
            return APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                            code="invalid_api_key")
        call.tenant = tenant
        if not limit:
            return None
        rejection = self.tenants.admit(tenant)
        if rejection is None:
            return None
        self.metrics.rejections.labels(tenant.name, rejection.reason).inc()
        return RateLimited(rejection)


class RateLimited(APIError):
    """A 429 in OpenAI's shape (``type`` "requests" or "tokens"), sent with ``Retry-After``."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(429, f"Rate limit reached: {rejection.message}. Retry after {rejection.retry_after_s} s.",
                         code="rate_limit_exceeded", type="requests" if "requests" in rejection.reason else "tokens")
        self.retry_after_s = rejection.retry_after_s


async def _send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if isinstance(error, RateLimited):
        headers.append((b"retry-after", str(error.retry_after_s).encode()))
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _recording(receive: Receive, body: bytearray) -> Receive:
    async def recorded() -> Message:
        message = await receive()
        if message["type"] == "http.request":
            body.extend(message.get("body", b""))
        return message

    return recorded


def _tokens(streams: list) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of the engine requests a call made."""
    return sum(s.num_prompt_tokens for s in streams), sum(s.num_generated for s in streams)


def _model_name(scope: Scope) -> str:
    ctx = getattr(getattr(scope.get("app"), "state", None), "ctx", None)
    return getattr(ctx, "model_name", "")


def _client(scope: Scope) -> str | None:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else None


def _finish_reasons(streams: list) -> list[str] | None:
    if not streams:
        return None
    reasons = []
    for stream in streams:
        if stream.finish_reasons:
            reasons += [stream.finish_reasons[i] for i in sorted(stream.finish_reasons)]
        else:
            reasons.append("abort")
    return reasons


def _outputs(streams: list) -> list[str] | None:
    texts = ["".join(s.sample_texts[i]) for s in streams for i in sorted(s.sample_texts)]
    return texts or None


def _prompt_of(body: bytearray | None, limits: JsonLimits) -> Any:
    """The prompt of a request body the guard let through; None for one it refused as too deep
    (never parsed recursively here either: the audit line of a hostile request must not fail)."""
    if not body or json_depth(bytes(body)) > limits.max_depth:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    for key in ("messages", "prompt", "input", "text"):
        if key in data:
            return data[key]
    return None
