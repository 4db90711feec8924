"""``POST /v1/chat/completions``: messages through the model's chat template, ``n`` choices.

The messages go to the engine as a ``ChatPrompt``: it renders them with the model's chat template
(``reasoning_effort`` sets the template's thinking switch where it has one; ``tools`` are the
template's variable, and the history may hold assistant ``tool_calls`` and ``tool`` messages) and
checks the context. ``tool_choice`` "required" or a named function is enforced by a grammar
(``tool_choice``); ``response_format`` and vLLM's constraint fields by ``structured_outputs``.
Streaming sends, per choice, a role delta first, then the engine's content deltas as they come (or
``tool_calls`` pieces), then a chunk with the finish reason; then a usage chunk if
``stream_options.include_usage``; then ``[DONE]``. With a reasoning parser, tools and
``tool_choice`` "auto" (``chat_output``: the server's tool-call parser) or a forced tool choice (its
forced-call parser), the text is split into ``reasoning_content``, ``content`` and ``tool_calls``
(streamed as their own deltas); a constraint then applies to the answer after the reasoning.
Images and audio are refused with a 400 "not supported yet".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from podium.chat_template import THINKING_SWITCH, ChatPrompt, template_source

from .async_engine import RequestStream
from .chat_output import OutputParsing, OutputStream, output_parsing
from .errors import bad_request, logger
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
    FunctionCall,
    ToolCall,
    Usage,
    random_id,
)
from .serving_base import ChunkTemplate, ServingBase, log_ignored, reject_unsupported
from .structured_outputs import from_response_format, structured_outputs
from .tool_choice import check_tools, template_messages, tool_mode

_PART_NAMES = {"image_url": "images are", "input_image": "images are", "input_audio": "audio input is",
               "file": "file inputs are", "video_url": "video inputs are"}
_MESSAGE_EXTRAS_REFUSED = {"function_call": "function calls are", "audio": "audio is"}
_MESSAGE_FIELDS_KEPT = ("name", "tool_calls", "tool_call_id")  # passed to the template as they are


class ChatHandler(ServingBase):
    async def handle(self, request: Request) -> Response:
        req = await self.parse(request, ChatCompletionRequest)
        lora = self.check_model(req.model)
        self.check_sampling(req)
        self.check_chat_features(req)
        log_ignored(req)
        functions = check_tools(req.tools)
        forced, tool_constraint = tool_mode(req, functions, auto_tool_choice=self.auto_tool_choice)
        constraint = structured_outputs(req, ("response_format", from_response_format(req.response_format)),
                                        ("tool_choice", tool_constraint))
        # the model's own tool calls are parsed only from unconstrained text (a response_format's
        # JSON is the answer, not a call); a grammar's forced calls by their own parser
        tools_auto = constraint is None and bool(functions) and req.tool_choice in (None, "auto")
        parsing = output_parsing(self.ctx, tools_auto, forced)
        constraint = parsing.after_reasoning(constraint, self.ctx.tokenizer)
        prompt = self.chat_prompt(req.messages, req.add_generation_prompt, self._template_kwargs(req), req.tools)
        top_n = None
        if req.logprobs:
            top_n = req.top_logprobs or 0
        elif req.top_logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
        params = self.sampling_params(req, max_tokens=req.max_completion_tokens or req.max_tokens, logprobs=top_n,
                                      constraint=constraint)
        if parsing.keeps_special_tokens:
            params.skip_special_tokens = False
        if req.prediction is not None:  # the engine's n-gram proposer reads it (nothing else does)
            params.prediction = req.prediction.text
        request_id = random_id("chatcmpl")
        (stream,) = await self.add_all(request_id, [prompt], [params], "messages", req.priority, lora)
        model = self.response_model(lora)
        if req.stream:
            return self.event_stream(self._chunks(req, request_id, stream, parsing, model))
        return await self.unless_disconnected(request, self._response(req, request_id, stream, parsing, model))

    @property
    def auto_tool_choice(self) -> bool:
        """Whether the model may choose its calls: ``--enable-auto-tool-choice`` with a ``--tool-call-parser``."""
        return self.ctx.auto_tool_choice and bool(self.ctx.tool_call_parser)

    def _template_kwargs(self, req: ChatCompletionRequest) -> dict:
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None and THINKING_SWITCH not in kwargs:
            if THINKING_SWITCH in (template_source(self.ctx.tokenizer) or ""):
                kwargs[THINKING_SWITCH] = req.reasoning_effort not in ("none", "minimal")
            else:
                logger.debug("reasoning_effort=%s ignored: the chat template has no thinking switch",
                             req.reasoning_effort)
        return kwargs

    @staticmethod
    def check_chat_features(req: ChatCompletionRequest) -> None:
        reject_unsupported(req.functions, "functions (the legacy form of tools) are", "functions")
        reject_unsupported(req.function_call not in (None, "none"), "function_call (use tool_choice) is",
                           "function_call")
        reject_unsupported(req.modalities not in (None, ["text"]), "modalities other than text are", "modalities")
        reject_unsupported(req.audio, "audio output is", "audio")

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    template_kwargs: dict | None = None, tools: list[dict] | None = None) -> ChatPrompt:
        """The messages as the engine's chat template takes them (checked here: only text content;
        tool calls' arguments parsed, as templates read them), with ``tools`` as its variable."""
        conversation = template_messages([self._message(i, m) for i, m in enumerate(messages)])
        return ChatPrompt(conversation, add_generation_prompt, tools=tools or None,
                          template_kwargs=template_kwargs or {})

    @staticmethod
    def _message(i: int, message: ChatMessage) -> dict:
        reject_unsupported(message.role == "function", "function messages (use tool) are", f"messages[{i}].role")
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
        kept = {key: getattr(message, key) for key in _MESSAGE_FIELDS_KEPT if getattr(message, key) is not None}
        return {"role": role, "content": content or "", **kept}

    # -- not streaming --------------------------------------------------------------------------
    async def _response(self, req: ChatCompletionRequest, request_id: str, stream: RequestStream,
                        parsing: OutputParsing, model: str) -> Response:
        (out,) = await self.finals([stream])
        choices = []
        for c in out.outputs:
            logprobs = None
            if req.logprobs:
                logprobs = chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0, self.ctx.token_text)
            message, finish_reason = ChatResponseMessage(content=c.text), c.finish_reason
            if parsing.active:
                message, finish_reason = _parsed_message(parsing, c.text, c.finish_reason)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                      finish_reason=finish_reason, stop_reason=c.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        body = ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=_usage(stream.num_prompt_tokens, completion_tokens))
        return Response(body.model_dump_json(), media_type="application/json")

    # -- streaming ------------------------------------------------------------------------------
    async def _chunks(self, req: ChatCompletionRequest, request_id: str, stream: RequestStream,
                      parsing: OutputParsing, model: str) -> AsyncIterator[ChatCompletionChunk]:
        """The engine's deltas as chunks: each new text goes out as it is (the engine held back what
        a stop string might still cut), one chunk per choice that changed; with parsers, a choice's
        text as its reasoning, content and ``tool_calls`` pieces."""
        created = int(time.time())
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = include_usage and req.stream_options.continuous_usage_stats

        def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)

        try:
            for index in range(req.n):
                yield chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            parsed = [_ParsedChoice(parsing.stream()) for _ in range(req.n)] if parsing.active else None
            templates = [ChunkTemplate(chunk([ChatStreamChoice(index=index, delta=DeltaMessage(
                content=ChunkTemplate.PLACEHOLDER))])) for index in range(req.n)]  # plain content deltas
            completion_tokens = 0
            async for delta in stream.outputs():
                for c in sorted(delta.outputs, key=lambda c: c.index):
                    completion_tokens += len(c.token_ids)
                    if parsed is not None:
                        usage = _usage(stream.num_prompt_tokens, completion_tokens) if continuous else None
                        for choice in self._parsed_deltas(req, c, parsed[c.index]):
                            yield chunk([choice], usage)
                        continue
                    choice = self._choice(req, c)
                    if choice is None:
                        continue
                    if not continuous and choice.logprobs is None and choice.finish_reason is None:
                        yield templates[c.index].render(choice.delta.content)
                    else:
                        usage = _usage(stream.num_prompt_tokens, completion_tokens) if continuous else None
                        yield chunk([choice], usage)
            if include_usage:
                yield chunk([], _usage(stream.num_prompt_tokens, completion_tokens))
        finally:
            self.release([stream])

    def _choice(self, req: ChatCompletionRequest, c) -> ChatStreamChoice | None:
        """The chunk choice of one sample's delta ``c``; None when it brings nothing to send."""
        finished = c.finish_reason is not None
        if not c.text and not c.token_ids and not finished:
            return None
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0, self.ctx.token_text)
        delta = DeltaMessage(content=c.text) if c.text or not finished else DeltaMessage()
        return ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                finish_reason=c.finish_reason if finished else None)

    def _parsed_deltas(self, req: ChatCompletionRequest, c, parsed: _ParsedChoice) -> list[ChatStreamChoice]:
        """A choice's new reasoning/content (one chunk) and tool-call deltas (one chunk each), from
        the delta ``c`` of one sample."""
        finished = c.finish_reason is not None
        if not c.text and not c.token_ids and not finished:
            return []
        parsed.text += c.text
        delta = parsed.stream.update(parsed.text, finished)
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0, self.ctx.token_text)
        choices = []
        if delta.reasoning or delta.content or logprobs is not None:
            choices.append(ChatStreamChoice(index=c.index, logprobs=logprobs, delta=DeltaMessage(
                content=delta.content or None, reasoning_content=delta.reasoning or None)))
        for call in delta.tool_calls:
            function = FunctionCall(name=call.name, arguments=call.arguments)
            choices.append(ChatStreamChoice(index=c.index, delta=DeltaMessage(tool_calls=[ToolCall(
                index=call.index, id=call.id, type="function" if call.id else None, function=function)])))
        if finished:
            reason = "tool_calls" if parsed.stream.num_tool_calls and c.finish_reason == "stop" else c.finish_reason
            choices.append(ChatStreamChoice(index=c.index, delta=DeltaMessage(), finish_reason=reason))
        return choices


class _ParsedChoice:
    """A streamed choice's text so far and its parser state."""

    def __init__(self, stream: OutputStream) -> None:
        self.stream, self.text = stream, ""


def _parsed_message(parsing: OutputParsing, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str]:
    parsed = parsing.final(text)
    calls = [ToolCall(id=c.id, type="function", function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.tool_calls]
    message = ChatResponseMessage(content=parsed.content or (None if calls else ""), reasoning_content=parsed.reasoning,
                                  tool_calls=calls or None)
    return message, "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
