"""``POST /v1/chat/completions``: messages through the model's chat template, ``n`` choices.

Streaming sends, per choice, a role delta first, then content deltas, then a chunk with the
finish reason; then a usage chunk if ``stream_options.include_usage``; then ``[DONE]``. Tools,
images, audio and structured output are refused with a 400 "not supported yet".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from podium.outputs import RequestOutput

from .async_engine import RequestStream
from .errors import bad_request
from .logprobs import chat_logprobs
from .protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    Usage,
    random_id,
)
from .serving_base import ChunkTemplate, ServingBase, StreamCursor, reject_unsupported, stop_list

_PART_NAMES = {"image_url": "images are", "input_image": "images are", "input_audio": "audio input is",
               "file": "file inputs are", "video_url": "video inputs are"}
_MESSAGE_EXTRAS_REFUSED = {"tool_calls": "tool calls are", "function_call": "function calls are",
                           "audio": "audio is"}


class ChatHandler(ServingBase):
    async def handle(self, request: Request) -> Response:
        req = await self.parse(request, ChatCompletionRequest)
        self.check_model(req.model)
        self.check_sampling(req)
        self.check_chat_features(req)
        prompt = self.render(req.messages, req.add_generation_prompt)
        max_tokens = self.max_tokens_for(len(prompt), req.max_completion_tokens or req.max_tokens, "messages")
        top_n = None
        if req.logprobs:
            top_n = req.top_logprobs or 0
        elif req.top_logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=top_n)
        request_id = random_id("chatcmpl")
        streams = await self.add_all(request_id, [prompt], [params], "messages")
        if req.stream:
            return self.event_stream(self._chunks(req, request_id, len(prompt), streams[0]))
        return await self.unless_disconnected(request, self._response(req, request_id, len(prompt), streams[0]))

    @staticmethod
    def check_chat_features(req: ChatCompletionRequest) -> None:
        reject_unsupported(req.tools or req.functions, "tools (function calling) are", "tools")
        reject_unsupported(req.tool_choice not in (None, "none") or req.function_call not in (None, "none"),
                           "tool_choice is", "tool_choice")
        if req.response_format is not None and req.response_format.type != "text":
            reject_unsupported(True, f"response_format {req.response_format.type!r} is", "response_format")
        reject_unsupported(req.modalities not in (None, ["text"]), "modalities other than text are", "modalities")
        reject_unsupported(req.audio, "audio output is", "audio")

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        conversation = [self._message(i, m) for i, m in enumerate(messages)]
        try:
            return chat_prompt(self.ctx.tokenizer, self.ctx.model_name, conversation, add_generation_prompt)
        except Exception as exc:  # a template that rejects this conversation, or no template at all
            raise bad_request(f"cannot apply the chat template to these messages: {exc}", param="messages") from None

    @staticmethod
    def _message(i: int, message: ChatMessage) -> dict:
        reject_unsupported(message.role in ("tool", "function"), f"{message.role} messages are", f"messages[{i}].role")
        for key, value in (message.model_extra or {}).items():
            if value is not None and key in _MESSAGE_EXTRAS_REFUSED:
                reject_unsupported(True, _MESSAGE_EXTRAS_REFUSED[key], f"messages[{i}].{key}")
            elif value is not None and key not in ("refusal",):
                raise bad_request(f"Unrecognized message field: messages[{i}].{key}", param=f"messages[{i}].{key}")
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                reject_unsupported(part.type in _PART_NAMES, _PART_NAMES.get(part.type, ""), where)
                if part.type != "text" or part.text is None:
                    raise bad_request(f"{where}: a content part must be {{'type': 'text', 'text': ...}}", param=where)
                texts.append(part.text)
            content = "\n".join(texts)
        role = "system" if message.role == "developer" else message.role
        return {"role": role, "content": content or ""}

    # -- not streaming --------------------------------------------------------------------------
    async def _response(self, req: ChatCompletionRequest, request_id: str, prompt_len: int,
                        stream: RequestStream) -> Response:
        (out,) = await self.finals([stream])
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            logprobs = None
            if req.logprobs:
                logprobs = chat_logprobs(list(c.token_ids), list(c.logprobs or []), req.top_logprobs or 0,
                                         self.ctx.token_text)
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text), logprobs=logprobs,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        body = ChatCompletionResponse(id=request_id, model=self.ctx.model_name, choices=choices,
                                      usage=_usage(prompt_len, out))
        return Response(body.model_dump_json(), media_type="application/json")

    # -- streaming ------------------------------------------------------------------------------
    async def _chunks(self, req: ChatCompletionRequest, request_id: str, prompt_len: int,
                      stream: RequestStream) -> AsyncIterator[ChatCompletionChunk]:
        created, stop, model = int(time.time()), stop_list(req.stop), self.ctx.model_name
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats

        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)

        try:
            for index in range(req.n):
                yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            cursors = [StreamCursor() for _ in range(req.n)]
            templates = [ChunkTemplate(chunk([ChatStreamChoice(index=index, delta=DeltaMessage(
                content=ChunkTemplate.PLACEHOLDER))])) for index in range(req.n)]  # plain content deltas
            last = None
            async for out in stream.outputs():
                last = out
                for c in sorted(out.outputs, key=lambda c: c.index):
                    choice = self._delta(req, c, cursors[c.index], stop)
                    if choice is None:
                        continue
                    if not continuous and choice.logprobs is None and choice.finish_reason is None:
                        yield templates[c.index].render(choice.delta.content)
                    else:
                        yield chunk([choice], _usage(prompt_len, out) if continuous else None)
            if include_usage and last is not None:
                yield chunk([], _usage(prompt_len, last))
        finally:
            self.release([stream])

    def _delta(self, req: ChatCompletionRequest, c, cursor: StreamCursor, stop: list[str]) -> ChatStreamChoice | None:
        new = cursor.advance(c, stop)
        if new is None:
            return None
        text, ids, positions = new
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(ids, positions, req.top_logprobs or 0, self.ctx.token_text)
        finished = c.finish_reason is not None
        delta = DeltaMessage(content=text) if text or not finished else DeltaMessage()
        return ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                finish_reason=c.finish_reason if finished else None)


def chat_prompt(tokenizer: Any, model_name: str, conversation: list[dict], add_generation_prompt: bool) -> list[int]:
    """The conversation's token ids through the tokenizer's chat template (``LLMEngine.apply_chat_template``
    does the same; here it runs in the server's process, whichever engine mode)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model_name!r} has no chat template; use completions with a plain prompt")
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _usage(prompt_len: int, out: RequestOutput) -> Usage:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return Usage(prompt_tokens=prompt_len, completion_tokens=completion, total_tokens=prompt_len + completion)
