"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the same engine.

The messages become the conversation the chat template renders (``system`` first, ``tool_use``
blocks as the assistant's tool calls, ``tool_result`` blocks as tool messages). The output is
parsed like a chat completion's (``chat_output``) into content blocks: ``thinking`` (with a
reasoning parser), ``text`` and ``tool_use``. ``tool_choice`` ``auto`` (the default with tools)
uses the server's tool-call parser; ``{"type": "tool"}`` and ``{"type": "any"}`` constrain the
output with the tools' JSON schemas (``structured_outputs``), so the call is always well-formed.

Streaming sends Anthropic's events (``message_start``, per block ``content_block_start`` /
``content_block_delta`` / ``content_block_stop``, ``message_delta`` with the stop reason and
usage, ``message_stop``); errors use Anthropic's shape (``errors.APIError.anthropic_body``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from podium.chat_template import THINKING_SWITCH, ChatPrompt, render_chat
from podium.errors import ChatTemplateError, PodiumError
from podium.sampling_params import SamplingParams, StructuredOutputsParams

from .anthropic_protocol import AnthropicMessage, Block, CountTokensRequest, MessagesRequest
from .async_engine import RequestStream
from .chat_output import OutputDelta, OutputParsing, ParsedOutput, tool_call_handling
from .errors import APIError, bad_request, from_engine_error, logger, not_supported
from .serving_base import ServingBase


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class CountTokensHandler(ServingBase):
    async def handle(self, request: Request) -> Response:
        req = await self.parse(request, CountTokensRequest)
        self.check_model(req.model)
        try:  # rendered here, as the engine would (no request goes to it)
            ids = render_chat(self.ctx.tokenizer, chat_prompt(req), self.ctx.model_name)
        except ChatTemplateError as exc:
            raise from_engine_error(exc, "messages") from None
        return JSONResponse({"input_tokens": len(ids)})


class MessagesHandler(ServingBase):
    async def handle(self, request: Request) -> Response:
        req = await self.parse(request, MessagesRequest)
        lora = self.check_model(req.model)
        parsing, structured = tool_handling(self.ctx, req)
        structured = _output_format(req.output_config, structured)
        structured = parsing.after_reasoning(structured, self.ctx.tokenizer)
        params = _sampling_params(req, req.max_tokens, structured, parsing.keeps_special_tokens)
        message_id = _id("msg")
        (stream,) = await self.add_all(message_id, [chat_prompt(req)], [params], "messages",
                                       lora=lora)  # the engine renders it
        if req.stream:
            return anthropic_event_stream(self._events(req, message_id, stream, parsing))
        return await self.unless_disconnected(request, self._response(message_id, stream, parsing))

    async def _response(self, message_id: str, stream: RequestStream, parsing: OutputParsing) -> Response:
        (out,) = await self.finals([stream])
        c = out.outputs[0]
        parsed = parsing.final(c.text) if parsing.active else ParsedOutput(None, c.text, [])
        content = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content:
            content.append({"type": "text", "text": parsed.content})
        content += [{"type": "tool_use", "id": _id("toolu"), "name": call.name, "input": json.loads(call.arguments)}
                    for call in parsed.tool_calls]
        stop_reason, stop_sequence = _stop_reason(c, bool(parsed.tool_calls))
        return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": self.ctx.model_name,
                             "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                             "usage": {"input_tokens": stream.num_prompt_tokens, "output_tokens": len(c.token_ids)}})

    async def _events(self, req: MessagesRequest, message_id: str, stream: RequestStream,
                      parsing: OutputParsing) -> AsyncIterator[dict]:
        try:
            yield {"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": self.ctx.model_name, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": stream.num_prompt_tokens, "output_tokens": 0}}}
            blocks, text, output_tokens = _Blocks(), "", 0
            parsed = parsing.stream() if parsing.active else None
            async for out in stream.outputs():  # the engine's deltas (it holds back stop sequences)
                c = out.outputs[0]
                finished = c.finish_reason is not None
                if not c.text and not c.token_ids and not finished:
                    continue
                text += c.text
                output_tokens += len(c.token_ids)
                delta = parsed.update(text, finished) if parsed is not None else OutputDelta(content=c.text)
                for event in blocks.events(delta):
                    yield event
                if finished:
                    for event in blocks.close():
                        yield event
                    stop_reason, stop_sequence = _stop_reason(c, blocks.num_tool_calls > 0)
                    yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                           "usage": {"output_tokens": output_tokens}}
            yield {"type": "message_stop"}
        finally:
            self.release([stream])


class _Blocks:
    """The content blocks of a streamed message: which one is open, and the events that change it."""

    def __init__(self) -> None:
        self.index, self.kind, self.num_tool_calls = -1, None, 0

    def events(self, delta: OutputDelta) -> list[dict]:
        events = []
        if delta.reasoning:
            events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            if call.name is not None:
                self.num_tool_calls += 1
                events += self._open(f"tool_use{call.index}", {"type": "tool_use", "id": _id("toolu"),
                                                              "name": call.name, "input": {}})
            if call.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def close(self) -> list[dict]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _open(self, kind: str, block: dict) -> list[dict]:
        if self.kind == kind:
            return []
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


