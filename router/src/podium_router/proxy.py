"""Forwarding one OpenAI request: rank the replicas, try them in order, pass the answer through.

    body ──► the replicas serving its ``model`` (the base model, an alias, or a LoRA adapter loaded there)
         ──► prompt tokens (a Podium replica's /tokenize; ids given as such are used as they are)
         ──► block hashes per replica (its block size; its key for the adapter) ──► Router.rank
         ──► attempt 1, 2, ... (max_attempts)

An attempt that fails before the client got a byte (the replica refused the connection, closed it,
answered 5xx, or its stream ended before its first chunk) moves on to the next replica; a refused
or dropped connection also takes the replica out of routing until its next passing check. The
first chunk of a 200 commits the request to that replica: from then on its bytes are passed
through unchanged and unbuffered, and if the replica goes away mid-stream the client gets one
OpenAI-shaped error event and ``[DONE]``, never a hang. A 4xx is the request's own problem and
is returned as the replica sent it (with its ``Retry-After``). ``X-Request-Id`` is passed through (one is made if the client
sent none) and returned, with ``X-Podium-Replica`` naming the replica that answered.

The relay is the router's hot path: a decode step is a burst of one chunk per running stream, and a
new request's first token waits behind whatever of the burst the one event loop has not relayed
yet, so what a chunk costs here is what the router adds to time to first token. A proxied request
comes to ``Proxy.serve`` straight from the server (``RouterApp``, ahead of FastAPI's middleware),
the replica is asked through ``upstream.Upstream`` (asyncio protocols, httptools' C parser), and a
committed stream is a ``Relay``: whatever one read from the replica brought is one ``send`` to the
client. A client that goes away closes the upstream connection, which aborts the request at the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

import httpx
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .hashing import block_hashes, text_block_hashes
from .metrics import RouterMetrics
from .policy import Candidate, Router
from .pool import ReplicaPool
from .replica import Replica
from .upstream import ConnectFailed, ConnectionLost, ResponseClosed, Upstream, UpstreamError, UpstreamResponse

logger = logging.getLogger("podium_router")
_RETRYABLE_STATUS = {500, 502, 503, 504}
_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_CHARS_PER_TOKEN = 4  # a prompt's size in tokens when no replica could tokenize it
_TAIL = 2048  # the end of a stream kept for its usage (generated tokens) and for ending a half-sent event


def error_body(status: int, message: str, code: str | None = None) -> dict:
    kind = "service_unavailable" if status == 503 else "invalid_request_error" if status < 500 else "internal_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(status: int, message: str, code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status, headers=headers)


@dataclass
class Prompt:
    """What routing needs to know of a request's prompt."""

    token_ids: list[int] | None  # exact, when a replica tokenized it (or the client sent ids)
    text: str  # for approximate prefix keys when there are no token ids
    model: str | None = None  # the request's model: a LoRA adapter's blocks hash differently
    _hashes: dict[tuple, list[str]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else len(self.text) // _CHARS_PER_TOKEN

    def hashes(self, replica: Replica) -> list[str]:
        """The prompt's block hashes as ``replica``'s prefix cache names them: its block size, and its
        own ``block_hash_extra`` when the request names a LoRA adapter (approximate text keys without ids)."""
        extra = replica.block_hash_extra(self.model)
        key = ("text", extra) if self.token_ids is None else (replica.block_size, extra)
        if key not in self._hashes:
            self._hashes[key] = (text_block_hashes(self.text, extra=extra) if self.token_ids is None
                                 else block_hashes(self.token_ids, replica.block_size, extra))
        return self._hashes[key]


class Proxy:
    def __init__(self, pool: ReplicaPool, router: Router, metrics: RouterMetrics, upstream: Upstream) -> None:
        self.pool, self.router, self.metrics, self.upstream = pool, router, metrics, upstream
        settings = pool.settings
        self._max_attempts = settings.max_attempts
        self._replica_auth = f"Bearer {settings.replica_api_key}" if settings.replica_api_key else None

    async def serve(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        """ASGI: answer one request to ``endpoint`` ("chat" or "completions")."""
        body = await _request_body(receive)
        if body is None:
            return  # the client left before it finished sending
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        answer = await self.handle(request_id, body, endpoint)
        await answer(scope, receive, send)

    async def handle(self, request_id: str, body: bytes, endpoint: str) -> Response | Relay:
        """The answer (an ASGI callable) to a request's ``body``."""
        ids = {"X-Request-Id": request_id}
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return error_response(400, f"The request body is not valid JSON: {exc}", headers=ids)
        if not isinstance(data, dict):
            return error_response(400, "The request body must be a JSON object", headers=ids)
        model = data.get("model") if isinstance(data.get("model"), str) else None  # (else the replica says why)
        replicas = self._serving(model)
        if replicas is None:
            return error_response(404, f"The model `{model}` does not exist on any replica.", "model_not_found", ids)
        prompt = await self._prompt(endpoint, data, replicas, model)
        candidates = self.router.rank(replicas, prompt.num_tokens, prompt.hashes)
        if not candidates:
            self.metrics.no_replica.inc()
            return error_response(503, "no healthy replica to serve this request; try again shortly",
                                  "no_healthy_replica", ids)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s (%d tokens): %s", request_id, prompt.num_tokens, "; ".join(
                f"{c.replica.name} {1000 * c.ttft_s:.0f} ms, {c.cached_tokens} cached, {c.replica.queued_tokens} "
                f"queued, {c.replica.in_flight} in flight" for c in candidates))
        headers = [("content-type", "application/json"), ("x-request-id", request_id)]
        if self._replica_auth:
            headers.append(("authorization", self._replica_auth))
        stream = bool(data.get("stream"))
        last_error = None
        for attempt, candidate in enumerate(candidates[: self._max_attempts]):
            if attempt:
                self.metrics.retries.labels(candidate.replica.name).inc()
            outcome = await self._attempt(candidate, prompt, endpoint, body, headers, stream, ids)
            if not isinstance(outcome, str):
                return outcome
            last_error = outcome
        self.metrics.requests.labels("none", "failed").inc()
        return error_response(503, f"every replica tried failed this request ({last_error}); try again shortly",
                              "replicas_failed", ids)

    # -- choosing -----------------------------------------------------------------------------------
    def _serving(self, model: str | None) -> list[Replica] | None:
        """The replicas that may serve ``model``; None (a 404) when healthy replicas exist and none does."""
        replicas = self.pool.replicas
        if not model:
            return replicas
        serving = [r for r in replicas if r.serves(model)]
        return serving if serving or not any(r.routable for r in replicas) else None

    async def _prompt(self, endpoint: str, data: dict, replicas: list[Replica], model: str | None) -> Prompt:
        if endpoint == "chat":
            messages = data.get("messages") or []
            text = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            ask = {"messages": messages, "add_generation_prompt": data.get("add_generation_prompt", True)}
        else:
            prompt = data.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]  # a batch of prompts: routed by its first
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return Prompt(list(prompt), "", model)
            text = prompt if isinstance(prompt, str) else ""
            ask = {"prompt": text}
        if sum(r.routable for r in replicas) < 2 or self.router.policy == "round-robin":
            return Prompt(None, text, model)  # nothing to choose between, or no need to know: no tokenizing
        return Prompt(await self._tokenize(ask, replicas), text, model)

    async def _tokenize(self, ask: dict, replicas: list[Replica]) -> list[int] | None:
        """The prompt's token ids from a Podium replica (the one with the least queued work)."""
        podium = sorted((r for r in replicas if r.routable and r.is_podium), key=lambda r: r.queued_tokens)
        headers = {"authorization": self._replica_auth} if self._replica_auth else None
        for replica in podium[:2]:
            try:
                response = await self.pool.client.post(f"{replica.url}/tokenize", json=ask, headers=headers,
                                                       timeout=httpx.Timeout(5.0, connect=1.0))
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                return response.json().get("tokens")
            if response.status_code < 500:
                return None  # the replica will refuse the request itself, with the reason
        return None

    # -- one attempt ----------------------------------------------------------------------------------
    async def _attempt(self, candidate: Candidate, prompt: Prompt, endpoint: str, body: bytes,
                       headers: list[tuple[str, str]], stream: bool, ids: dict) -> Response | Relay | str:
        """The answer to send, or why this replica failed before the client got a byte."""
        replica = candidate.replica
        hashes = prompt.hashes(replica) if prompt.num_tokens else []
        replica.routed_request(hashes, candidate.uncached_tokens)
        started = time.perf_counter()
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        upstream = None
        try:
            upstream = await self.upstream.post(replica.url, path, body, headers)
            if upstream.status in _RETRYABLE_STATUS:
                detail = (await upstream.read())[:300].decode("utf-8", "replace")
                raise _Retry(f"{replica.name} answered {upstream.status}: {detail}")
            first = await upstream.next_chunk() if stream and upstream.status == 200 else None
            if first == b"":
                raise _Retry(f"{replica.name} closed the stream before its first chunk")
            if first is None:  # not streaming (or an error status): the whole body, then answer
                content = await upstream.read()
        except (UpstreamError, _Retry) as exc:
            if upstream is not None:
                upstream.close()
            replica.first_byte(candidate.uncached_tokens)
            replica.finished_request(hashes)
            self.pool.finished(replica)
            if isinstance(exc, ConnectFailed):  # nobody listens: out of routing until a check passes
                self.pool.suspect(replica, type(exc).__name__)
            # (a read error before the first byte may be one connection's end, not the replica's: the
            # request goes to the next candidate and the health checks judge the replica)
            logger.info("request %s: %s failed before its first byte (%s); trying another replica",
                        ids["X-Request-Id"], replica.name, exc)
            return str(exc) or type(exc).__name__
        except BaseException:
            if upstream is not None:
                upstream.close()
            raise
        replica.first_byte(candidate.uncached_tokens)
        self.metrics.routed(replica.name, candidate, time.perf_counter() - started)
        out_headers = {**ids, "X-Podium-Replica": replica.name,
                       "content-type": upstream.headers.get("content-type", "application/json")}
        if "retry-after" in upstream.headers:  # a replica's 429 (a tenant over its limit) says when to retry
            out_headers["Retry-After"] = upstream.headers["retry-after"]
        if first is None:
            upstream.close()
            self.ended(replica, hashes, "ok" if upstream.status < 400 else "client_error", content)
            return Response(content, status_code=upstream.status, headers=out_headers)
        out_headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return Relay(self, replica, hashes, upstream, first, out_headers)

    def ended(self, replica: Replica, hashes: list[str], outcome: str, tail: bytes) -> None:
        replica.finished_request(hashes)
        self.pool.finished(replica)
        self.metrics.requests.labels(replica.name, outcome).inc()
        match = _USAGE.findall(tail)
        if match:
            self.metrics.generation_tokens.labels(replica.name).inc(int(match[-1]))


