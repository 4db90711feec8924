"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes): the server's tokenizer, no model step."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from podium.chat_template import render_chat
from podium.errors import ChatTemplateError

from .errors import bad_request, from_engine_error
from .protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from .serving_base import ServingBase
from .serving_chat import ChatHandler


class TokenizeHandler(ServingBase):
    async def handle(self, request: Request) -> Response:
        req = await self.parse(request, TokenizeRequest)
        self.check_model(req.model)
        tokenizer = self._tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        if req.prompt is not None:
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            prompt = ChatHandler(self.ctx).chat_prompt(req.messages, req.add_generation_prompt)
            try:
                ids = render_chat(tokenizer, prompt, self.ctx.model_name)
            except ChatTemplateError as exc:
                raise from_engine_error(exc, "messages") from None
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=self.ctx.max_model_len, tokens=ids, token_strs=strs)
        return Response(body.model_dump_json(), media_type="application/json")

    def _tokenizer(self):
        if self.ctx.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        return self.ctx.tokenizer


class DetokenizeHandler(TokenizeHandler):
    async def handle(self, request: Request) -> Response:
        req = await self.parse(request, DetokenizeRequest)
        self.check_model(req.model)
        tokenizer = self._tokenizer()
        vocab = len(tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        body = DetokenizeResponse(prompt=tokenizer.decode(req.tokens))
        return Response(body.model_dump_json(), media_type="application/json")
