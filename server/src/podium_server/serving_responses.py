"""``POST /v1/responses``: OpenAI's Responses API, stateless (nothing is stored; ``previous_response_id``
is refused).

``input`` (a string, or message and function-call items) and ``instructions`` become the chat
template's conversation; ``text.format`` (``json_schema`` / ``json_object``) constrains the output
through ``structured_outputs``; function ``tools`` work as in chat completions (``auto`` through the
tool-call parser, ``required`` or a named function through a grammar). The output items are a
``reasoning`` item (with a reasoning parser), a ``message`` with the text, and ``function_call``s.

Streaming sends the Responses events: ``response.created``, ``response.in_progress``, per output
item ``response.output_item.added`` ... ``response.output_item.done`` (with the text, reasoning or
arguments deltas in between), then ``response.completed`` (or ``response.incomplete``).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from podium.chat_template import ChatPrompt
from podium.errors import PodiumError
from podium.sampling_params import SamplingParams, StructuredOutputsParams

from .async_engine import RequestStream
from .chat_output import OutputDelta, OutputParsing, ParsedOutput, tool_call_handling
from .errors import APIError, bad_request, from_engine_error, logger, not_supported
from .protocol import StrictModel
from .serving_base import ServingBase


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    # accepted, without effect on the output: bookkeeping of OpenAI's service
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponsesHandler(ServingBase):
    async def handle(self, request: Request) -> Response:
        req = await self.parse(request, ResponsesRequest)
        lora = self.check_model(req.model)
        if req.previous_response_id is not None:
            raise not_supported("previous_response_id (this server stores no responses; send the whole "
                                "conversation as input) is", "previous_response_id")
        if req.background:
            raise not_supported("background responses are", "background")
        tools = _function_tools(req.tools or [])
        prompt = self._render(req, tools)
        parsing, structured = _tool_choice(self.ctx, req, tools)
        structured = _text_format(req.text, structured)
        structured = parsing.after_reasoning(structured, self.ctx.tokenizer)
        unset_is_default = {"temperature": req.temperature, "top_p": req.top_p}
        try:
            params = SamplingParams(max_tokens=req.max_output_tokens, structured_outputs=structured,
                                    skip_special_tokens=not parsing.keeps_special_tokens,
                                    **{k: v for k, v in unset_is_default.items() if v is not None})
        except (ValueError, TypeError) as exc:
            raise bad_request(str(exc)) from None
        response_id = _id("resp")
        (stream,) = await self.add_all(response_id, [prompt], [params], "input", lora=lora)  # the engine renders it
        response = _Response(response_id, self.response_model(lora), req, stream.num_prompt_tokens)
        if req.stream:
            return StreamingResponse(_sse(self._events(response, stream, parsing)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self.unless_disconnected(request, self._whole(response, stream, parsing))

    def _render(self, req: ResponsesRequest, tools: dict[str, dict]) -> ChatPrompt:
        conversation = [{"role": "system", "content": req.instructions}] if req.instructions else []
        items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
        for i, item in enumerate(items):
            _add_item(conversation, item, f"input[{i}]")
        template_tools = [{"type": "function", "function": {"name": name, **spec}} for name, spec in tools.items()]
        return ChatPrompt(conversation, True, tools=template_tools or None)

    async def _whole(self, response: _Response, stream: RequestStream, parsing: OutputParsing) -> Response:
        (out,) = await self.finals([stream])
        c = out.outputs[0]
        parsed = parsing.final(c.text) if parsing.active else ParsedOutput(None, c.text, [])
        if parsed.reasoning:
            response.output.append(_reasoning_item(_id("rs"), parsed.reasoning))
        if parsed.content or not parsed.tool_calls:
            response.output.append(_message_item(_id("msg"), parsed.content))
        for call in parsed.tool_calls:
            response.output.append(_call_item(_id("fc"), call.id, call.name, call.arguments))
        return JSONResponse(response.finished(c.finish_reason, len(c.token_ids)))

    async def _events(self, response: _Response, stream: RequestStream,
                      parsing: OutputParsing) -> AsyncIterator[dict]:
        try:
            yield {"type": "response.created", "response": response.body("in_progress")}
            yield {"type": "response.in_progress", "response": response.body("in_progress")}
            items, text, output_tokens = _Items(response), "", 0
            parsed = parsing.stream() if parsing.active else None
            async for out in stream.outputs():  # the engine's deltas
                c = out.outputs[0]
                finished = c.finish_reason is not None
                if not c.text and not c.token_ids and not finished:
                    continue
                text += c.text
                output_tokens += len(c.token_ids)
                delta = parsed.update(text, finished) if parsed is not None else OutputDelta(content=c.text)
                for event in items.events(delta):
                    yield event
                if finished:
                    if not response.output and not items.open:
                        for event in items.events(OutputDelta(), empty_message=True):
                            yield event
                    for event in items.close():
                        yield event
                    body = response.finished(c.finish_reason, output_tokens)
                    yield {"type": f"response.{body['status']}", "response": body}
        finally:
            self.release([stream])


class _Response:
    """The response object: its fixed fields and the output items built so far."""

    def __init__(self, response_id: str, model: str, req: ResponsesRequest, prompt_len: int) -> None:
        self.id, self.model, self.req, self.prompt_len = response_id, model, req, prompt_len
        self.created_at = int(time.time())
        self.output: list[dict] = []

    def body(self, status: str, output_tokens: int = 0, incomplete: str | None = None) -> dict:
        req = self.req
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": self.output, "instructions": req.instructions, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "store": False,
                "text": req.text or {"format": {"type": "text"}}, "metadata": req.metadata or {},
                "usage": {"input_tokens": self.prompt_len, "output_tokens": output_tokens,
                          "total_tokens": self.prompt_len + output_tokens,
                          "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}}

    def finished(self, finish_reason: str | None, output_tokens: int) -> dict:
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        return self.body("incomplete" if incomplete else "completed", output_tokens, incomplete)


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class _Items:
    """The output items of a streamed response: the open one and the events that change it."""

    def __init__(self, response: _Response) -> None:
        self.response = response
        self.open: dict | None = None  # {"kind", "id", "text", and for calls "call_id", "name"}

    def events(self, delta: OutputDelta, empty_message: bool = False) -> list[dict]:
        events = []
        if delta.reasoning:
            events += self._start("reasoning")
            self.open["text"] += delta.reasoning
            events.append(self._event("response.reasoning_text.delta", content_index=0, delta=delta.reasoning))
        if delta.content or empty_message:
            events += self._start("message")
            self.open["text"] += delta.content
            if delta.content:
                events.append(self._event("response.output_text.delta", content_index=0, delta=delta.content,
                                          logprobs=[]))
        for call in delta.tool_calls:
            if call.name is not None:
                events += self._start("function_call", call_id=call.id, name=call.name)
            if call.arguments:
                self.open["text"] += call.arguments
                events.append(self._event("response.function_call_arguments.delta", delta=call.arguments))
        return events

    def close(self) -> list[dict]:
        item = self.open
        if item is None:
            return []
        events = []
        if item["kind"] == "reasoning":
            done = _reasoning_item(item["id"], item["text"])
            events.append(self._event("response.reasoning_text.done", content_index=0, text=item["text"]))
        elif item["kind"] == "message":
            done = _message_item(item["id"], item["text"])
            events.append(self._event("response.output_text.done", content_index=0, text=item["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", content_index=0, part=_text_part(item["text"])))
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], item["text"])
            events.append(self._event("response.function_call_arguments.done", arguments=item["text"]))
        self.response.output.append(done)
        events.append({"type": "response.output_item.done", "output_index": len(self.response.output) - 1,
                       "item": done})
        self.open = None
        return events

    def _start(self, kind: str, call_id: str | None = None, name: str | None = None) -> list[dict]:
        if self.open is not None and self.open["kind"] == kind and kind != "function_call":
            return []
        events = self.close()
        item_id = _id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.open = {"kind": kind, "id": item_id, "text": "", "call_id": call_id, "name": name}
        item = {"reasoning": lambda: _reasoning_item(item_id, "", "in_progress"),
                "message": lambda: _message_item(item_id, "", "in_progress"),
                "function_call": lambda: _call_item(item_id, call_id, name, "", "in_progress")}[kind]()
        events.append({"type": "response.output_item.added", "output_index": len(self.response.output), "item": item})
        if kind == "message":
            events.append(self._event("response.content_part.added", content_index=0, part=_text_part("")))
        return events

    def _event(self, kind: str, **fields) -> dict:
        return {"type": kind, "item_id": self.open["id"], "output_index": len(self.response.output), **fields}


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    sequence = 0
    try:
        async for event in events:
            event["sequence_number"] = sequence
            sequence += 1
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    except (APIError, PodiumError) as exc:  # after the 200 went out: an error event ends the stream
        error = exc if isinstance(exc, APIError) else from_engine_error(exc)
        yield f"event: error\ndata: {json.dumps({'type': 'error', 'sequence_number': sequence, **error.body()})}\n\n"
    except Exception as exc:
        logger.exception("a stream failed")
        error = APIError(500, f"internal server error: {type(exc).__name__}: {exc}")
        yield f"event: error\ndata: {json.dumps({'type': 'error', 'sequence_number': sequence, **error.body()})}\n\n"


# -- request -> conversation and parameters -----------------------------------------------------
def _add_item(conversation: list[dict], item: dict, where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"{where}.role must be user, assistant, system or developer, got {role!r}",
                              param=f"{where}.role")
        conversation.append({"role": "system" if role == "developer" else role,
                             "content": _item_text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {"id": str(item.get("call_id", "")), "type": "function",
                "function": {"name": item.get("name"), "arguments": _json_or_text(item.get("arguments", "{}"))}}
        if conversation and conversation[-1]["role"] == "assistant":
            conversation[-1].setdefault("tool_calls", []).append(call)
        else:
            conversation.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        conversation.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": output if isinstance(output, str) else json.dumps(output)})
    elif kind == "reasoning":
        return  # earlier reasoning does not go back into the prompt
    else:
        raise not_supported(f"input items of type {kind!r} are", f"{where}.type")


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise not_supported(f"{kind} parts are", f"{where}[{j}]")
        else:
            raise bad_request(f"{where}[{j}] must be {{'type': 'input_text', 'text': ...}}", param=f"{where}[{j}]")
    return "\n".join(texts)


def _json_or_text(arguments: Any) -> Any:
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def _function_tools(tools: list[dict]) -> dict[str, dict]:
    """name -> {"description", "parameters"} of the function tools (other tool types are refused)."""
    out = {}
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise not_supported(f"tools of type {tool.get('type')!r} are", f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string", param=f"tools[{i}].name")
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema object", param=f"tools[{i}].parameters")
        out[tool["name"]] = {"description": tool.get("description") or "", "parameters": parameters}
    return out


def _tool_choice(ctx, req: ResponsesRequest, tools: dict[str, dict]) -> tuple[OutputParsing, Any]:
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    schemas = {name: spec["parameters"] for name, spec in tools.items()}
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise not_supported(f"tool_choice of type {choice.get('type')!r} is", "tool_choice")
        return tool_call_handling(ctx, "named", schemas, choice.get("name"))
    if choice not in ("auto", "none", "required"):
        raise bad_request(f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}",
                          param="tool_choice")
    return tool_call_handling(ctx, choice, schemas)


def _text_format(text: dict | None, structured: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return structured
    if structured is not None:
        raise bad_request("text.format cannot be combined with a required or named tool_choice", param="text.format")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", param="text.format.schema")
        return StructuredOutputsParams(json=fmt["schema"])
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                      param="text.format.type")
