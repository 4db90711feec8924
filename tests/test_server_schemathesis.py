"""A bounded schemathesis pass over ``/openapi.json`` against ``podium serve`` on the embedded model.

Every request body is declared in the spec from the protocol models, so schemathesis generates
real bodies (and broken ones) for every endpoint; the one check is ``not_a_server_error``: no
request, however odd, may get a 5xx (a 4xx naming the problem is the right answer to a bad one).
The context is kept short (``--max-model-len 64``) so that the requests the model does run stay
cheap on a CPU; the pass is bounded in cases per operation and in time.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import time

import httpx
import pytest

from podium.parallel.group import free_port

if importlib.util.find_spec("schemathesis") is None:
    pytest.skip("needs schemathesis (the dev dependency group)", allow_module_level=True)

pytestmark = pytest.mark.slow  # a server process with the real model

BIN = pathlib.Path(sys.executable).parent
# The pass is bounded by --max-examples (a few hundred cases); the time limit is only a ceiling for a
# slow or busy machine, where 45 s ended it within the coverage phase (146 cases, no fuzzing).
MAX_TIME_S = 240


@pytest.fixture(scope="module")
def url():
    port = free_port()
    proc = subprocess.Popen([str(BIN / "podium"), "serve", "smollm2-135m-instruct", "--port", str(port),
                             "--max-model-len", "64", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PODIUM_API_KEY": ""})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"podium serve exited with {proc.returncode}:\n{proc.stdout.read()}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_spec_declares_every_request_body(url):
    spec = httpx.get(f"{url}/openapi.json").json()
    for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/embeddings", "EmbeddingRequest"), ("/tokenize", "TokenizeRequest"),
                        ("/detokenize", "DetokenizeRequest"),
                        ("/v1/messages", "MessagesRequest"), ("/v1/messages/count_tokens", "CountTokensRequest"),
                        ("/v1/responses", "ResponsesRequest")]:
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "model" in spec["components"]["schemas"][model]["properties"]
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and chat["additionalProperties"] is False
    assert {"reasoning_effort", "prompt_cache_key", "safety_identifier"} <= set(chat["properties"])


def test_schemathesis_finds_no_server_error(url, tmp_path):
    result = subprocess.run(
        [str(BIN / "schemathesis"), "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
         "--phases", "coverage,fuzzing", "--max-examples", "25", "--max-time", str(MAX_TIME_S), "--workers", "1",
         "--seed", "1", "--request-timeout", "30", "--no-color", "--generation-database", "none"],
        capture_output=True, text=True, timeout=MAX_TIME_S + 60, cwd=tmp_path)
    out = result.stdout
    assert "FAILURES" not in out and "Server error" not in out, out[-6000:]
    if result.returncode != 0:  # only schemathesis's own crash while generating a case may pass (not the server's)
        errors = re.findall(r"🚫 (.+): \d+", out.split("SUMMARY")[-1])
        assert errors == ["Runtime Error"] and "while generating" in out, out[-6000:] + result.stderr[-2000:]
    cases = re.search(r"(\d+) generated", out)
    assert cases and int(cases.group(1)) >= 200, result.stdout[-3000:]  # a pass of a few hundred cases at least
