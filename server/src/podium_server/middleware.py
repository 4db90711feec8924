"""Checks made before any handler runs: the API key and the body size (plain ASGI middleware).

The key protects the API (``/v1/*``, ``/tokenize``, ``/detokenize``); ``/health``, ``/version`` and
``/metrics`` stay open for load balancers and Prometheus. Keys are compared in constant time.
A body is refused with 413 from its Content-Length when it has one; a chunked body is counted
as it is read and the handler answers 413 when it passes the limit.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError
from .serving_base import BodyTooLarge

_OPEN_PATHS = ("/health", "/version", "/metrics", "/ping")


class GuardMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._max = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._key is not None and scope["path"] not in _OPEN_PATHS and scope["method"] != "OPTIONS":
            if not self._authorized(dict(scope["headers"]).get(b"authorization", b"")):
                await _send_error(send, APIError(401, "Incorrect or missing API key. Send it as "
                                                      "'Authorization: Bearer <key>'.", code="invalid_api_key"))
                return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self._max:
            await _send_error(send, self._too_large())
            return
        await self.app(scope, self._counting(receive), send)

    def _authorized(self, header: bytes) -> bool:
        """``Bearer KEY``, the scheme in any case (RFC 7235: auth schemes are case-insensitive)."""
        scheme, _, key = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self._key)

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than this server accepts ({self._max} bytes)",
                        code="request_too_large")

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._max:
                    raise BodyTooLarge(self._too_large().message)
            return message

        return counted


async def _send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