class Relay:
    """The ASGI answer for a stream committed to its replica: the replica's bytes as they come, each
    read sent straight to the server's ``send`` (no response class, no middleware per chunk); an error
    event if the replica breaks off; the upstream closed (the replica aborts) if the client goes away."""

    def __init__(self, proxy: Proxy, replica: Replica, hashes: list[str], upstream: UpstreamResponse, first: bytes,
                 headers: dict[str, str]) -> None:
        self.proxy, self.replica, self.hashes, self.upstream, self.first = proxy, replica, hashes, upstream, first
        self.request_id = headers["X-Request-Id"]
        self.headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.first_at = time.perf_counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome, tail = "ok", self.first[-_TAIL:]
        watcher = asyncio.ensure_future(_on_disconnect(receive, self.upstream.close))
        try:
            await send({"type": "http.response.start", "status": self.upstream.status, "headers": self.headers})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            while chunk := await self.upstream.next_chunk():
                tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self.replica.decode_time.add(time.perf_counter() - self.first_at, 1)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            outcome = "client_gone"
            raise
        except (ResponseClosed, OSError):  # the client went away (closing the upstream aborts the request)
            outcome = "client_gone"
        except UpstreamError as exc:
            outcome = "cut"
            await self._break_off(send, exc, tail)
        finally:
            watcher.cancel()
            self.upstream.close()
            self.proxy.ended(self.replica, self.hashes, outcome, tail)

    async def _break_off(self, send: Send, exc: UpstreamError, tail: bytes) -> None:
        replica = self.replica
        logger.warning("request %s: the stream from %s broke off (%s)", self.request_id, replica.name, exc)
        if isinstance(exc, ConnectionLost):
            self.proxy.pool.suspect(replica, type(exc).__name__)
        event = error_body(503, f"the replica serving this request ({replica.name}) went away mid-stream: "
                                f"{type(exc).__name__}; the output so far is incomplete", "replica_failed")
        separator = b"" if tail.endswith(b"\n\n") else b"\n\n"  # end a half-sent event first
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "more_body": False,
                        "body": separator + f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()})


async def _on_disconnect(receive: Receive, then) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    then()


async def _request_body(receive: Receive) -> bytes | None:
    """The request's body; None if the client disconnected first."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


def _header(scope: Scope, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == name), None)


class _Retry(Exception):
    """This attempt failed before the client got a byte: try the next replica."""
