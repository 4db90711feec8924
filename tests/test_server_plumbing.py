"""The server's plumbing against a scripted engine (fast, no model), in both engine modes.

``ScriptedEngine`` (scripted_engine.py) knows every stream's expected text exactly and accounts
blocks like the real block manager, so mixed-up streams and leaked blocks show. Every test runs
with the engine on a thread and in a child process (``--engine-mode``); a few test what only the
process mode has (a killed engine process, startup errors, its exit). The real-model tests
(``test_server_openai.py``) cover the same paths end to end.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading
import time

import httpx
import pytest
import uvicorn
from scripted_engine import LETTERS, Knobs, LetterTokenizer, ScriptedEngine, broken_engine, expected

from podium.parallel.group import free_port
from podium_server.app import create_app
from podium_server.async_engine import AsyncEngine
from podium_server.process_engine import ProcessEngine
from podium_server.settings import ENGINE_MODES, ServerSettings
from podium_server.thread_engine import ThreadEngine


# -- fixtures ----------------------------------------------------------------------------------
class ThreadServer:
    """uvicorn serving an app on a background thread (a real socket, so disconnects are real)."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


def scripted(mode: str, knobs: Knobs, **kwargs) -> AsyncEngine:
    """A ScriptedEngine served in ``mode``, not started yet."""
    factory = functools.partial(ScriptedEngine, knobs, **kwargs)
    return ProcessEngine.launch(factory) if mode == "process" else ThreadEngine(factory())


@pytest.fixture(scope="module", params=ENGINE_MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def knobs() -> Knobs:
    return Knobs()


@pytest.fixture(scope="module")
def server(mode, knobs):
    with ThreadServer(create_app(ServerSettings(max_request_bytes=4096), scripted(mode, knobs))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def gauge(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f"podium:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def free_blocks(client: httpx.Client) -> tuple[float, float]:
    return gauge(client, "num_free_kv_blocks"), gauge(client, "num_kv_blocks")


# -- tests -------------------------------------------------------------------------------------
def test_completion_text_n_and_multiple_prompts(client):
    r = client.post("/v1/completions", json={"model": "letters", "prompt": ["abc", "zz"], "n": 2, "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    prompts = [[0, 1, 2], [25, 25]]
    got = {c["index"]: c["text"] for c in body["choices"]}
    assert got == {p * 2 + i: expected(prompts[p], i, 5) for p in range(2) for i in range(2)}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}


def test_streamed_text_equals_unstreamed_with_stop_holdback(client):
    prompt = "b"  # continues "bcdefg..."
    req = {"prompt": prompt, "max_tokens": 12, "stop": ["efx", "fg"], "stream": True,
           "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=req) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == "bcde"  # "fg" completed: cut before it; "ef" was held back, never sent
    assert events[-2]["usage"]["completion_tokens"] == 6 and events[-2]["choices"] == []
    assert [e["choices"][0]["finish_reason"] for e in events[:-2]][-1] == "stop"


def test_chat_stream_role_first_then_content_and_logprobs(client):
    req = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 4,
           "stream": True, "logprobs": True, "top_logprobs": 2}
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        events = sse_events(r)
    first = events[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    chunks = [e["choices"][0] for e in events[1:-1]]
    ids = LetterTokenizer().encode("uhia")
    assert "".join(c["delta"].get("content") or "" for c in chunks) == expected(ids, 0, 4)
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["content"]]
    assert [t["token"] for t in tokens] == list(expected(ids, 0, 4))
    assert all(len(t["top_logprobs"]) == 2 and t["bytes"] == list(t["token"].encode()) for t in tokens)
    assert chunks[-1]["finish_reason"] == "length"


def test_completion_logprobs_format(client):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "logprobs": 2, "echo": True})
    choice = r.json()["choices"][0]
    assert choice["text"] == "a" + expected([0], 0, 3) == "aabc"
    lp = choice["logprobs"]
    assert lp["tokens"] == list("aabc") and lp["token_logprobs"] == [None, -0.5, -0.5, -0.5]
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"a": -0.5, "b": -2.0}


def test_many_concurrent_streams_are_not_mixed(server, client):
    prompts = [LETTERS[i % 26] * (1 + i % 3) for i in range(48)]

    async def one(c: httpx.AsyncClient, prompt: str) -> str:
        text = ""
        async with c.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 9, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def everyone() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    texts = asyncio.run(everyone())
    tok = LetterTokenizer()
    assert texts == [expected(tok.encode(p), 0, 9) for p in prompts]
    assert free_blocks(client)[0] == free_blocks(client)[1]


def test_disconnect_mid_stream_frees_blocks(server, client, knobs):
    knobs.step_seconds = 0.02
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 50, "stream": True}) as r:
                lines = r.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass
                free, total = free_blocks(client)
                assert free < total  # the request holds blocks while it streams
        deadline = time.time() + 5
        while free_blocks(client)[0] != total and time.time() < deadline:
            time.sleep(0.02)
        assert free_blocks(client) == (total, total)
        assert gauge(client, "num_requests_running") == 0
    finally:
        knobs.step_seconds = 0.002


