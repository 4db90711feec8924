"""Today's OpenAI request fields, the official SDK, and the request fields vLLM adds (scripted engine).

The official ``openai`` SDK sends current Chat Completions fields (``reasoning_effort``,
``prompt_cache_key``, ``safety_identifier``, ...): the server accepts them, uses what it can
(``reasoning_effort`` sets the chat template's ``enable_thinking`` where the template has one, which
changes the rendered prompt and so the scripted answer) and still refuses unknown fields. The
``Authorization`` scheme is case-insensitive (RFC 7235). vLLM's ``priority`` reaches the engine.
"""

from __future__ import annotations

import json

import httpx
import pytest
from scripted_engine import Knobs, LetterTokenizer, ScriptedEngine, expected
from test_server_plumbing import ThreadServer

from podium_server.app import create_app
from podium_server.settings import ServerSettings
from podium_server.thread_engine import ThreadEngine

openai = pytest.importorskip("openai")


class ThinkingLetters(LetterTokenizer):
    """A template with Qwen3's thinking switch: the prompt ends in "t" when thinking, "n" when not."""

    chat_template = "{{ messages }}{% if enable_thinking is defined and not enable_thinking %}n{% endif %}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs) -> list[int]:
        switch = {True: "t", False: "n"}.get(kwargs.get("enable_thinking"), "")
        return super().apply_chat_template(messages, add_generation_prompt, tokenize) + self.encode(switch)


class RecordingEngine(ScriptedEngine):
    """Remembers the priority and the predicted output each request was added with."""

    def __init__(self) -> None:
        super().__init__(Knobs())
        self.tokenizer = ThinkingLetters()
        self.priorities: dict[str, int] = {}
        self.predictions: dict[str, str | None] = {}

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0, output_kind="cumulative"):
        self.priorities[request_id] = priority
        self.predictions[request_id] = params.prediction
        return super().add_request(request_id, prompt, params, arrival_time, priority, output_kind)


@pytest.fixture(scope="module")
def served():
    engine = RecordingEngine()
    with ThreadServer(create_app(ServerSettings(api_key="sesame"), ThreadEngine(engine))) as srv:
        yield srv.url, engine


def chat_ids(thinking: str) -> list[int]:
    return LetterTokenizer().encode("uhia" + thinking)  # "user: hi", the generation prompt "a", the switch


def test_the_sdk_sends_todays_chat_fields_and_gets_200(served):
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame")
    reply = client.chat.completions.create(
        model="letters", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        reasoning_effort="low", prompt_cache_key="conversation-7", safety_identifier="user-hash-1",
        verbosity="low", store=False, metadata={"team": "a"}, service_tier="auto", parallel_tool_calls=False,
        prediction={"type": "content", "content": "abcd"}, web_search_options={}, prompt_cache_retention="24h",
        extra_body={"priority": 0})
    assert reply.choices[0].message.content == expected(chat_ids("t"), 0, 4)  # thinking on: "t" rendered
    assert reply.usage.prompt_tokens == len(chat_ids("t"))


def test_prediction_reaches_the_engine_as_text(served):
    """OpenAI's ``prediction`` (a string, or text parts) becomes ``SamplingParams.prediction``, which
    n-gram speculation reads; another type is refused."""
    url, engine = served
    headers = {"Authorization": "Bearer sesame"}
    for content, text in (("abc", "abc"), ([{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}], "abcd")):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "prediction": {"type": "content", "content": content}}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert engine.predictions[r.json()["id"]] == text
    body["prediction"] = {"type": "image", "content": "abc"}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 400 and "prediction" in r.text


@pytest.mark.parametrize(("effort", "thinking"), [("none", "n"), ("minimal", "n"), ("high", "t"), (None, "")])
def test_reasoning_effort_sets_the_templates_thinking_switch(served, effort, thinking):
    url, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    if effort is not None:
        body["reasoning_effort"] = effort
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected(chat_ids(thinking), 0, 3)


def test_explicit_chat_template_kwargs_win_over_reasoning_effort(served):
    url, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "reasoning_effort": "high",
            "chat_template_kwargs": {"enable_thinking": False}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sesame"})
    assert r.json()["choices"][0]["message"]["content"] == expected(chat_ids("n"), 0, 3)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}),
    ("/v1/completions", {"prompt": "a", "reasoning_budget": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"}),
])
def test_unknown_or_bad_fields_are_still_refused(served, path, body):
    url, _ = served
    r = httpx.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_completions_accept_openai_bookkeeping_fields(served):
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame")
    reply = client.completions.create(model="letters", prompt="b", max_tokens=3, user="u1",
                                      extra_body={"store": True, "metadata": {"k": "v"}, "service_tier": "auto",
                                                  "prompt_cache_key": "p", "safety_identifier": "s"})
    assert reply.choices[0].text == "bcd"


@pytest.mark.parametrize(("header", "status"), [
    ("Bearer sesame", 200), ("bearer sesame", 200), ("BEARER  sesame", 200), ("Basic sesame", 401),
    ("bearer sesam", 401), ("sesame", 401), ("", 401),
])
def test_the_authorization_scheme_is_case_insensitive(served, header, status):
    url, _ = served
    headers = {"Authorization": header} if header else {}
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=headers)
    assert r.status_code == status, r.text


def test_priority_reaches_the_engine(served):
    url, engine = served
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 1, "priority": -5},
                   headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 200
    assert engine.priorities[r.json()["id"]] == -5
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 1, "priority": 7},
                   headers={"Authorization": "Bearer sesame"})
    assert engine.priorities[r.json()["id"]] == 7


def test_stream_chunks_after_the_first_carry_no_role(served):
    url, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer sesame"}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["delta"] for line in lines for c in json.loads(line)["choices"]]
    assert deltas[:2] == [{"role": "assistant", "content": ""}] * 2
    assert deltas[2:] and all("role" not in d for d in deltas[2:])
    assert '"role":null' not in "".join(lines) and '"role": null' not in "".join(lines)


def _metric(url: str, name: str, label: str = "") -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"podium:{name}{{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_every_sample_of_a_streamed_request(served):
    """Deltas carry only the samples that changed, so the final one need not hold every sample:
    the finish reasons and token counts still cover all of them."""
    url, _ = served
    series = {"stop": ("request_success_total", 'finished_reason="stop"'),
              "length": ("request_success_total", 'finished_reason="length"'),
              "prompt": ("prompt_tokens_total", ""), "generated": ("generation_tokens_total", "")}
    before = {key: _metric(url, *where) for key, where in series.items()}
    # "b": sample 0 writes "bcde" and stops at "e" (4 tokens); samples 1 and 2 run 6 tokens each
    body = {"prompt": "b", "max_tokens": 6, "n": 3, "stop": ["e"], "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sesame"}) as r:
        list(r.iter_lines())
    grown = {key: _metric(url, *where) - before[key] for key, where in series.items()}
    assert grown == {"stop": 1, "length": 2, "prompt": 1, "generated": 16}


def test_ignored_fields_are_named_in_a_debug_line(served, caplog):
    url, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_cache_key": "k",
            "verbosity": "high", "store": False}
    with caplog.at_level("DEBUG", logger="podium_server"):
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if "ignored request fields" in rec.getMessage()]
    assert lines and all(name in lines[-1] for name in ("store", "prompt_cache_key", "verbosity"))
