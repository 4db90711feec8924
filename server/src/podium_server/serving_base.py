"""What every generating endpoint shares: parse -> validate -> SamplingParams -> stream or not.

A handler (``serving_completions``, ``serving_chat``) parses its request model, turns it into
token-id prompts and ``SamplingParams`` with the helpers here, adds the requests to the async
engine, then either streams Server-Sent Events or waits for the final outputs while watching for
the client to go away. Whatever way a request ends, its engine requests are released (aborted if
unfinished), so their KV blocks are free at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from podium.chat_template import ChatPrompt
from podium.errors import InvalidParameter, PodiumError
from podium.outputs import RequestOutput
from podium.pooling_params import PoolingParams
from podium.sampling_params import SamplingParams, StructuredOutputsParams

from .async_engine import AsyncEngine, RequestStream
from .errors import APIError, bad_request, from_engine_error, from_validation_error, logger, not_supported
from .logprobs import TokenText
from .protocol import IGNORED_FIELDS, SamplingFields
from .service_middleware import current_call, engine_tenant

M = TypeVar("M", bound=BaseModel)


class BodyTooLarge(Exception):
    """Raised by the body-size guard's ``receive`` while the body is being read."""


@dataclass
class ServerContext:
    """Everything a handler needs, built once in the app's lifespan."""

    engine: AsyncEngine
    model_name: str  # the name clients use (served_model_name or the model argument)
    model_aliases: frozenset[str]  # other names accepted in requests
    max_model_len: int
    tokenizer: Any
    token_text: TokenText
    tool_call_parser: str | None = None  # the server's --tool-call-parser
    auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser


