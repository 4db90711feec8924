"""``POST /v1/embeddings`` (OpenAI's shape): texts or token ids in, one embedding each out.

Each input becomes one engine request with ``PoolingParams`` (``dimensions``, ``normalize``); the
engine pools it in one step and reports it finished, so the handler waits for the finals and
answers with every embedding in input order, as floats or as base64 of their little-endian
float32 bytes (``encoding_format``; what the ``openai`` SDK asks for by default), with the input
tokens as usage. The engine validates what only it knows (input length, token ids, whether the
model takes ``dimensions``) and its typed errors come back as 400s naming the parameter.

``create(body)`` is the same handler as a plain function of a request body (a dict), for callers
that are not HTTP (``podium run-batch``); it returns the response body or raises ``APIError``.
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from podium.pooling_params import PoolingParams

from .errors import bad_request, from_validation_error
from .protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, random_id
from .serving_base import ServingBase


class EmbeddingsHandler(ServingBase):
    async def handle(self, request: Request) -> Response:
        req = await self.parse(request, EmbeddingRequest)
        response = await self.unless_disconnected(request, self._respond(req))
        return response

    async def create(self, body: dict) -> dict:
        """The response body (a dict) for request ``body``; raises ``APIError`` for a bad request."""
        try:
            req = EmbeddingRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        return (await self.embed(req)).model_dump()

    async def _respond(self, req: EmbeddingRequest) -> Response:
        return Response((await self.embed(req)).model_dump_json(), media_type="application/json")

    async def embed(self, req: EmbeddingRequest) -> EmbeddingResponse:
        self.check_model(req.model)
        if not self.ctx.engine.info.pooling:
            raise bad_request(f"The model `{self.ctx.model_name}` generates text; it computes no embeddings. Start "
                              "the server with --runner pooling to serve embeddings from it.", param="model",
                              code="model_not_supported")
        prompts = self.prompts(req)
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        except ValueError as exc:
            raise bad_request(str(exc), param=getattr(exc, "param", None)) from None
        streams = await self.add_all(random_id("embd"), prompts, [params] * len(prompts), param="input")
        finals = await self.finals(streams)
        data = [EmbeddingData(index=i, embedding=_encoded(out.outputs.data, req.encoding_format))
                for i, out in enumerate(finals)]
        tokens = sum(len(p) for p in prompts)
        return EmbeddingResponse(model=self.ctx.model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))

    def prompts(self, req: EmbeddingRequest) -> list[list[int]]:
        """Token ids of each input: a string, a list of strings, a list of ids, or a list of id lists."""
        value = req.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        if not value:
            raise bad_request("input must not be empty: give a string, a list of strings or token ids", param="input")
        prompts = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                if not item:
                    raise bad_request(f"input[{i}] is an empty string; every input needs at least one character",
                                      param="input")
                prompts.append(self._tokenize(item, req.add_special_tokens))
            else:
                if not item:
                    raise bad_request(f"input[{i}] is an empty list of token ids", param="input")
                prompts.append(list(item))
        return prompts

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.ctx.tokenizer is None:
            raise bad_request("this model has no tokenizer: give token ids as input", param="input")
        return list(self.ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _encoded(vector, encoding_format: str) -> list[float] | str:
    """``vector``: the engine's float32 tensor (thread mode) or the array it crossed the pipe as (process mode)."""
    values = np.asarray(vector, dtype=np.float32)
    if encoding_format == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.tolist()



