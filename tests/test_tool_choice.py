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
    check_tools,
    required_schema,
    tool_mode,
)
from podium_server.tool_parsers import ToolCallStream  # noqa: E402
from podium_server.tool_parsers.forced import NamedToolParser, RequiredToolsParser  # noqa: E402

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
    parser, params = tool_mode(_request(tools=[ADD, NOW], tool_choice={"type": "function", "function": {"name": "add"}}),
                               functions)
    assert isinstance(parser, NamedToolParser) and parser.tool_name == "add"
    assert params.json == ADD["function"]["parameters"]
    parser, params = tool_mode(_request(tools=[ADD, NOW], tool_choice="required"), functions)
    assert isinstance(parser, RequiredToolsParser) and params.json == required_schema(functions, None)
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


@pytest.mark.parametrize("parser,text,calls", [
    (NamedToolParser("add"), '{"a": 2, "b": 3}', [("add", {"a": 2, "b": 3})]),
    (RequiredToolsParser(), '[{"name": "add", "parameters": {"a": 2, "b": 3}}, {"name": "now", "parameters": {}}]',
     [("add", {"a": 2, "b": 3}), ("now", {})])], ids=["named", "required"])
def test_forced_calls_stream_in_openais_shape_and_reassemble(parser, text, calls):
    """A forced call streams as the grammar writes it: its first delta has the index, id and name
    (arguments empty), the next ones argument fragments, before the text is complete; the pieces
    add up to the non-streamed calls."""
    extracted = parser.extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == calls and extracted.content == ""
    stream = ToolCallStream(parser)
    deltas = []
    for i in range(1, len(text) + 1):  # one character a delta
        deltas.append(stream.update(text[:i], final=i == len(text)))
    pieces = [piece for delta in deltas for piece in delta.tool_calls]
    assert all(not d.content for d in deltas)
    first_args = next(i for i, d in enumerate(deltas) if any(p.arguments for p in d.tool_calls))
    assert first_args < len(text) // 2  # arguments stream while the output is being generated
    merged: dict[int, dict] = {}
    for piece in pieces:
        if piece.index not in merged:  # the first delta of a call: id and name, no arguments yet
            assert piece.id and piece.name and piece.arguments == ""
            merged[piece.index] = {"name": piece.name, "arguments": ""}
        else:
            assert piece.id is None and piece.name is None
        merged[piece.index]["arguments"] += piece.arguments
    assert [(m["name"], json.loads(m["arguments"])) for _, m in sorted(merged.items())] == calls
    assert [m["arguments"] for _, m in sorted(merged.items())] == [c.arguments for c in extracted.calls]


def test_a_required_array_cut_short_is_content():
    """A ``required`` array cut short (max_tokens) does not parse: the non-streamed answer is its text."""
    cut = '[{"name": "add", "parameters": {"a": 2'
    extracted = RequiredToolsParser().extract(cut)
    assert extracted.calls == [] and extracted.content == cut
    with pytest.raises(ValueError):
        RequiredToolsParser().parse('{"name": "add"}', final=True)


def test_a_constraint_waits_for_the_reasoning_parsers_section():
    """With a reasoning parser the server hands the engine its markers as token ids (the grammar
    starts after </think>); Qwen3's section is optional, DeepSeek R1's is not; without a parser, or
    without a constraint, nothing changes."""
    from podium.sampling_params import ReasoningMarkers, StructuredOutputsParams
    from podium_server.chat_output import OutputParsing
    from podium_server.reasoning import get_reasoning_parser

    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return {"<think>": [7], "</think>": [8, 9]}[text]

    constraint = StructuredOutputsParams(json={"type": "object"})
    for name, optional in (("deepseek_r1", False), ("qwen3", True)):
        gated = OutputParsing(reasoning=get_reasoning_parser(name)).after_reasoning(constraint, Tokenizer())
        assert gated.reasoning == ReasoningMarkers((7,), (8, 9), optional) and gated.json == constraint.json
    assert OutputParsing().after_reasoning(constraint, Tokenizer()) is constraint
    assert OutputParsing(reasoning=get_reasoning_parser("qwen3")).after_reasoning(None, Tokenizer()) is None