class ServingBase:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    # -- parse and validate ---------------------------------------------------------------------
    @staticmethod
    async def parse(request: Request, model: type[M]) -> M:
        try:
            body = await request.body()
        except BodyTooLarge as exc:
            raise APIError(413, str(exc), code="request_too_large") from None
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"The request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise bad_request(f"The request body must be a JSON object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from None

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter the request's ``model`` names, None for the base model; 404 naming an unknown one."""
        if name is None or name == self.ctx.model_name or name in self.ctx.model_aliases:
            return None
        adapters = self.ctx.engine.lora_adapters
        if name in adapters:
            return name
        served = f"`{self.ctx.model_name}`" + (f" and the LoRA adapters {', '.join(f'`{a}`' for a in adapters)}"
                                                if adapters else "")
        raise APIError(404, f"The model `{name}` does not exist. This server serves {served}.",
                       param="model", code="model_not_found")

    def response_model(self, lora: str | None) -> str:
        """The ``model`` a response names: the adapter the request ran with, else the base model."""
        return lora or self.ctx.model_name

    def check_sampling(self, req: SamplingFields) -> None:
        if self.ctx.engine.info.pooling:
            raise bad_request(f"The model `{self.ctx.model_name}` is an embedding model: it computes embeddings, not "
                              "text. Use POST /v1/embeddings.", param="model", code="model_not_supported")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        vocab = len(self.ctx.tokenizer) if self.ctx.tokenizer is not None else None
        for key in req.logit_bias or {}:
            if vocab is not None and not 0 <= int(key) < vocab:
                raise bad_request(f"logit_bias: token id {key} is out of range [0, {vocab})", param="logit_bias")

    @staticmethod
    def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        # the fields a request leaves unset (None) stay unset, so the model's generation_config.json
        # defaults fill them in the engine (EngineConfig.generation_config)
        unset_is_default = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                            "min_p": req.min_p, "repetition_penalty": req.repetition_penalty}
        try:
            return SamplingParams(
                n=req.n, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()} or None, seed=req.seed,
                max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens, structured_outputs=constraint,
                **{k: v for k, v in unset_is_default.items() if v is not None})
        except InvalidParameter as exc:
            raise from_engine_error(exc) from None
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc)) from None

    # -- engine requests ------------------------------------------------------------------------
    async def add_all(self, request_id: str, prompts: list[list[int] | ChatPrompt],
                      params: list[SamplingParams] | list[PoolingParams], param: str,
                      priority: int = 0, lora: str | None = None) -> list[RequestStream]:
        """Add one engine request per prompt (ids ``request_id-i`` when several), all at once; all or none.
        The engine checks each (context length, chat template, parameters); its typed error becomes
        the API error, ``param`` naming the field that holds the prompt. The HTTP request's tenant
        (service_middleware) goes with them and limits their max_tokens; ``lora`` names their adapter."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        call = current_call.get()
        tenant = engine_tenant(call, params)
        extra = {"lora": lora} if lora is not None else {}
        results = await asyncio.gather(*(self.ctx.engine.add(rid, prompt, p, priority, tenant=tenant, **extra)
                                         for rid, prompt, p in
                                         zip(ids, prompts, params)), return_exceptions=True)
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if not errors:
            if call is not None:
                for stream in streams:
                    stream.trace_id = call.request_id
                call.streams.extend(streams)
            return streams
        self.release(streams)
        error = from_engine_error(errors[0], param)
        if error is None:
            raise errors[0]
        raise error from None

    def release(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.ctx.engine.release(stream)

    async def finals(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of every stream (released whatever happens)."""
        try:
            return list(await asyncio.gather(*(s.final() for s in streams)))
        except PodiumError as exc:
            raise from_engine_error(exc) from None
        finally:
            self.release(streams)

    @staticmethod
    async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
        """Await ``work``, cancelling it (and so aborting its requests) if the client goes away first."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            return Response(status_code=499)  # nobody is there to read it
        return task.result()

    # -- streaming ------------------------------------------------------------------------------
    @staticmethod
    def event_stream(events: AsyncIterator[BaseModel | dict | str]) -> StreamingResponse:
        """Server-Sent Events of ``events``: models, dicts, or JSON already rendered (``ChunkTemplate``)."""
        return StreamingResponse(_sse(events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @staticmethod
    async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as they come, tagged with the stream's position."""
        if len(streams) == 1:
            async for output in streams[0].outputs():
                yield 0, output
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for output in stream.outputs():
                    queue.put_nowait((i, output, None))
            except Exception as exc:
                queue.put_nowait((i, None, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(streams)
        try:
            while remaining:
                i, output, error = await queue.get()
                if error is not None:
                    raise error
                remaining -= output.finished
                yield i, output
        finally:
            for task in tasks:
                task.cancel()


async def _sse(events: AsyncIterator[BaseModel | dict | str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            if isinstance(event, str):
                yield f"data: {event}\n\n"
            else:
                yield f"data: {event.model_dump_json() if isinstance(event, BaseModel) else json.dumps(event)}\n\n"
    except (APIError, PodiumError) as exc:  # after the 200 went out: report in-band, then end
        error = exc if isinstance(exc, APIError) else from_engine_error(exc)
        yield f"data: {json.dumps(error.body())}\n\n"
    except Exception as exc:
        logger.exception("a stream failed")
        yield f"data: {json.dumps(APIError(500, f'internal server error: {type(exc).__name__}: {exc}').body())}\n\n"
    yield "data: [DONE]\n\n"


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ChunkTemplate:
    """The JSON of a streamed chunk whose only variable part is one text: the per-token hot path.

    The chunk is rendered by pydantic once, with ``PLACEHOLDER`` as the text; ``render(text)`` puts
    the text's JSON in its place. Same bytes as pydantic's (tests/test_server_chunk_template.py),
    without building and validating three model objects per token (~10 us each time).
    """

    PLACEHOLDER = "\x00"

    def __init__(self, chunk: BaseModel) -> None:
        rendered = chunk.model_dump_json()
        self._before, found, self._after = rendered.partition('"\\u0000"')
        if not found or '"\\u0000"' in self._after:
            raise ValueError(f"the chunk must hold the placeholder text exactly once: {rendered}")

    def render(self, text: str) -> str:
        return self._before + _json_string(text) + self._after


_json_string = json.JSONEncoder(ensure_ascii=False).encode


def reject_unsupported(condition: Any, feature: str, param: str) -> None:
    if condition:
        raise not_supported(feature, param)


def log_ignored(req: object) -> None:
    """One debug line naming the OpenAI fields a request set that change nothing here."""
    ignored = [name for name in IGNORED_FIELDS if getattr(req, name, None) is not None]
    if ignored:
        logger.debug("ignored request fields (accepted, no effect on this server): %s", ", ".join(ignored))
