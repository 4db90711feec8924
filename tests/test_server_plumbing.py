"""The server's plumbing against a scripted engine, in-process (fast, no model).

``ScriptedEngine`` has ``LLMEngine``'s public interface and a rule a bug would break: the k-th
token of a request is ``(sum(prompt) + 7 * sample_index + k) % 26``, shown as one letter. So every
stream's expected text is known exactly, whatever else runs. Blocks are accounted like the real
block manager's (a block per 4 tokens, freed on finish and abort), so leaks show in ``/metrics``.
The real-model tests (``test_server_openai.py``) cover the same paths end to end.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from podium.config import EngineConfig
from podium.outputs import CompletionOutput, Logprob, RequestOutput
from podium.sampling_params import SamplingParams
from podium_server.app import create_app
from podium_server.serving_base import holdback
from podium_server.settings import ServerSettings

LETTERS = "abcdefghijklmnopqrstuvwxyz"
BLOCK = 4


class LetterTokenizer:
    """One token per lowercase letter; ids 0..25; 26 is EOS."""

    chat_template = "letters"
    eos_token_id = 26

    def __len__(self) -> int:
        return 27

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [LETTERS.index(ch) for ch in text.lower() if ch in LETTERS]

    def decode(self, ids: list[int], **_) -> str:
        return "".join(LETTERS[i] for i in ids if i < 26)

    def convert_ids_to_tokens(self, ids):
        return [self.decode([i]) for i in ids] if isinstance(ids, list) else self.decode([ids])

    def get_vocab(self) -> dict[str, int]:
        return {ch: i for i, ch in enumerate(LETTERS)}


@dataclass
class Stats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


def expected(prompt_ids: list[int], index: int, k: int) -> str:
    return "".join(LETTERS[(sum(prompt_ids) + 7 * index + j) % 26] for j in range(k))


class ScriptedEngine:
    def __init__(self, step_seconds: float = 0.002, num_blocks: int = 4096, max_model_len: int = 64) -> None:
        self.tokenizer = LetterTokenizer()
        self.model_name, self.max_model_len, self.platform_name = "letters", max_model_len, "scripted"
        self.config = EngineConfig(model="letters")
        self.kv_capacity_tokens = num_blocks * BLOCK
        self.num_blocks, self.free_blocks = num_blocks, num_blocks
        self.step_seconds = step_seconds
        self.requests: dict[str, dict] = {}
        self.crash_on_step = False

    def add_request(self, request_id, prompt, params: SamplingParams, arrival_time=None, priority=0) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        if any(not 0 <= t < 27 for t in ids):
            raise ValueError("prompt token ids must be in [0, 27)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                             f"has {len(ids)} tokens")
        outs = [CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)]
        blocks = params.n * -(-len(ids) // BLOCK)
        self.free_blocks -= blocks
        self.requests[request_id] = {"ids": ids, "params": params, "outs": outs, "blocks": blocks}

    def abort_request(self, request_id) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.free_blocks += req["blocks"]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.crash_on_step:
            raise RuntimeError("scripted crash")
        time.sleep(self.step_seconds)
        outputs = []
        for rid, req in list(self.requests.items()):
            p: SamplingParams = req["params"]
            for out in req["outs"]:
                if out.finish_reason is None:
                    self._advance(req, out, p)
            finished = all(o.finish_reason for o in req["outs"])
            outputs.append(RequestOutput(rid, None, req["ids"], [CompletionOutput(
                o.index, o.text, list(o.token_ids), None, o.logprobs, o.finish_reason, o.stop_reason)
                for o in req["outs"]], finished))
            if finished:
                self.abort_request(rid)
        return outputs

    def _advance(self, req: dict, out: CompletionOutput, p: SamplingParams) -> None:
        token = (sum(req["ids"]) + 7 * out.index + len(out.token_ids)) % 26
        out.token_ids.append(token)
        if out.logprobs is not None:
            entry = {token: Logprob(-0.5, 1, LETTERS[token])}
            for r in range(1, p.logprobs):
                entry[(token + r) % 26] = Logprob(-1.0 - r, r + 1, LETTERS[(token + r) % 26])
            out.logprobs.append(entry)
        out.text += LETTERS[token]
        if (len(req["ids"]) + len(out.token_ids)) % BLOCK == 1:
            req["blocks"] += 1
            self.free_blocks -= 1
        for s in p.stop:
            if s in out.text:
                out.text, out.finish_reason, out.stop_reason = out.text[: out.text.index(s)], "stop", s
                return
        if len(out.token_ids) >= (p.max_tokens or self.max_model_len - len(req["ids"])):
            out.finish_reason = "length"

    def stats(self) -> Stats:
        used = self.num_blocks - self.free_blocks
        return Stats(len(self.requests), 0, self.free_blocks, self.num_blocks, used / self.num_blocks)

    def apply_chat_template(self, messages, add_generation_prompt=True) -> list[int]:
        return self.tokenizer.encode("".join(m["role"][0] + m["content"] for m in messages) + "a")


# -- fixtures ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn serving an app on a background thread (a real socket, so disconnects are real)."""

    def __init__(self, app) -> None:
        self.port = _free_port()
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


@pytest.fixture(scope="module")
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture(scope="module")
def server(engine):
    with ThreadServer(create_app(ServerSettings(max_request_bytes=4096), engine)) as srv:
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


def free_blocks(client: httpx.Client) -> tuple[float, float]:
    text = client.get("/metrics").text
    values = {}
    for line in text.splitlines():
        for name in ("podium:num_free_kv_blocks", "podium:num_kv_blocks"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["podium:num_free_kv_blocks"], values["podium:num_kv_blocks"]


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


def test_disconnect_mid_stream_frees_blocks(server, client, engine):
    engine.step_seconds = 0.02
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
        assert not engine.requests
    finally:
        engine.step_seconds = 0.002


def aborted(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("podium:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(server, client, engine):
    engine.step_seconds = 0.05
    before = aborted(client)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 60}, timeout=0.3)
        deadline = time.time() + 5
        while engine.requests and time.time() < deadline:
            time.sleep(0.02)
        assert not engine.requests and aborted(client) == before + 1  # not left to run its 60 steps
        free, total = free_blocks(client)
        assert free == total
    finally:
        engine.step_seconds = 0.002


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
])
def test_invalid_completion_requests(client, body, status, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "fragment"), [
    ({"messages": []}, "messages"),
    ({"max_tokens": 3}, "messages: Field required"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "not supported yet"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "images are not supported yet"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_schema"}},
     "not supported yet"),
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


def test_auth_and_dead_engine():
    engine = ScriptedEngine()
    with ThreadServer(create_app(ServerSettings(api_key="sesame"), engine)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/completions", json={"prompt": "a"}).status_code == 401
        r = c.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200  # open without a key
        engine.crash_on_step = True
        r = c.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 503
        assert c.get("/health").status_code == 503


def test_holdback_keeps_possible_stop_prefixes():
    assert holdback("hello wor", ["world"]) == 6
    assert holdback("hello", ["xyz"]) == 5
    assert holdback("abab", ["aba", "b"]) == 2
