"""``podium serve -tp 2``: 32 concurrent streams equal their solo outputs; a killed rank turns the
server unhealthy (503) and requests fail fast instead of hanging.

The served model is a tiny random Llama (safetensors, no tokenizer: prompts go as token ids), its
engine in the server's child process, which is rank 0 and spawns rank 1.
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
from model_fixtures import ARCHITECTURES, save_tiny_model

from podium.parallel.group import free_port

pytestmark = pytest.mark.slow

PODIUM = pathlib.Path(sys.executable).parent / "podium"


def _children(pid: int) -> list[int]:
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tp")
    model_type, overrides = ARCHITECTURES["qwen2-bias"]
    save_tiny_model(model_type, overrides, folder)
    port = free_port()
    proc = subprocess.Popen([str(PODIUM), "serve", str(folder), "--port", str(port), "--served-model-name", "tiny",
                             "-tp", "2", "--dtype", "float32", "--max-num-seqs", "32", "--enforce-eager",
                             "--kv-cache-memory-bytes", "16MiB", "--max-model-len", "96"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PODIUM_API_KEY": ""})
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"podium serve exited with {proc.returncode}:\n{''.join(lines)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"podium serve did not become healthy:\n{''.join(lines)}")
            time.sleep(0.25)
        yield url, proc, lines
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * k) % 90 + 1 for k in range(3 + i % 11)]


async def stream(client: httpx.AsyncClient, url: str, i: int) -> list[str]:
    body = {"model": "tiny", "prompt": prompt(i), "max_tokens": 10, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "logprobs": 1}
    tokens = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    tokens += (choice.get("logprobs") or {}).get("tokens") or []
    return tokens


def test_32_concurrent_streams_equal_their_solo_outputs_then_a_dead_rank_is_503(served):
    url, proc, lines = served

    async def solo():
        async with httpx.AsyncClient() as client:
            return [await stream(client, url, i) for i in range(32)]

    async def together():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(stream(client, url, i) for i in range(32)))

    alone = asyncio.run(solo())
    assert all(len(t) == 10 for t in alone), alone
    assert asyncio.run(together()) == alone

    engines = _children(proc.pid)
    workers = [w for e in engines for w in _children(e)]
    assert workers, f"no tensor-parallel worker under the engine process {engines}"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    started = time.monotonic()  # idle: the engine loop's health check notices, no request needed
    while httpx.get(f"{url}/health", timeout=5).status_code != 503:
        assert time.monotonic() - started < 10, "/health still answers 200 with a dead rank"
        time.sleep(0.2)
    body = {"model": "tiny", "prompt": prompt(1), "max_tokens": 50, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 503 and time.monotonic() - started < 10, response.text