def aborted(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("podium:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(server, client, knobs):
    knobs.step_seconds = 0.05
    before = aborted(client)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 60}, timeout=0.3)
        deadline = time.time() + 5
        while gauge(client, "num_requests_running") and time.time() < deadline:
            time.sleep(0.02)
        assert gauge(client, "num_requests_running") == 0  # not left to run its 60 steps
        assert aborted(client) == before + 1
        free, total = free_blocks(client)
        assert free == total
    finally:
        knobs.step_seconds = 0.002


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": "a", "temperature": 3}, 400, "temperature"),
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "a", "max_tokens": 70}, 400, "prompt"),
    ({"prompt": "a", "logit_bias": {"99": 1}}, 400, "logit_bias"),
    ({"prompt": "a", "bogus": 1}, 400, "bogus"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "a", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "a", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),  # SamplingParams' typed error
])
def test_invalid_completion_requests(client, body, status, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "fragment"), [
    ({"messages": []}, "messages"),
    ({"max_tokens": 3}, "messages: Field required"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools[0] must be"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "--enable-auto-tool-choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "images are not supported yet"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_schema"}},
     "needs json_schema.schema"),
    ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "wizard", "content": "a"}]}, "messages.0.role"),
])
def test_invalid_chat_requests(client, body, fragment):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_malformed_and_oversize_bodies(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400
    r = client.post("/v1/completions", json={"prompt": "a" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    # the server still serves
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).json()["choices"][0]["text"] == "ab"


def test_context_length_message(client):
    r = client.post("/v1/completions", json={"prompt": "a" * 60, "max_tokens": 10})
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("This model's maximum context length is 64 tokens, but you requested 70 tokens "
                                       "(60 in the prompt, 10 for the completion)")


def test_small_endpoints(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "letters"
    assert client.post("/tokenize", json={"prompt": "cab"}).json()["tokens"] == [2, 0, 1]
    assert client.post("/detokenize", json={"tokens": [2, 0, 1]}).json()["prompt"] == "cab"
    assert client.get("/health").status_code == 200
    assert "version" in client.get("/version").json()
    metrics = client.get("/metrics").text
    for name in ("podium:prompt_tokens_total", "podium:generation_tokens_total", "podium:request_success_total",
                 "podium:time_to_first_token_seconds_bucket", "podium:e2e_request_latency_seconds_count",
                 "podium:time_per_output_token_seconds_count", "podium:num_requests_running",
                 "podium:num_requests_waiting", "podium:kv_cache_usage_perc", "podium:prefix_cache_hits_total"):
        assert name in metrics, name


def test_auth_and_dead_engine(mode):
    knobs = Knobs()
    with ThreadServer(create_app(ServerSettings(api_key="sesame"), scripted(mode, knobs))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/completions", json={"prompt": "a"}).status_code == 401
        r = c.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200  # open without a key
        knobs.crash_on_step = True
        r = c.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 503
        assert c.get("/health").status_code == 503


def test_a_failure_right_after_an_output_ends_the_stream():
    """The output and the failure set the stream's event once between two reads: the reader must get
    the output, then the error (it once waited forever for a second wake-up)."""
    from podium.outputs import CompletionOutput, RequestOutput
    from podium_server.async_engine import EngineDeadError, RequestStream

    async def read() -> list:
        stream = RequestStream("r")
        stream.put(RequestOutput("r", None, [0], [CompletionOutput(0, "a", [0])], False), 0.0)
        stream.fail(EngineDeadError("gone"))
        seen = []
        with pytest.raises(EngineDeadError, match="gone"):
            async for output in stream.outputs():
                seen.append(output.outputs[0].text)
        return seen

    assert asyncio.run(asyncio.wait_for(read(), 5)) == ["a"]


# -- what only the process mode has ------------------------------------------------------------
def _stream_lines(url: str, body: dict, into: list) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        into.extend(line for line in r.iter_lines() if line.startswith("data: "))


def test_killed_engine_process_fails_open_requests_and_health():
    knobs = Knobs()
    knobs.step_seconds = 0.02
    engine = scripted("process", knobs)
    with ThreadServer(create_app(ServerSettings(), engine)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        lines: list[str] = []
        reader = threading.Thread(target=_stream_lines, args=(srv.url, {"prompt": "a", "max_tokens": 60,
                                                                         "stream": True}, lines))
        reader.start()
        deadline = time.time() + 10
        while len(lines) < 2 and time.time() < deadline:
            time.sleep(0.01)
        os.kill(engine.process.pid, signal.SIGINT)  # a Ctrl-C reaches the whole process group: ignored
        time.sleep(0.1)
        assert engine.process.is_alive() and c.get("/health").status_code == 200
        os.kill(engine.process.pid, signal.SIGKILL)
        reader.join(timeout=10)
        assert not reader.is_alive()  # the stream ended, it did not hang
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert "engine process exited unexpectedly (exit code -9)" in error["message"]
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


def test_engine_process_exits_with_the_server():
    engine = scripted("process", Knobs())
    with ThreadServer(create_app(ServerSettings(), engine)) as srv:
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "b", "max_tokens": 3}).json()[
            "choices"][0]["text"] == "bcd"
    assert engine.process.exitcode == 0


def test_engine_process_startup_error_is_raised_in_the_server():
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        ProcessEngine.launch(broken_engine)


def test_engine_mode_is_validated():
    with pytest.raises(ValueError, match="engine_mode must be one of process, thread"):
        ServerSettings(engine_mode="fiber")


@pytest.mark.parametrize("flag,expected", [([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)])
def test_serve_flags_reach_the_engine_config(flag, expected):
    import argparse

    from podium_server import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "smollm2-135m-instruct", "--enforce-eager", "--max-num-seqs", "8", *flag])
    engine = cli.settings_from_args(args).engine
    assert engine.async_scheduling is expected
    assert engine.enforce_eager is True and engine.max_num_seqs == 8
    assert engine.kv_cache_dtype == "auto"
    fp8 = cli.settings_from_args(parser.parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2"]))
    assert fp8.engine.kv_cache_dtype == "fp8_e5m2"
    from types import SimpleNamespace

    info = SimpleNamespace(platform_name="cpu", model_name="m", max_model_len=64, kv_capacity_tokens=4096)
    assert "KV cache 4096 tokens (fp8_e5m2)," in cli.startup_banner(info, fp8)
    assert "KV cache 4096 tokens," in cli.startup_banner(info, cli.settings_from_args(args))