def anthropic_event_stream(events: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(_sse(events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    except (APIError, PodiumError) as exc:  # after the 200 went out: Anthropic's error event
        error = exc if isinstance(exc, APIError) else from_engine_error(exc)
        yield f"event: error\ndata: {json.dumps(error.anthropic_body())}\n\n"
    except Exception as exc:
        logger.exception("a stream failed")
        error = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
        yield f"event: error\ndata: {json.dumps(error.anthropic_body())}\n\n"


def _stop_reason(c, called_tools: bool) -> tuple[str | None, str | None]:
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    if c.finish_reason == "stop":
        return ("tool_use" if called_tools else "end_turn"), None
    return "end_turn", None


# -- request -> prompt and parameters -----------------------------------------------------------
def chat_prompt(req: CountTokensRequest) -> ChatPrompt:
    """The request as the conversation the chat template renders (the engine renders it)."""
    conversation = []
    system = _system_text(req.system)
    if system:
        conversation.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        conversation += _turn(i, message)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in req.tools or []]
    template_kwargs = {}
    if req.thinking is not None and req.thinking.get("type") in ("enabled", "disabled"):
        template_kwargs[THINKING_SWITCH] = req.thinking["type"] == "enabled"
    return ChatPrompt(conversation, True, tools=tools or None, template_kwargs=template_kwargs)


def _system_text(system: str | list[Block] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(_text_of(block, f"system[{j}]") for j, block in enumerate(system))


def _text_of(block: Block, where: str) -> str:
    text = (block.model_extra or {}).get("text")
    if block.type != "text" or not isinstance(text, str):
        raise bad_request(f"{where}: expected a text block {{'type': 'text', 'text': ...}}, got type {block.type!r}",
                          param=where)
    return text


def _turn(i: int, message: AnthropicMessage) -> list[dict]:
    """One Anthropic message as chat-template messages (tool results become ``tool`` messages)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(message.content):
        where, extra = f"messages[{i}].content[{j}]", block.model_extra or {}
        if block.type == "text":
            texts.append(_text_of(block, where))
        elif block.type == "tool_use" and message.role == "assistant":
            if not isinstance(extra.get("name"), str) or not isinstance(extra.get("input"), dict):
                raise bad_request(f"{where}: a tool_use block needs a name and an input object", param=where)
            calls.append({"id": str(extra.get("id", "")), "type": "function",
                          "function": {"name": extra["name"], "arguments": extra["input"]}})
        elif block.type == "tool_result" and message.role == "user":
            results.append({"role": "tool", "tool_call_id": str(extra.get("tool_use_id", "")),
                            "content": _result_text(extra.get("content"), where)})
        elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # earlier reasoning does not go back into the prompt
        elif block.type in ("image", "document", "search_result"):
            raise not_supported(f"{block.type} blocks are", where)
        else:
            raise bad_request(f"{where}: unknown or misplaced content block type {block.type!r} in a "
                              f"{message.role} message", param=where)
    turn = {"role": message.role, "content": "\n".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return results + ([turn] if texts or calls or not results else [])


def _result_text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(_text_of(Block.model_validate(b), f"{where}.content[{k}]") for k, b in enumerate(content))
    raise bad_request(f"{where}.content must be a string or a list of text blocks", param=f"{where}.content")


def tool_handling(ctx, req: MessagesRequest) -> tuple[OutputParsing, StructuredOutputsParams | None]:
    """How the request's tools are handled: parsed from free text, or forced by a grammar."""
    choice = req.tool_choice.type if req.tool_choice is not None else ("auto" if req.tools else "none")
    tools = {t.name: t.input_schema for t in req.tools or []}
    kind = {"any": "required", "tool": "named"}.get(choice, choice)
    return tool_call_handling(ctx, kind, tools, req.tool_choice.name if req.tool_choice else None)


def _output_format(config: dict | None, structured: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return structured
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                          param="output_config.format")
    if structured is not None:
        raise bad_request("output_config.format cannot be combined with tool_choice 'any' or 'tool'",
                          param="output_config.format")
    return StructuredOutputsParams(json=fmt["schema"])


def _sampling_params(req: MessagesRequest, max_tokens: int, structured: StructuredOutputsParams | None,
                     keep_special_tokens: bool) -> SamplingParams:
    # unset fields stay unset, so the model's generation_config.json defaults apply
    unset_is_default = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    try:
        return SamplingParams(max_tokens=max_tokens, stop=req.stop_sequences or None, structured_outputs=structured,
                              skip_special_tokens=not keep_special_tokens,
                              **{k: v for k, v in unset_is_default.items() if v is not None})
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc)) from None
