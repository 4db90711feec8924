"""The server against hostile and faulty input: one bad request never hurts the others.

A tiny random Llama with a word-level tokenizer of its 96 tokens ("t0" .. "t95") is served from a
thread (a real socket). What a bug would break: a parameter the sampler's tensors cannot hold
killed the engine loop for everyone (now a 400, with 32 streams running on, token for token as
they run alone); a fault inside a step pinned to one request fails that request only (500-class,
streamed in-band) and /health stays 200; JSON nested past the limit is a 400 naming the limit, not
a RecursionError 500; /metrics serves vLLM's names for the same series under --metrics-compat vllm.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import torch
import uvicorn
from model_fixtures import TINY, save_tiny_model
from prometheus_client.parser import text_string_to_metric_families
from scripted_engine import FAULT_SEED, LETTERS, Knobs, ScriptedEngine, expected

from podium.engine import LLMEngine
from podium.errors import StepFault
from podium.parallel.group import free_port
from podium_server.app import create_app
from podium_server.json_limits import JsonLimits, check_json_body, json_depth
from podium_server.process_engine import ProcessEngine
from podium_server.settings import ENGINE_MODES, ServerSettings
from podium_server.thread_engine import ThreadEngine

MARK = [13, 13, 13, 13, 13]  # a prompt the fault injector picks out


class ThreadServer:
    def __init__(self, app) -> None:
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "the test server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-served")
    save_tiny_model("llama", {"eos_token_id": 2, "bos_token_id": 1}, folder, seed=5)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY["vocab_size"])}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", eos_token="t2", bos_token="t1")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(folder)
    return str(folder)


def serve(model_dir: str, **settings):
    torch.set_num_threads(1)
    engine = LLMEngine(model=model_dir, device="cpu", dtype="float32", block_size=4, num_kv_blocks=512,
                       max_num_seqs=40, max_num_batched_tokens=256, enforce_eager=True)
    return ThreadServer(create_app(ServerSettings(**settings), engine)), engine


async def stream_text(client: httpx.AsyncClient, body: dict) -> tuple[str, list[str], bool]:
    """(text, finish reasons, whether [DONE] came) of a streamed completion; errors raise."""
    text, reasons, done = "", [], False
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(json.dumps(event))
            text += event["choices"][0]["text"]
            if event["choices"][0]["finish_reason"]:
                reasons.append(event["choices"][0]["finish_reason"])
    return text, reasons, done


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, TINY["vocab_size"]) for _ in range(rng.randint(3, 12))] for _ in range(count)]


def test_top_k_beyond_int64_is_a_400_while_32_streams_run_on(model_dir):
    server, _ = serve(model_dir, engine_mode="thread")
    prompts = _prompts(32)
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def scenario(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            alone = [await stream_text(client, {**body, "prompt": p}) for p in prompts]
            streams = [asyncio.create_task(stream_text(client, {**body, "prompt": p})) for p in prompts]
            await asyncio.sleep(0.05)
            bad = await asyncio.gather(*(client.post(path, json={**extra, "top_k": 2**63, "temperature": 0.7,
                                                                 "max_tokens": 4})
                                         for path, extra in (("/v1/completions", {"prompt": "t5 t6"}),
                                                             ("/v1/chat/completions", {"messages": [
                                                                 {"role": "user", "content": "t5"}]}))))
            results = await asyncio.gather(*streams)
            health = await client.get("/health")
            after = await client.post("/v1/completions", json={**body, "prompt": prompts[0]})
            return alone, bad, results, health, after

    with server:
        alone, bad, results, health, after = asyncio.run(scenario(server.url))
    for response in bad:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "top_k" and "64-bit" in error["message"]
    assert all(done and reasons == ["length"] for _, reasons, done in results)
    assert [text for text, _, _ in results] == [text for text, _, _ in alone]  # every stream, as if alone
    assert health.status_code == 200
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == alone[0][0]


def test_a_fault_pinned_to_one_request_fails_it_alone(model_dir):
    server, engine = serve(model_dir, engine_mode="thread")

    def inject(plan) -> None:
        for s in plan.scheduled:
            if s.seq.prompt_token_ids == MARK and s.seq.num_output_tokens >= 2:
                raise StepFault(s.seq.request_id, "injected fault")

    engine.fault_injector = inject
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompts = _prompts(8)

    async def scenario(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            others = [asyncio.create_task(stream_text(client, {**body, "prompt": p})) for p in prompts]
            plain = asyncio.create_task(client.post("/v1/completions", json={**body, "prompt": MARK}))
            streamed = asyncio.create_task(stream_text(client, {**body, "prompt": MARK}))
            results = await asyncio.gather(*others)
            failed_plain = await plain
            failed_stream = await asyncio.gather(streamed, return_exceptions=True)
            health = await client.get("/health")
            later = await asyncio.gather(*(stream_text(client, {**body, "prompt": p}) for p in prompts[:3]))
            return results, failed_plain, failed_stream[0], health, later

    with server:
        results, failed_plain, failed_stream, health, later = asyncio.run(scenario(server.url))
    assert failed_plain.status_code == 500
    assert failed_plain.json()["error"]["code"] == "request_failed"
    assert "injected fault" in failed_plain.json()["error"]["message"]
    assert isinstance(failed_stream, RuntimeError) and "request_failed" in str(failed_stream)
    assert all(done and reasons == ["length"] for _, reasons, done in results + later)
    assert [r[0] for r in later] == [r[0] for r in results[:3]]
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_a_request_the_engine_fails_reaches_its_client_alone_in_both_engine_modes(mode):
    """The failure crosses the process pipe too (Report.failed): 500 or an in-band error, then [DONE]."""
    knobs = Knobs()
    engine = ProcessEngine.launch(ScriptedEngine) if mode == "process" else ThreadEngine(ScriptedEngine(knobs))
    body = {"prompt": "abc", "max_tokens": 6}

    async def scenario(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            good = [asyncio.create_task(client.post("/v1/completions", json={**body, "prompt": p}))
                    for p in ("abc", "hello", "xyz")]
            failed = await client.post("/v1/completions", json={**body, "seed": FAULT_SEED})
            streamed = await client.post("/v1/completions", json={**body, "seed": FAULT_SEED, "stream": True})
            return [await g for g in good], failed, streamed, await client.get("/health")

    with ThreadServer(create_app(ServerSettings(), engine)) as server:
        good, failed, streamed, health = asyncio.run(scenario(server.url))
    texts = [r.json()["choices"][0]["text"] for r in good]
    assert texts == [expected([LETTERS.index(c) for c in p], 0, 6) for p in ("abc", "hello", "xyz")]
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "request_failed"
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_failed"
    assert health.status_code == 200


# -- JSON limits --------------------------------------------------------------------------------------
def _nested(depth: int) -> str:
    """JSON arrays nested ``depth`` levels deep."""
    return "[" * depth + '"x"' + "]" * depth


def _reference_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_reference_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_reference_depth, value.values()), default=0)
    return 0


def test_json_depth_scan_equals_a_recursive_count():
    rng = random.Random(3)

    def build(level: int):
        roll = rng.random()
        if level > 12 or roll < 0.3:
            return rng.choice(['a"[[{', "]]}}\\", "plain", 7, None, "\\\"[", "{\"k\": [1]}"])
        if roll < 0.65:
            return [build(level + 1) for _ in range(rng.randint(0, 3))]
        return {f"k{i}[": build(level + 1) for i in range(rng.randint(0, 3))}

    for _ in range(300):
        value = build(0)
        body = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        assert json_depth(body) == _reference_depth(value), body


def test_json_sizes_are_bounded():
    limits = JsonLimits(max_depth=8, max_string_chars=10, max_array_items=5)
    assert check_json_body(b'{"a": ["0123456789", [1, 2, 3, 4, 5]]}', limits) is None
    too_long = check_json_body(b'{"a": ["0123456789x"]}', limits)
    assert too_long.status == 400 and too_long.code == "json_string_too_long" and "at most 10" in too_long.message
    too_many = check_json_body(b'{"a": [[1, 2, 3, 4, 5, 6]]}', limits)
    assert too_many.code == "json_array_too_long" and "--max-json-array-items" in too_many.message
    assert check_json_body(b'{"' + b"k" * 11 + b'": 1}', limits).code == "json_string_too_long"


def test_deeply_nested_json_is_a_400_naming_the_limit(model_dir):
    server, _ = serve(model_dir, engine_mode="thread")
    with server, httpx.Client(base_url=server.url, timeout=60) as client:
        responses = {}
        for depth in (10, 1_000, 100_000):
            content = '{"model": "m", "prompt": "t5", "metadata": {"k": ' + _nested(depth) + "}}"
            responses[depth] = client.post("/v1/completions", content=content,
                                           headers={"content-type": "application/json"})
        messages = client.post("/v1/chat/completions", content='{"messages": ' + _nested(5_000) + "}")
        health = client.get("/health")
    ok = responses[10]
    assert ok.status_code == 400 and ok.json()["error"]["code"] != "json_too_deep"  # metadata takes strings only
    for depth in (1_000, 100_000):
        error = responses[depth].json()["error"]
        assert responses[depth].status_code == 400 and error["code"] == "json_too_deep"
        assert f"nests JSON {depth + 2} levels deep" in error["message"] and "at most 64" in error["message"]
    assert messages.status_code == 400 and messages.json()["error"]["code"] == "json_too_deep"
    assert health.status_code == 200


# -- metrics -------------------------------------------------------------------------------------------
def _scrape(client: httpx.Client) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_metrics_compat_vllm_serves_vllms_names_for_the_same_series(model_dir):
    server, _ = serve(model_dir, engine_mode="thread", metrics_compat="vllm")
    prompts = _prompts(3)
    with server, httpx.Client(base_url=server.url, timeout=60) as client:
        for p in prompts:
            assert client.post("/v1/completions", json={"prompt": p, "max_tokens": 6, "temperature": 0,
                                                        "ignore_eos": True, "stream": True}).status_code == 200
        samples = _scrape(client)
    podium = {k.removeprefix("podium:"): v for k, v in samples.items() if k.startswith("podium:")}
    vllm = {k.removeprefix("vllm:"): v for k, v in samples.items() if k.startswith("vllm:")}
    assert podium.keys() == vllm.keys()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "prefix_cache_queries_total", "num_preemptions_total",
                 "request_success_total{finished_reason=length}"):
        assert name in vllm and vllm[name] == podium[name], name
    assert vllm["generation_tokens_total"] == 18 and vllm["prompt_tokens_total"] == sum(map(len, prompts))
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert vllm[f"{name}_count"] == 3, name
    assert vllm["inter_token_latency_seconds_count"] == 3 * 5  # 5 gaps after each first token
    assert vllm["request_generation_tokens_sum"] == 18
    assert vllm["request_prompt_tokens_sum"] == sum(map(len, prompts))


def test_metrics_without_compat_serve_podium_names_only(model_dir):
    server, _ = serve(model_dir, engine_mode="thread")
    with server, httpx.Client(base_url=server.url, timeout=60) as client:
        samples = _scrape(client)
    assert samples and not [k for k in samples if not k.startswith("podium:")]
    assert "podium:inter_token_latency_seconds_count" in samples


def test_the_bearer_scheme_is_case_insensitive():
    """RFC 7235: ``bearer KEY`` is ``Bearer KEY``; a wrong key or scheme is still a 401."""
    app = create_app(ServerSettings(api_key="sesame"), ThreadEngine(ScriptedEngine()))
    body = {"prompt": "abc", "max_tokens": 2}
    with ThreadServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        codes = {auth: client.post("/v1/completions", json=body, headers={"Authorization": auth}).status_code
                 for auth in ("bearer sesame", "BEARER sesame", "Bearer sesame", "bearer wrong", "Basic sesame")}
    assert codes == {"bearer sesame": 200, "BEARER sesame": 200, "Bearer sesame": 200, "bearer wrong": 401,
                     "Basic sesame": 401}
