"""``POST /v1/completions``: one engine request per prompt, ``n`` choices each.

Choice ``index`` is ``prompt_position * n + sample_index`` (as OpenAI numbers them). With
``echo`` the prompt text comes first in each choice (and its logprobs, when asked, from the
engine's prompt logprobs). Streams are the engine's deltas, sent as they come.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from .async_engine import RequestStream
from .errors import bad_request
from .logprobs import completion_logprobs
from .protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage, random_id
from .serving_base import ChunkTemplate, ServingBase, log_ignored, reject_unsupported
from .structured_outputs import structured_outputs


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None  # as given; decoded from the ids only if echo needs it


class CompletionsHandler(ServingBase):
    async def handle(self, request: Request) -> Response:
        req = await self.parse(request, CompletionRequest)
        lora = self.check_model(req.model)
        self.check_sampling(req)
        reject_unsupported(req.suffix, "suffix is", "suffix")
        reject_unsupported(req.best_of not in (None, req.n), "best_of other than n is", "best_of")
        log_ignored(req)
        prompts = self.prompts(req.prompt)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        constraint = structured_outputs(req)
        params = [self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs,
                                       prompt_logprobs=prompt_logprobs, constraint=constraint) for _ in prompts]
        request_id = random_id("cmpl")
        streams = await self.add_all(request_id, [p.token_ids for p in prompts], params, "prompt", req.priority,
                                     lora)
        model = self.response_model(lora)
        if req.stream:
            return self.event_stream(self._chunks(req, request_id, prompts, streams, model))
        return await self.unless_disconnected(request, self._response(req, request_id, prompts, streams, model))

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
    def _echo_logprobs(prompt: PromptInput, prompt_logprobs: list | None) -> tuple[list, list]:
        """Prompt token ids and their logprob positions (None where the engine gave none)."""
        given = list(prompt_logprobs or [])[: len(prompt.token_ids)]
        return list(prompt.token_ids), [None] * (len(prompt.token_ids) - len(given)) + given

    # -- not streaming --------------------------------------------------------------------------
    async def _response(self, req: CompletionRequest, request_id: str, prompts: list[PromptInput],
                        streams: list[RequestStream], model: str) -> Response:
        finals = await self.finals(streams)
        choices = []
        for i, (prompt, out) in enumerate(zip(prompts, finals)):
            prefix = self._prompt_text(prompt) if req.echo else ""
            for c in out.outputs:
                logprobs = None
                if req.logprobs is not None:
                    ids, positions = self._echo_logprobs(prompt, out.prompt_logprobs) if req.echo else ([], [])
                    logprobs = completion_logprobs(ids + list(c.token_ids), positions + list(c.logprobs or []),
                                                   req.logprobs, 0, self.ctx.token_text)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
        body = CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=_usage(streams, completion_tokens))
        return Response(body.model_dump_json(), media_type="application/json")

    # -- streaming ------------------------------------------------------------------------------
    async def _chunks(self, req: CompletionRequest, request_id: str, prompts: list[PromptInput],
                      streams: list[RequestStream], model: str) -> AsyncIterator[CompletionResponse]:
        created = int(time.time())
        sent: dict[int, int] = {}  # per choice index: characters streamed so far (text_offset), once started
        templates: dict[int, ChunkTemplate] = {}  # per choice index: its plain text chunks
        prompt_logprobs: dict[int, list] = {}  # per prompt: the engine sends them once, with its first delta
        completion_tokens = 0
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats
        try:
            async for i, delta in self.merged(streams):
                if delta.prompt_logprobs is not None:
                    prompt_logprobs.setdefault(i, delta.prompt_logprobs)
                for c in sorted(delta.outputs, key=lambda c: c.index):
                    completion_tokens += len(c.token_ids)
                    index = i * req.n + c.index
                    choice = self._choice(req, prompts[i], prompt_logprobs.get(i), c, index, sent)
                    if choice is None:
                        continue
                    if not continuous and choice.logprobs is None and choice.finish_reason is None:
                        template = templates.get(index) or templates.setdefault(index, ChunkTemplate(
                            CompletionResponse(id=request_id, created=created, model=model,
                                               choices=[CompletionChoice(index=index, text=ChunkTemplate.PLACEHOLDER)])))
                        yield template.render(choice.text)
                    else:
                        usage = _usage(streams, completion_tokens) if continuous else None
                        yield CompletionResponse(id=request_id, created=created, model=model,
                                                 choices=[choice], usage=usage)
            if include_usage:
                yield CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                         usage=_usage(streams, completion_tokens))
        finally:
            self.release(streams)

    def _choice(self, req: CompletionRequest, prompt: PromptInput, prompt_logprobs: list | None, c, index: int,
                sent: dict[int, int]) -> CompletionChoice | None:
        """The chunk choice of one sample's delta ``c`` (the echoed prompt first, once); None if empty."""
        first = index not in sent
        if not c.text and not c.token_ids and c.finish_reason is None and not (first and req.echo):
            return None
        text, ids, positions = c.text, c.token_ids, c.logprobs or []
        if req.echo and first:
            text = self._prompt_text(prompt) + text
        logprobs = None
        if req.logprobs is not None:
            if req.echo and first:
                prompt_ids, prompt_positions = self._echo_logprobs(prompt, prompt_logprobs)
                ids, positions = prompt_ids + ids, prompt_positions + positions
            logprobs = completion_logprobs(ids, positions, req.logprobs, sent.get(index, 0), self.ctx.token_text)
        sent[index] = sent.get(index, 0) + len(text)
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)


def _usage(streams: list[RequestStream], completion_tokens: int) -> Usage:
    prompt_tokens = sum(s.num_prompt_tokens for s in streams)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
