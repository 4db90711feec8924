"""``POST /v1/embeddings`` end to end: ``podium serve`` on all-MiniLM-L6-v2 (the engine in its own
process), called through the ``openai`` SDK and LangChain's ``OpenAIEmbeddings``, against
sentence-transformers on the same folder; bad requests get 400s naming the problem while the
server goes on serving. Then the handler as a plain function of a request body (``create``) on a
tiny Matryoshka decoder, where ``dimensions`` is allowed."""

from __future__ import annotations

import asyncio
import base64
import os
import pathlib
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch
from minilm_fixture import MINILM_SENTENCES, minilm_folder
from model_fixtures import save_tiny_model

from podium.parallel.group import free_port

openai = pytest.importorskip("openai")

PODIUM = pathlib.Path(sys.executable).parent / "podium"
NAME = "minilm"


@pytest.fixture(scope="module")
def served():
    """(url, folder, sentence-transformers' embeddings of MINILM_SENTENCES): the reference is computed
    here while the server loads its model."""
    st = pytest.importorskip("sentence_transformers")
    folder = minilm_folder()
    port = free_port()
    proc = subprocess.Popen([str(PODIUM), "serve", str(folder), "--port", str(port), "--log-level", "warning",
                             "--dtype", "float32", "--served-model-name", NAME],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PODIUM_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        reference = torch.from_numpy(st.SentenceTransformer(str(folder), device="cpu").encode(MINILM_SENTENCES))
        _wait_healthy(url, proc)
        yield url, folder, reference
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"podium serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError("podium serve did not become healthy")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def server(served):
    return served[0], served[1]


@pytest.fixture(scope="module")
def reference(served):
    return served[2]


def _min_cosine(got, want) -> float:
    got = torch.as_tensor(np.asarray(got, dtype=np.float64))
    return float(torch.nn.functional.cosine_similarity(got, want.double(), dim=-1).min())


def test_openai_sdk_float_and_base64(server, reference):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    for fmt in ("float", openai.NOT_GIVEN):  # the SDK asks for base64 when not told, and decodes it
        response = client.embeddings.create(model=NAME, input=MINILM_SENTENCES, encoding_format=fmt)
        assert [d.index for d in response.data] == list(range(len(MINILM_SENTENCES)))
        assert _min_cosine([d.embedding for d in response.data], reference) >= 0.99999
        assert response.usage.prompt_tokens == response.usage.total_tokens > len(MINILM_SENTENCES)
    raw = httpx.post(f"{url}/v1/embeddings", json={"input": "Hello", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert _min_cosine([decoded], reference[:1]) >= 0.99999


def test_token_id_input_and_usage(server, reference):
    url, folder = server
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(str(folder)).encode(s) for s in MINILM_SENTENCES[:3]]
    body = httpx.post(f"{url}/v1/embeddings", json={"model": NAME, "input": ids}).json()
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert _min_cosine([d["embedding"] for d in body["data"]], reference[:3]) >= 0.99999
    single = httpx.post(f"{url}/v1/embeddings", json={"input": ids[1]}).json()
    assert len(single["data"]) == 1 and _min_cosine([single["data"][0]["embedding"]], reference[1:2]) >= 0.99999


def test_langchain_openai_embeddings(server, reference):
    lc = pytest.importorskip("langchain_openai")
    url, _ = server
    # check_embedding_ctx_length=False: send the texts (LangChain would otherwise send tiktoken's ids)
    embedder = lc.OpenAIEmbeddings(model=NAME, base_url=f"{url}/v1", api_key="unused",
                                   check_embedding_ctx_length=False)
    assert _min_cosine(embedder.embed_documents(MINILM_SENTENCES), reference) >= 0.99999
    assert _min_cosine([embedder.embed_query(MINILM_SENTENCES[2])], reference[2:3]) >= 0.99999


@pytest.mark.parametrize("body, param, phrase", [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["fine", ""]}, "input", "input[1] is an empty string"),
    ({"input": "word " * 300}, "input", "maximum context length is 256 tokens, but the input has"),
    ({"input": "hi", "dimensions": 8}, "dimensions", "does not support Matryoshka"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "positive integer"),
    ({"input": [[101, 99999999]]}, "input", "token ids must be in"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"input": "hi", "model": "other"}, "model", "does not exist"),
])
def test_bad_requests_are_400s_naming_the_problem(server, body, param, phrase):
    url, _ = server
    response = httpx.post(f"{url}/v1/embeddings", json=body)
    assert response.status_code == (404 if param == "model" else 400), response.text
    error = response.json()["error"]
    assert error["param"] == param and phrase in error["message"], error
    assert httpx.post(f"{url}/v1/embeddings", json={"input": "still serving"}).status_code == 200


