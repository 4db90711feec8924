"""One streaming path: the server streams the engine's own deltas, with the real SmolLM2 engine.

Properties a bug would break, in each engine mode:

- greedy answers (streamed and whole) equal the offline ``LLM``'s on the same model (greedy output
  does not depend on the batch): the reference that does not go through the server at all;
- a streamed answer equals the same request answered whole, field for field (text per choice,
  finish and stop reasons, logprob tokens, usage), with n > 1, logprobs, stop strings (cut and
  kept with ``include_stop_str_in_output``), ``echo`` and chat; sampling is seeded, so both
  answers draw the same tokens; a choice that ran to ``max_tokens`` counts exactly that many;
- in process mode, what crosses the engine process's report pipe is deltas: for every request,
  the texts and token ids sent, joined in order, are exactly the final output, and no choice was
  sent more than ``max_tokens`` token ids (a cumulative output repeats everything sent before).
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict

import httpx
import pytest
from engine_fixtures import smollm2_gguf
from test_server_plumbing import ThreadServer, sse_events

from podium import LLM, SamplingParams
from podium.config import EngineConfig
from podium_server.app import build_engine, create_app
from podium_server.process_engine import ProcessEngine
from podium_server.settings import ENGINE_MODES, ServerSettings
from podium_server.thread_engine import ThreadEngine

pytestmark = pytest.mark.slow  # a real model, generating

SAMPLED = {"temperature": 1.0, "seed": 1234}


class PipeLog:
    """Every delta the engine process sent: request id -> choice index -> [(text, token ids)]."""

    def __init__(self) -> None:
        self.sent: dict[str, dict[int, list[tuple[str, list[int]]]]] = defaultdict(lambda: defaultdict(list))

    def wrap(self, on_message):
        def spy(message: tuple) -> None:
            if message[0] == "report":
                for request_id, _, completions, *_ in message[3]:
                    for index, text, token_ids, *_ in completions:
                        self.sent[request_id][index].append((text, list(token_ids)))
            on_message(message)
        return spy

    def joined(self, request_id_prefix: str) -> dict[tuple[str, int], tuple[str, list[int]]]:
        return {(rid, index): ("".join(t for t, _ in parts), [i for _, ids in parts for i in ids])
                for rid, choices in self.sent.items() if rid.startswith(request_id_prefix)
                for index, parts in choices.items()}


GREEDY_PROMPT = "def fibonacci(n):"
GREEDY_CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def offline() -> tuple[LLM, dict]:
    """The offline engine and its greedy answers, computed first: the thread mode then serves it."""
    llm = LLM(str(smollm2_gguf()), device="cpu", dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    answers = {"completion": llm.generate([GREEDY_PROMPT], params)[0].outputs[0].text,
               "chat": llm.chat(GREEDY_CHAT, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text}
    return llm, answers


@pytest.fixture(scope="module", params=ENGINE_MODES)
def served(request, offline):
    settings = ServerSettings(engine=EngineConfig(model=str(smollm2_gguf()), device="cpu", dtype="float32",
                                                  max_model_len=512), engine_mode=request.param)
    log = PipeLog()
    if request.param == "process":
        engine = ProcessEngine.launch(functools.partial(build_engine, settings, own_process=True))
        engine._on_message = log.wrap(engine._on_message)  # read by the pipe's reader when the server starts
    else:
        engine = ThreadEngine(offline[0].engine)  # the same model and settings; idle from here on
    with ThreadServer(create_app(settings, engine)) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        yield request.param, client, log


def streamed(client: httpx.Client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events[-3:]
    return events[:-1]


def whole(client: httpx.Client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def completion_choices(events: list[dict]) -> dict[int, dict]:
    """The streamed choices added up: text, finish/stop reason, logprob tokens and offsets."""
    got: dict[int, dict] = defaultdict(lambda: {"text": "", "tokens": [], "text_offset": []})
    for event in events:
        for c in event["choices"]:
            choice = got[c["index"]]
            choice["text"] += c["text"]
            if c.get("logprobs"):
                choice["tokens"] += c["logprobs"]["tokens"]
                choice["text_offset"] += c["logprobs"]["text_offset"]
            if c["finish_reason"] is not None:
                choice["finish_reason"], choice["stop_reason"] = c["finish_reason"], c["stop_reason"]
    return dict(got)


def check_completion(client, log, mode: str, body: dict) -> dict[int, dict]:
    reference = whole(client, "/v1/completions", body)
    events = streamed(client, "/v1/completions", body)
    got = completion_choices(events)
    assert sorted(got) == [c["index"] for c in reference["choices"]]
    for c in reference["choices"]:
        g = got[c["index"]]
        assert (g["text"], g["finish_reason"], g["stop_reason"]) == (c["text"], c["finish_reason"], c["stop_reason"])
        if body.get("logprobs") is not None:
            assert g["tokens"] == c["logprobs"]["tokens"] and g["text_offset"] == c["logprobs"]["text_offset"]
    assert events[-1]["usage"] == reference["usage"]
    check_token_count(reference, body["max_tokens"])
    if mode == "process":
        check_pipe_sent_deltas(log, events[0]["id"], {c["index"]: c["text"] for c in reference["choices"]},
                               len(reference["choices"]) // body.get("n", 1), body.get("n", 1),
                               reference["usage"]["completion_tokens"], body["max_tokens"],
                               prompt_chars=len(body["prompt"]) if body.get("echo") else 0)
    return {c["index"]: c for c in reference["choices"]}


def check_token_count(reference: dict, max_tokens: int) -> None:
    """Every choice ran to ``max_tokens`` or stopped earlier: the usage counts no more than that."""
    choices = reference["choices"]
    most = len(choices) * max_tokens
    if all(c["finish_reason"] == "length" for c in choices):
        assert reference["usage"]["completion_tokens"] == most
    assert reference["usage"]["completion_tokens"] <= most


def check_pipe_sent_deltas(log: PipeLog, request_id: str, texts: dict[int, str], num_prompts: int, n: int,
                           completion_tokens: int, max_tokens: int, prompt_chars: int = 0) -> None:
    """The deltas sent for ``request_id`` (``-i`` per prompt when several) join to exactly the final
    texts, and carry exactly ``completion_tokens`` token ids in all, at most ``max_tokens`` per
    choice: nothing was sent twice."""
    sent = log.joined(request_id)
    assert len(sent) == num_prompts * n, sent.keys()
    ids = [request_id] if num_prompts == 1 else [f"{request_id}-{i}" for i in range(num_prompts)]
    for p, rid in enumerate(ids):
        for index in range(n):
            assert sent[(rid, index)][0] == texts[p * n + index][prompt_chars:]
    assert sum(len(tokens) for _, tokens in sent.values()) == completion_tokens
    assert all(len(tokens) <= max_tokens for _, tokens in sent.values())
    assert max(len(parts) for choices in log.sent.values() for parts in choices.values()) > 1  # streamed in pieces


def test_completions_stream_equals_whole_with_n_logprobs_and_echo(served):
    mode, client, log = served
    body = {"prompt": "The capital of France is", "max_tokens": 12, "n": 2, "logprobs": 2, "echo": True, **SAMPLED}
    check_completion(client, log, mode, body)


def test_several_prompts_stream_equals_whole(served):
    mode, client, log = served
    body = {"prompt": ["Once upon a time", "The three primary colors are"], "max_tokens": 8, "n": 2, **SAMPLED}
    check_completion(client, log, mode, body)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_stream_equals_whole(served, offline, include):
    mode, client, log = served
    base = {"prompt": GREEDY_PROMPT, "max_tokens": 24, "temperature": 0.0}
    text = whole(client, "/v1/completions", base)["choices"][0]["text"]
    assert text == offline[1]["completion"]
    stop = text[9:12]  # a stop string in the middle of the text, likely spanning tokens
    assert len(stop) == 3
    choices = check_completion(client, log, mode, {**base, "stop": [stop, "\x00never"],
                                                   "include_stop_str_in_output": include})
    cut = text.index(stop) + (len(stop) if include else 0)
    assert choices[0]["text"] == text[:cut] and choices[0]["finish_reason"] == "stop"
    assert choices[0]["stop_reason"] == stop


def test_greedy_chat_streams_the_offline_answer(served, offline):
    _, client, _ = served
    body = {"messages": GREEDY_CHAT, "max_tokens": 12, "temperature": 0.0}
    events = streamed(client, "/v1/chat/completions", body)
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == whole(client, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert text == offline[1]["chat"]


def test_chat_stream_equals_whole_with_n_and_logprobs(served):
    mode, client, log = served
    body = {"messages": [{"role": "user", "content": "Name a planet."}], "max_tokens": 10, "n": 2,
            "logprobs": True, "top_logprobs": 2, **SAMPLED}
    reference = whole(client, "/v1/chat/completions", body)
    events = streamed(client, "/v1/chat/completions", body)
    texts: dict[int, str] = defaultdict(str)
    tokens: dict[int, list[str]] = defaultdict(list)
    finish: dict[int, str] = {}
    for event in events:
        for c in event["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
            tokens[c["index"]] += [t["token"] for t in (c.get("logprobs") or {}).get("content") or []]
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    for c in reference["choices"]:
        assert texts[c["index"]] == c["message"]["content"] and finish[c["index"]] == c["finish_reason"]
        assert tokens[c["index"]] == [t["token"] for t in c["logprobs"]["content"]]
    assert events[-1]["usage"] == reference["usage"]
    check_token_count(reference, body["max_tokens"])
    # after each choice's first chunk, deltas carry no role (not even "role": null)
    assert [e["choices"][0]["delta"] for e in events[:body["n"]]] == [{"role": "assistant", "content": ""}] * body["n"]
    assert all("role" not in c["delta"] for e in events[body["n"]:] for c in e["choices"])
    if mode == "process":
        check_pipe_sent_deltas(log, events[0]["id"], {c["index"]: c["message"]["content"]
                                                      for c in reference["choices"]}, 1, body["n"],
                               reference["usage"]["completion_tokens"], body["max_tokens"])


def test_engine_errors_map_by_type(served):
    _, client, _ = served
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 600}],
                                                  "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 600})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "in the prompt, 600 for the completion" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert json.loads(client.get("/health").text)["status"] == "ok"
