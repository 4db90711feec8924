"""``podium serve`` as a user starts it, then ``podium bench serve`` against it with vLLM's flags.

The server runs a random-weight model from a config.json (no tokenizer: prompts go as token ids),
with its engine in a child process. What a bug would break: the startup log (every stage, from the
engine's own process, and the total), and bench serve drawing its prompts from the served model's
vocabulary (the embedded SmolLM2's ids are out of this 96-token model's range and were refused).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import httpx
import pytest

from podium.cli import main
from podium.parallel.group import free_port

pytestmark = pytest.mark.slow

PODIUM = pathlib.Path(sys.executable).parent / "podium"
STAGE_LINES = ("startup platform", "startup config", "startup weights", "startup kv_cache", "startup graph_capture")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-served")
    LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2, bos_token_id=1).save_pretrained(folder)
    port = free_port()
    proc = subprocess.Popen([str(PODIUM), "serve", str(folder / "config.json"), "--port", str(port),
                             "--served-model-name", "tiny", "--max-num-seqs", "4", "--no-enable-prefix-caching",
                             "--kv-cache-memory-bytes", "8MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PODIUM_API_KEY": ""})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
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
        yield url, lines
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def test_the_server_logs_every_startup_stage_and_the_total(served):
    _, lines = served
    log = "".join(lines)
    for stage in STAGE_LINES:
        assert stage in log, f"{stage!r} missing from the server's output:\n{log}"
    assert "startup total" not in log  # the total is its own line: "startup 1.23 s: platform ..."
    total = [line for line in lines if "podium.engine: startup " in line and " s: " in line]
    assert len(total) == 1 and "(model tiny on cpu)" in total[0]
    assert log.index("startup graph_capture") < log.index(total[0]) < log.index("listening on")


def test_bench_serve_uses_the_served_models_vocabulary(served, tmp_path, capsys):
    url, _ = served
    rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "4", "--random-input-len", "8",
               "--random-output-len", "3", "--ignore-eos", "--request-rate", "200", "--burstiness", "2",
               "--goodput", "ttft:600000", "--metric-percentiles", "50,99", "--save-result", "--result-dir",
               str(tmp_path), "--result-filename", "run.json", "--no-progress", "--debug"])
    assert rc == 0
    result = json.loads((tmp_path / "run.json").read_text())
    r = result["results"]
    assert (r["completed"], r["failed"]) == (4, 0), result["errors"]
    assert r["total_input_tokens"] == 32 and r["total_output_tokens"] == 12  # the server's own counts
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 10-minute TTFT objective: all good
    assert "p50_ttft_ms" in r and result["config"]["model"] == "tiny" and result["config"]["burstiness"] == 2.0
    assert "Request goodput (req/s)" in capsys.readouterr().out
