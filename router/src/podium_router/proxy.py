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
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .hashing import block_hashes, text_block_hashes
from .metrics import RouterMetrics
from .policy import Candidate, Router
from .pool import ReplicaPool
from .replica import Replica

logger = logging.getLogger("podium_router")
_RETRYABLE_STATUS = {500, 502, 503, 504}
_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_CHARS_PER_TOKEN = 4  # a prompt's size in tokens when no replica could tokenize it


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
    def __init__(self, pool: ReplicaPool, router: Router, metrics: RouterMetrics) -> None:
        self.pool, self.router, self.metrics = pool, router, metrics
        settings = pool.settings
        self._max_attempts = settings.max_attempts
        self._timeout = httpx.Timeout(settings.request_timeout_s, connect=settings.connect_timeout_s)
        self._replica_auth = f"Bearer {settings.replica_api_key}" if settings.replica_api_key else None

    async def handle(self, request: Request, endpoint: str) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        ids = {"X-Request-Id": request_id}
        body = await request.body()
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
        headers = {"content-type": "application/json", "x-request-id": request_id}
        if self._replica_auth:
            headers["authorization"] = self._replica_auth
        stream = bool(data.get("stream"))
        last_error = None
        for attempt, candidate in enumerate(candidates[: self._max_attempts]):
            if attempt:
                self.metrics.retries.labels(candidate.replica.name).inc()
            outcome = await self._attempt(candidate, prompt, endpoint, body, headers, stream, ids)
            if isinstance(outcome, Response):
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
    async def _attempt(self, candidate: Candidate, prompt: Prompt, endpoint: str, body: bytes, headers: dict,
                       stream: bool, ids: dict) -> Response | str:
        """The response to send, or why this replica failed before the client got a byte."""
        replica = candidate.replica
        hashes = prompt.hashes(replica) if prompt.num_tokens else []
        replica.routed_request(hashes, candidate.uncached_tokens)
        started = time.perf_counter()
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        upstream = None
        try:
            upstream = await self.pool.client.send(
                self.pool.client.build_request("POST", replica.url + path, content=body, headers=headers,
                                               timeout=self._timeout), stream=True)
            if upstream.status_code in _RETRYABLE_STATUS:
                detail = (await upstream.aread())[:300].decode("utf-8", "replace")
                raise _Retry(f"{replica.name} answered {upstream.status_code}: {detail}")
            chunks = upstream.aiter_raw()
            first = await anext(chunks, b"") if stream and upstream.status_code == 200 else None
            if first == b"":
                raise _Retry(f"{replica.name} closed the stream before its first chunk")
            if first is None:  # not streaming (or an error status): the whole body, then answer
                content = await upstream.aread()
        except (httpx.HTTPError, _Retry) as exc:
            if upstream is not None:
                await upstream.aclose()
            replica.first_byte(candidate.uncached_tokens)
            replica.finished_request(hashes)
            self.pool.finished(replica)
            if isinstance(exc, httpx.ConnectError):  # nobody listens: out of routing until a check passes
                self.pool.suspect(replica, type(exc).__name__)
            # (a read error before the first byte may be one connection's end, not the replica's: the
            # request goes to the next candidate and the health checks judge the replica)
            logger.info("request %s: %s failed before its first byte (%s); trying another replica",
                        ids["X-Request-Id"], replica.name, exc)
            return str(exc) or type(exc).__name__
        replica.first_byte(candidate.uncached_tokens)
        self.metrics.routed(replica.name, candidate, time.perf_counter() - started)
        out_headers = {**ids, "X-Podium-Replica": replica.name,
                       "content-type": upstream.headers.get("content-type", "application/json")}
        if "retry-after" in upstream.headers:  # a replica's 429 (a tenant over its limit) says when to retry
            out_headers["Retry-After"] = upstream.headers["retry-after"]
        if first is None:
            await upstream.aclose()
            self._done(replica, hashes, "ok" if upstream.status_code < 400 else "client_error", content)
            return Response(content, status_code=upstream.status_code, headers=out_headers)
        out_headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return StreamingResponse(self._relay(replica, hashes, upstream, first, chunks, ids, time.perf_counter()),
                                 status_code=upstream.status_code, headers=out_headers)

    async def _relay(self, replica: Replica, hashes: list[str], upstream: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes], ids: dict, first_at: float) -> AsyncIterator[bytes]:
        """The replica's stream as it comes; an error event if it breaks off."""
        outcome, tail = "ok", first[-2048:]
        try:
            yield first
            async for chunk in chunks:
                tail = (tail + chunk)[-2048:]
                yield chunk
            replica.decode_time.add(time.perf_counter() - first_at, 1)
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "client_gone"  # closing the upstream below aborts the request at the replica
            raise
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            outcome = "cut"
            logger.warning("request %s: the stream from %s broke off (%s)", ids["X-Request-Id"], replica.name, exc)
            if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
                self.pool.suspect(replica, type(exc).__name__)
            event = error_body(503, f"the replica serving this request ({replica.name}) went away mid-stream: "
                                    f"{type(exc).__name__}; the output so far is incomplete", "replica_failed")
            separator = b"" if tail.endswith(b"\n\n") else b"\n\n"  # end a half-sent event first
            yield separator + f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()
            self._done(replica, hashes, outcome, tail)

    def _done(self, replica: Replica, hashes: list[str], outcome: str, tail: bytes) -> None:
        replica.finished_request(hashes)
        self.pool.finished(replica)
        self.metrics.requests.labels(replica.name, outcome).inc()
        match = _USAGE.findall(tail)
        if match:
            self.metrics.generation_tokens.labels(replica.name).inc(int(match[-1]))


class _Retry(Exception):
    """This attempt failed before the client got a byte: try the next replica."""
