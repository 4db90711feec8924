"""SIGTERM drains a real ``podium serve`` (a subprocess, the engine in its own process).

16 long streams and one long non-streaming request run when SIGTERM arrives, with
``--shutdown-timeout 3``. What a bug would break: new requests during the drain must get 503
with Retry-After and /health must say "draining"; every stream must end with a finish_reason or
an error event, then ``[DONE]`` (never cut mid-way); the non-streaming request must get a 503
body; the process must exit 0 within 2 s of the last response ending (not after uvicorn's own
timeout, nor the whole 30 s of a router's KV-event long poll). The model is a random-weight config (no tokenizer: prompts go as token ids).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from podium.parallel.group import free_port

PODIUM = pathlib.Path(sys.executable).parent / "podium"


@pytest.fixture
def server(tmp_path, request):
    from transformers import LlamaConfig

    shutdown_timeout = getattr(request, "param", 3)
    LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=2,
                bos_token_id=1).save_pretrained(tmp_path)
    port = free_port()
    proc = subprocess.Popen([str(PODIUM), "serve", str(tmp_path / "config.json"), "--port", str(port),
                             "--served-model-name", "tiny", "--max-num-seqs", "32", "--shutdown-timeout", str(shutdown_timeout),
                             "--kv-cache-memory-bytes", "64MiB", "--log-level", "warning", "--no-enable-prefix-caching"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PODIUM_API_KEY": ""})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    try:
        while True:
            assert proc.poll() is None, f"podium serve exited with {proc.returncode}:\n{''.join(lines)}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "podium serve did not start:\n" + "".join(lines)
            time.sleep(0.2)
        yield proc, url, lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


async def _stream(client: httpx.AsyncClient, prompt: list[int], started: asyncio.Event,
                  max_tokens: int = 4000) -> tuple[list[str], bool, float]:
    """(what ended it: finish reasons and error codes, whether [DONE] came last, when it ended)."""
    endings, done = [], False
    async with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                                              "temperature": 0, "ignore_eos": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            assert not done, "an event after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                endings.append(f"error:{event['error']['code'] or event['error']['type']}")
            elif event["choices"][0]["finish_reason"]:
                endings.append(event["choices"][0]["finish_reason"])
    return endings, done, time.monotonic()


async def _drain(proc: subprocess.Popen, url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        events = [asyncio.Event() for _ in range(16)]
        streams = [asyncio.create_task(_stream(client, [5 + i, 6, 7], events[i])) for i in range(16)]
        plain = asyncio.create_task(client.post("/v1/completions", json={"prompt": [9, 9], "max_tokens": 4000,
                                                                         "ignore_eos": True}))
        # a router's KV-event long poll (no prefix cache: no event ends it early); it must not hold the exit
        epoch = (await client.get("/podium/v1/replica")).json()["prefix_cache"]["epoch"]
        poll = asyncio.create_task(client.get("/podium/v1/kv_events", params={"after": 10**9, "epoch": epoch,
                                                                             "timeout": 30}))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        await asyncio.sleep(0.2)  # the non-streaming request is in too
        proc.send_signal(signal.SIGTERM)
        async with httpx.AsyncClient(base_url=url, timeout=10) as other:  # a new client, as a router would be
            for _ in range(60):  # the drain starts once the server's loop handles the signal
                health = await other.get("/health")
                if health.status_code != 200:
                    break
                await asyncio.sleep(0.05)
            refused = await other.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2})
        results = await asyncio.gather(*streams)
        plain_response = await plain
        last_end = max([r[2] for r in results] + [time.monotonic()])
        code = await asyncio.to_thread(proc.wait, 30)
        await asyncio.gather(poll, return_exceptions=True)
        return {"refused": refused, "health": health, "results": results, "plain": plain_response,
                "exit_after": time.monotonic() - last_end, "code": code}


def test_sigterm_drains_streams_refuses_new_requests_and_exits_promptly(server):
    proc, url, lines = server
    out = asyncio.run(_drain(proc, url))
    refused, health = out["refused"], out["health"]
    assert refused.status_code == 503 and refused.headers["retry-after"].isdigit()
    assert refused.json()["error"]["code"] == "server_draining"
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    for endings, done, _ in out["results"]:
        assert done and len(endings) == 1, endings
        # the drain ends what is left with EngineDeadError, which from_engine_error maps to 503 engine_dead
        assert endings[0] in ("length", "error:engine_dead"), endings
    assert sum(e[0] == ["error:engine_dead"] for e in out["results"]) == 16  # 4000 tokens outlast 3 s
    plain = out["plain"]
    assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
    assert out["code"] == 0, "".join(lines)
    assert out["exit_after"] < 2.0, out["exit_after"]


async def _drain_short(proc: subprocess.Popen, url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        events = [asyncio.Event() for _ in range(8)]
        streams = [asyncio.create_task(_stream(client, [5 + i, 6, 7], events[i], max_tokens=48)) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*streams)
        last_end = max(r[2] for r in results)
        code = await asyncio.to_thread(proc.wait, 60)
        return {"results": results, "exit_after": time.monotonic() - last_end,
                "since_signal": time.monotonic() - signalled, "code": code}


@pytest.mark.parametrize("server", [30], indirect=True)
def test_a_drain_whose_streams_finish_early_exits_without_waiting_for_the_timeout(server):
    """Streams that finish inside ``--shutdown-timeout`` (30 s here) end normally, and the process
    exits as soon as the last one has ended, not when the timeout runs out."""
    proc, url, lines = server
    out = asyncio.run(_drain_short(proc, url))
    for endings, done, _ in out["results"]:
        assert done and endings == ["length"], endings
    assert out["code"] == 0, "".join(lines)
    assert out["exit_after"] < 2.0, out["exit_after"]
    assert out["since_signal"] < 20, out["since_signal"]
