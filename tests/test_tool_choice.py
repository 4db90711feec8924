"""Tools in the chat template and forced tool calls, without a server (fast).

References: a chat template written here that renders tools, tool calls and tool results (as
Qwen's and Llama 3's do) through transformers' own ``apply_chat_template``; ``jsonschema`` for the
``required`` schema; the non-streamed calls for the streamed pieces.
"""

from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")

from podium.chat_template import render_chat  # noqa: E402
from podium_server.errors import APIError  # noqa: E402
from podium_server.protocol import ChatCompletionRequest  # noqa: E402
from podium_server.serving_chat import ChatHandler  # noqa: E402
from podium_server.tool_choice import (  # noqa: E402
    AUTO_NEEDS_PARSER,
    ToolCallStream,
    ToolMode,
    check_tools,
    parse_calls,
    required_schema,
    tool_mode,
)

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}({{ t.function.parameters.properties | list "
    "| join(',') }}){% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "a={{ c.function.arguments.a }} b={{ c.function.arguments.b }}{% endfor %}{% elif m.role == 'tool' %}"
    "RESULT[{{ m.tool_call_id }}]={{ m.content }}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


class _Tokenizer:
    """A tokenizer whose template is ``TEMPLATE``: transformers renders it (``apply_chat_template``)."""

    def __init__(self):
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        self.inner = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
        self.inner.chat_template = TEMPLATE
        self.chat_template = TEMPLATE
        self.rendered = None

    def apply_chat_template(self, conversation, **kwargs):
        self.rendered = self.inner.apply_chat_template(conversation, **{**kwargs, "tokenize": False})
        return [0]


def test_tools_and_tool_history_reach_the_template():
    request = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}], "tools": [ADD]})
    prompt = ChatHandler(ctx=None).chat_prompt(request.messages, True, tools=request.tools)  # what the engine gets
    tokenizer = _Tokenizer()
    render_chat(tokenizer, prompt, "m")  # the engine's rendering (LLMEngine.add_request)
    # (transformers renders templates with trim_blocks: the newline after a block tag goes)
    assert tokenizer.rendered == "TOOLS: add(a,b)<user>2 + 3?<assistant>CALL add a=2 b=3<tool>RESULT[call_1]=5<assistant>"


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


def test_tool_choice_modes_and_errors():
    functions = check_tools([ADD, NOW])
    assert tool_mode(_request(tools=[ADD, NOW], tool_choice="none"), functions) == (None, None)
    mode, params = tool_mode(_request(tools=[ADD, NOW], tool_choice={"type": "function", "function": {"name": "add"}}),
                             functions)
    assert mode == ToolMode("named", "add") and params.json == ADD["function"]["parameters"]
    mode, params = tool_mode(_request(tools=[ADD, NOW], tool_choice="required"), functions)
    assert mode == ToolMode("required")
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        tool_mode(_request(tools=[ADD]), functions)  # tools without tool_choice: auto
    assert "--tool-call-parser" in AUTO_NEEDS_PARSER
    with pytest.raises(APIError, match="'sub'"):
        tool_mode(_request(tools=[ADD], tool_choice={"type": "function", "function": {"name": "sub"}}), functions)
    with pytest.raises(APIError, match=r"tools\[0\]"):
        check_tools([{"type": "function", "function": {"description": "no name"}}])


def test_required_schema_accepts_calls_and_refuses_the_rest():
    schema = required_schema(check_tools([ADD, NOW]), parallel=None)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}], schema)
    for bad in ([], [{"name": "add", "parameters": {"a": 1}}], [{"name": "sub", "parameters": {}}],
                [{"name": "add", "parameters": {"a": 1, "b": 2}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(check_tools([ADD, NOW]), parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, single)


@pytest.mark.parametrize("mode,text", [
    (ToolMode("named", "add"), '{"a": 2, "b": 3}'),
    (ToolMode("required"), '[{"name": "add", "parameters": {"a": 2, "b": 3}}, {"name": "now", "parameters": {}}]')])
def test_streamed_pieces_reassemble_to_the_calls(mode, text):
    calls = parse_calls(mode, text)
    stream = ToolCallStream(mode)
    pieces = []
    for i in range(0, len(text), 3):  # three characters a delta
        pieces += stream.feed(text[i:i + 3], finished=False)
    pieces += stream.feed("", finished=True)
    merged: dict[int, dict] = {}
    for piece in pieces:
        entry = merged.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
        entry["arguments"] += piece.function.arguments or ""
    assert [(m["name"], json.loads(m["arguments"])) for _, m in sorted(merged.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert all(m["id"] for m in merged.values())
    assert parse_calls(mode, text[:-2]) is None  # cut short: no calls


def test_a_required_array_cut_short_streams_as_content():
    from podium_server.protocol import ChatStreamChoice, DeltaMessage
    from podium_server.serving_chat import _as_tool_calls

    stream = ToolCallStream(ToolMode("required"))
    first = _as_tool_calls(ChatStreamChoice(index=0, delta=DeltaMessage(content='[{"name": "ad')), stream)
    assert first.delta.tool_calls is None and first.delta.content is None
    last = _as_tool_calls(ChatStreamChoice(index=0, delta=DeltaMessage(content="d"), finish_reason="length"), stream)
    assert last.delta.content == '[{"name": "add' and last.finish_reason == "length"
