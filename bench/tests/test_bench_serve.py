"""The serve benchmark's client against a fake streaming OpenAI server (httpx.MockTransport)."""

import asyncio
import json
import math

import httpx
import numpy as np
import pytest

from podium_bench.datasets import BenchRequest
from podium_bench.serve import ServeOptions, arrival_delays, run_requests, summarize_serve
from podium_bench.serve_client import PayloadOptions, api_url, build_payload, carries_tokens, parse_sse_line

CHUNK_GAP = 0.02


class FakeServer:
    """Streams one chunk per requested token (or `tokens_per_chunk`), with usage if asked."""

    def __init__(self, usage=True, fail_prompt=None, tokens_per_chunk=1, chat=False):
        self.usage, self.fail_prompt, self.per_chunk, self.chat = usage, fail_prompt, tokens_per_chunk, chat
        self.in_flight = self.max_in_flight = 0
        self.bodies = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            assert request.url.path == "/v1/models"
            return httpx.Response(200, json={"object": "list", "data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = body.get("prompt") or body["messages"][0]["content"]
        if prompt == self.fail_prompt:
            return httpx.Response(500, json={"error": {"message": "kaboom"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self._stream(body, prompt))

    def _chunk(self, text):
        choice = {"index": 0, "delta": {"content": text}} if self.chat else {"index": 0, "text": text}
        return {"choices": [choice]}

    async def _stream(self, body, prompt):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.chat:  # role-only opening chunk: carries no token
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n".encode()
            n = body["max_tokens"]
            for _ in range(math.ceil(n / self.per_chunk)):
                await asyncio.sleep(CHUNK_GAP)
                yield f"data: {json.dumps(self._chunk('ab'))}\n\n".encode()
            if self.usage and body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt) + 100, "completion_tokens": n, "total_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def requests(n=6, out=4):
    return [BenchRequest(tuple(range(10 + i, 30 + i)), out, prompt=f"prompt {i}") for i in range(n)]


def run(server, reqs, **kw):
    options = ServeOptions(base_url="http://fake:8000", progress=False, payload=kw.pop("payload", PayloadOptions()),
                           **kw)
    return asyncio.run(run_requests(options, reqs, None, transport=httpx.MockTransport(server))), options


def test_streaming_timings_and_usage():
    server = FakeServer(usage=True)
    (timings, duration, model), options = run(server, requests())
    assert model == "fake-model"  # discovered at /v1/models
    assert len(timings) == 6 and all(t.success for t in timings)
    for t, req in zip(timings, requests()):
        assert len(t.chunk_times) == 4
        assert t.output_tokens == 4 and t.input_tokens == len(req.prompt) + 100  # from usage
        assert t.ttft >= CHUNK_GAP * 0.9 and t.e2el >= 4 * CHUNK_GAP * 0.9
        assert all(g >= CHUNK_GAP * 0.5 for g in t.itls)
    assert duration >= 4 * CHUNK_GAP
    body = server.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and "ignore_eos" not in body and body["model"] == "fake-model"
    summary = summarize_serve(options, timings, duration, model)
    assert summary["results"]["completed"] == 6 and summary["results"]["total_output_tokens"] == 24


def test_counts_chunks_without_usage_and_multi_token_chunks():
    (timings, _, _), _ = run(FakeServer(usage=False, tokens_per_chunk=2), requests(n=2, out=6))
    assert [t.output_tokens for t in timings] == [3, 3]  # three chunks each, no usage to say otherwise
    assert [t.input_tokens for t in timings] == [20, 20]  # the dataset's count


def test_failures_are_counted_not_fatal():
    (timings, duration, model), options = run(FakeServer(fail_prompt="prompt 3"), requests())
    assert [t.success for t in timings] == [True, True, True, False, True, True]
    assert "HTTP 500" in timings[3].error
    s = summarize_serve(options, timings, duration, model)
    assert (s["results"]["completed"], s["results"]["failed"]) == (5, 1) and "kaboom" in s["errors"][0]


def test_failed_test_request_stops_the_run():
    with pytest.raises(RuntimeError, match="test request"):
        run(FakeServer(fail_prompt="prompt 0"), requests())


def test_max_concurrency_is_respected():
    server = FakeServer()
    (timings, _, _), _ = run(server, requests(n=8), max_concurrency=2)
    assert all(t.success for t in timings)
    assert server.max_in_flight == 2
    unlimited = FakeServer()
    run(unlimited, requests(n=8))
    assert unlimited.max_in_flight == 8


def test_chat_endpoint_skips_role_chunk_and_sends_messages():
    server = FakeServer(chat=True)
    payload = PayloadOptions(endpoint="chat", model="m", ignore_eos=True)
    (timings, _, model), _ = run(server, requests(n=2, out=3), payload=payload)
    assert model == "m" and all(len(t.chunk_times) == 3 for t in timings)
    body = server.bodies[-1]
    assert body["messages"][0]["role"] == "user" and body["ignore_eos"] is True


def test_token_id_prompts_without_tokenizer():
    server = FakeServer(usage=False)
    req = [BenchRequest(tuple(range(20, 40)), 2)]
    run(server, req)
    assert server.bodies[-1]["prompt"] == list(range(20, 40))
    assert server.bodies[0]["prompt"] == list(range(20, 28))  # the short test request


def test_request_rate_spreads_arrivals():
    delays = arrival_delays(4000, rate=20.0, seed=1)
    assert arrival_delays(4000, 20.0, 1) == delays and arrival_delays(4000, 20.0, 2) != delays
    assert np.mean(delays) == pytest.approx(1 / 20, rel=0.06)
    assert arrival_delays(3, math.inf, 0) == [0.0, 0.0, 0.0]
    (timings, duration, _), _ = run(FakeServer(), requests(n=5, out=1), request_rate=50.0, seed=0)
    expected = sum(arrival_delays(5, 50.0, 0))
    assert duration >= expected * 0.9
    starts = [t.start for t in timings]
    assert starts == sorted(starts)


def test_helpers():
    assert api_url("http://h:1", "chat") == "http://h:1/v1/chat/completions"
    assert api_url("http://h:1/v1/", "completions") == "http://h:1/v1/completions"
    with pytest.raises(ValueError, match="base-url"):
        api_url("h:1", "chat")
    with pytest.raises(ValueError, match="endpoint"):
        PayloadOptions(endpoint="embeddings")
    assert parse_sse_line(": keep-alive") is None and parse_sse_line("data: [DONE]") == "[DONE]"
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert not carries_tokens({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert carries_tokens({"choices": [{"delta": {"role": "assistant", "content": "Hi"}}]})
    assert carries_tokens({"choices": [{"delta": {"reasoning_content": "hm"}}]})
    assert carries_tokens({"choices": [{"delta": {"content": ""}}]})  # a token that decodes to nothing yet
    assert not carries_tokens({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    assert not carries_tokens({"choices": [], "usage": {}})
    assert carries_tokens({"choices": [{"text": "", "finish_reason": "length"}]})
    p = build_payload(BenchRequest((1, 2), 7), "hi", PayloadOptions(model="x", extra_body={"top_k": 3}))
    assert p["max_tokens"] == 7 and p["prompt"] == "hi" and p["top_k"] == 3
    with pytest.raises(ValueError, match="request-rate"):
        ServeOptions(request_rate=0)


def test_token_space_for_a_config_and_an_unknown_name(tmp_path):
    from transformers import LlamaConfig

    from podium_bench.tokenizers import token_space_for

    LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=200, eos_token_id=2, bos_token_id=1).save_pretrained(tmp_path)
    space = token_space_for(str(tmp_path / "config.json"), max_model_len=150)
    assert (space.vocab_size, space.max_model_len, space.tokenizer) == (96, 150, None)
    assert {1, 2} <= space.special_ids
    with pytest.raises(ValueError, match="--tokenizer"):
        token_space_for("meta-llama/not-here")