def test_generation_requests_to_an_embedding_model_are_400s(server):
    url, _ = server
    for path, body in (("/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code == 400
        assert "embedding model" in response.json()["error"]["message"] and "/v1/embeddings" in response.text


def test_handler_is_a_plain_function_of_the_body(tmp_path):
    """``EmbeddingsHandler.create(body)`` without HTTP, on a tiny Matryoshka decoder (thread engine)."""
    from podium.engine import LLMEngine
    from podium_server.app import _context
    from podium_server.errors import APIError
    from podium_server.serving_embeddings import EmbeddingsHandler
    from podium_server.settings import ServerSettings
    from podium_server.thread_engine import ThreadEngine

    hf = save_tiny_model("qwen3", {"head_dim": 32, "tie_word_embeddings": True, "is_matryoshka": True}, tmp_path)
    prompt = [5, 9, 14, 2, 77, 31]
    with torch.no_grad():
        last = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
    engine = LLMEngine(model=str(tmp_path), device="cpu", dtype="float32", runner="pooling")

    async def run():
        served = ThreadEngine(engine)
        handler = EmbeddingsHandler(_context(served, ServerSettings()))
        served.start()
        try:
            body = await handler.create({"input": [prompt], "dimensions": 16})
            with pytest.raises(APIError, match="dimensions=65 exceeds"):
                await handler.create({"input": [prompt], "dimensions": 65})
            with pytest.raises(APIError, match="Unrecognized request argument supplied: temperature"):
                await handler.create({"input": [prompt], "temperature": 0.5})
            return body
        finally:
            await served.stop()

    body = asyncio.run(run())
    assert body["usage"] == {"prompt_tokens": len(prompt), "total_tokens": len(prompt)}
    want = torch.nn.functional.normalize(last[:16], dim=-1)
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), want, atol=1e-5, rtol=1e-4)


def test_a_pooling_output_crosses_the_process_pipe_as_its_own_values():
    """``output_wire``: the engine process sends an embedding as a float32 array of its own values (not
    the storage its tensor is a view of); the server reads it as the thread mode's tensor."""
    import pickle

    from podium.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
    from podium_server.output_wire import from_wire, to_wire
    from podium_server.serving_embeddings import _encoded

    whole = torch.randn(4096)
    output = PoolingRequestOutput("r1", PoolingOutput(whole[:8]), [1, 2, 3], metrics=RequestMetrics(arrival_time=1.0))
    message = pickle.loads(pickle.dumps(to_wire(output)))
    assert len(pickle.dumps(to_wire(output))) < 1024  # 8 floats, not 4096
    back = from_wire(message)
    assert isinstance(back, PoolingRequestOutput) and back.finished and back.request_id == "r1"
    assert back.metrics.arrival_time == 1.0
    for fmt in ("float", "base64"):
        assert _encoded(back.outputs.data, fmt) == _encoded(whole[:8], fmt)


def test_a_tenant_max_tokens_limit_leaves_embedding_requests_alone():
    from podium.pooling_params import PoolingParams
    from podium_server.service_middleware import CallContext, engine_tenant
    from podium_server.tenants import TenantPolicy

    call = CallContext("req-1", TenantPolicy("team", max_tokens=16, weight=2.0))
    tenant = engine_tenant(call, [PoolingParams(), PoolingParams(normalize=False)])
    assert (tenant.name, tenant.weight) == ("team", 2.0)
