"""Checks made before any handler runs (plain ASGI middleware): the API key, the drain, the body.

The key protects the API (``/v1/*``, ``/tokenize``, ``/detokenize``); ``/health``, ``/version``,
``/metrics`` and the replica report stay open for load balancers, Prometheus and routers. The key
comes as ``Authorization: Bearer KEY`` (OpenAI's clients; the scheme in any case, RFC 7235) or
``x-api-key: KEY`` (Anthropic's). Keys are compared in constant time.

While the server drains (drain.py) a new API request gets 503 with ``Retry-After``; the requests
let in are counted until their response ends. A body is read here, in full, before the handler
sees it: refused with 413 from its Content-Length when it has one, or as soon as the bytes read
pass the limit; then its JSON is held to the nesting and size limits (json_limits.py: 400 naming
the limit) before anything parses it recursively. The handler reads the same body afterwards.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .drain import RETRY_AFTER_S, Drain
from .errors import APIError, is_anthropic
from .json_limits import JsonLimits, check_json_body

_OPEN_PATHS = ("/health", "/version", "/metrics", "/ping")
_STATUS_PREFIX = "/podium/"  # the replica report and KV events: a router reads them during a drain too
_WITH_BODY = ("POST", "PUT", "PATCH")


class GuardMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, json_limits: JsonLimits | None = None,
                 drain: Drain | None = None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._max = max_body_bytes
        self._limits = json_limits or JsonLimits()
        self._drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        api = path not in _OPEN_PATHS and not path.startswith(_STATUS_PREFIX)
        anthropic = is_anthropic(path)
        if self._key is not None and path not in _OPEN_PATHS and scope["method"] != "OPTIONS":
            headers = dict(scope["headers"])
            x_api_key = headers.get(b"x-api-key")
            x_api_key_ok = x_api_key is not None and hmac.compare_digest(x_api_key.strip(), self._key)
            if not (self._authorized(headers.get(b"authorization", b"")) or x_api_key_ok):
                await _send_error(send, APIError(401, "Incorrect or missing API key. Send it as 'Authorization: "
                                                      "Bearer <key>' or 'x-api-key: <key>'.", code="invalid_api_key"),
                                  anthropic)
                return
        drain = self._drain
        if api and drain is not None and drain.draining:
            await _send_error(send, APIError(503, "The server is shutting down and takes no new requests; "
                                                  "retry on another replica", code="server_draining"), anthropic)
            return
        if api and drain is not None:
            drain.enter()
        try:
            if scope["method"] in _WITH_BODY:
                body, error = await self._read_body(scope, receive)
                if error is not None:
                    await _send_error(send, error, anthropic)
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, send)
        finally:
            if api and drain is not None:
                drain.exit()

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, APIError | None]:
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self._max:
            return b"", self._too_large()
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the handler sees it too
                break
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self._max:
                return b"", self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        return body, (check_json_body(body, self._limits) if body else None)

    def _authorized(self, header: bytes) -> bool:
        """``Bearer KEY``, the scheme in any case (RFC 7235: auth schemes are case-insensitive)."""
        scheme, _, key = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self._key)

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than this server accepts ({self._max} bytes)",
                        code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives the body read already, then what the client sends next (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _send_error(send: Send, error: APIError, anthropic: bool = False) -> None:
    body = json.dumps(error.anthropic_body() if anthropic else error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if error.status == 503:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
