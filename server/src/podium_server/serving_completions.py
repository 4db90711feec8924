"""``POST /v1/completions``: one engine request per prompt, ``n`` choices each.

Choice ``index`` is ``prompt_position * n + sample_index`` (as OpenAI numbers them). With
``echo`` the prompt text comes first in each choice (and its logprobs, when asked, from the
engine's prompt logprobs).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from podium.outputs import RequestOutput

from .async_engine import RequestStream
from .errors import bad_request
from .logprobs import completion_logprobs
from .protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage, random_id
from .serving_base import ChunkTemplate, ServingBase, StreamCursor, reject_unsupported, stop_list


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None  # as given; decoded from the ids only if echo needs it


class CompletionsHandler(ServingBase):
    async def handle(self, request: Request) -> Response:
        req = await self.parse(request, CompletionRequest)
        self.check_model(req.model)
        self.check_sampling(req)
        reject_unsupported(req.suffix, "suffix is", "suffix")
        reject_unsupported(req.best_of not in (None, req.n), "best_of other than n is", "best_of")
        prompts = self.prompts(req.prompt)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params = [self.sampling_params(req, max_tokens=self.max_tokens_for(len(p.token_ids), req.max_tokens, "prompt"),
                                       logprobs=req.logprobs, prompt_logprobs=prompt_logprobs) for p in prompts]
        request_id = random_id("cmpl")
        streams = await self.add_all(request_id, [p.token_ids for p in prompts], params, "prompt")
        if req.stream:
            return self.event_stream(self._chunks(req, request_id, prompts, streams))
        return await self.unless_disconnected(request, self._response(req, request_id, prompts, streams))

    def prompts(self, prompt: str | list) -> list[PromptInput]:
        items = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        result = []
        for item in items:
            if isinstance(item, str):
                if self.ctx.tokenizer is None:
                    raise bad_request("this model has no tokenizer; send the prompt as token ids", param="prompt")
                result.append(PromptInput(list(self.ctx.tokenizer.encode(item)), item))
            else:
                result.append(PromptInput(list(item), None))
        return result

    def _prompt_text(self, prompt: PromptInput) -> str:
        if prompt.text is None:
            prompt.text = self.ctx.tokenizer.decode(prompt.token_ids) if self.ctx.tokenizer is not None else ""
        return prompt.text

    @staticmethod
    def _echo_logprobs(prompt: PromptInput, out: RequestOutput) -> tuple[list, list]:
        """Prompt token ids and their logprob positions (None where the engine gave none)."""
        given = list(out.prompt_logprobs or [])[: len(prompt.token_ids)]
        return list(prompt.token_ids), [None] * (len(prompt.token_ids) - len(given)) + given

    # -- not streaming --------------------------------------------------------------------------
    async def _response(self, req: CompletionRequest, request_id: str, prompts: list[PromptInput],
                        streams: list[RequestStream]) -> Response:
        finals = await self.finals(streams)
        choices = []
        for i, (prompt, out) in enumerate(zip(prompts, finals)):
            prefix = self._prompt_text(prompt) if req.echo else ""
            for c in sorted(out.outputs, key=lambda c: c.index):
                logprobs = None
                if req.logprobs is not None:
                    ids, positions = self._echo_logprobs(prompt, out) if req.echo else ([], [])
                    logprobs = completion_logprobs(ids + list(c.token_ids), positions + list(c.logprobs or []),
                                                   req.logprobs, 0, self.ctx.token_text)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        body = CompletionResponse(id=request_id, model=self.ctx.model_name, choices=choices,
                                  usage=_usage(prompts, finals))
        return Response(body.model_dump_json(), media_type="application/json")

    # -- streaming ------------------------------------------------------------------------------
    async def _chunks(self, req: CompletionRequest, request_id: str, prompts: list[PromptInput],
                      streams: list[RequestStream]) -> AsyncIterator[CompletionResponse]:
        created, stop = int(time.time()), stop_list(req.stop)
        cursors: dict[int, StreamCursor] = {}
        templates: dict[int, ChunkTemplate] = {}  # per choice index: its plain text chunks
        last: dict[int, RequestOutput] = {}
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats
        try:
            async for i, out in self.merged(streams):
                last[i] = out
                for c in sorted(out.outputs, key=lambda c: c.index):
                    index = i * req.n + c.index
                    choice = self._delta(req, prompts[i], out, c, index, cursors.setdefault(index, _Cursor()), stop)
                    if choice is None:
                        continue
                    if not continuous and choice.logprobs is None and choice.finish_reason is None:
                        template = templates.get(index) or templates.setdefault(index, ChunkTemplate(
                            CompletionResponse(id=request_id, created=created, model=self.ctx.model_name,
                                               choices=[CompletionChoice(index=index, text=ChunkTemplate.PLACEHOLDER)])))
                        yield template.render(choice.text)
                    else:
                        usage = _usage(prompts, list(last.values())) if continuous else None
                        yield CompletionResponse(id=request_id, created=created, model=self.ctx.model_name,
                                                 choices=[choice], usage=usage)
            if include_usage:
                yield CompletionResponse(id=request_id, created=created, model=self.ctx.model_name, choices=[],
                                         usage=_usage(prompts, [last[i] for i in sorted(last)]))
        finally:
            self.release(streams)

    def _delta(self, req: CompletionRequest, prompt: PromptInput, out: RequestOutput, c, index: int,
               cursor: _Cursor, stop: list[str]) -> CompletionChoice | None:
        first = not cursor.started
        new = cursor.advance(c, stop)
        if new is None:
            return None
        text, ids, positions = new
        cursor.started = True
        if req.echo and first:
            text = self._prompt_text(prompt) + text
        logprobs = None
        if req.logprobs is not None:
            if req.echo and first:
                prompt_ids, prompt_positions = self._echo_logprobs(prompt, out)
                ids, positions = prompt_ids + ids, prompt_positions + positions
            logprobs = completion_logprobs(ids, positions, req.logprobs, cursor.sent_chars, self.ctx.token_text)
        cursor.sent_chars += len(text)
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)


@dataclass
class _Cursor(StreamCursor):
    started: bool = False
    sent_chars: int = 0  # text_offset of the next token


def _usage(prompts: list[PromptInput], outputs: list[RequestOutput]) -> Usage:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
