"""``podium bench`` end to end on a tiny random Llama config: Podium and transformers in one run."""

import json

import pytest
from transformers import LlamaConfig

from podium.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=1).save_pretrained(folder)
    return str(folder / "config.json")


def test_throughput_compare_hf_json(tiny_config, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = main(["bench", "throughput", "--model", tiny_config, "--num-prompts", "4", "--input-len", "16",
               "--output-len", "8", "--compare", "hf", "--json-out", str(out), "--no-progress", "--debug",
               "--dtype", "float32"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Podium / transformers" in printed and "Output tokens/s" in printed
    result = json.loads(out.read_text())
    env = result["environment"]
    assert env["machine"]["cpu"] and env["torch_version"] and env["platform"] and env["date"].startswith("20")
    assert env["podium_platform"] == "cpu" and env["machine"]["device"]  # what the platform found
    assert result["dataset_stats"]["total_input_tokens"] == 64
    for name in ("podium", "hf"):
        r = result["results"][name]
        assert r["num_requests"] == 4 and r["total_output_tokens"] == 32 and r["total_input_tokens"] == 64
        assert r["elapsed_s"] > 0
        assert r["output_tokens_per_s"] == pytest.approx(32 / r["elapsed_s"])
        assert r["total_tokens_per_s"] == pytest.approx(96 / r["elapsed_s"])
        assert r["requests_per_s"] == pytest.approx(4 / r["elapsed_s"])
    ratio = result["ratio_podium_over_hf"]["output_tokens_per_s"]
    assert ratio == pytest.approx(result["results"]["hf"]["elapsed_s"] / result["results"]["podium"]["elapsed_s"])
    assert result["config"]["resolved_dtype"] == "float32" and result["config"]["dataset"]["name"] == "random"


def test_prefix_repetition_hits_the_prefix_cache(tiny_config, tmp_path):
    out = tmp_path / "prefix.json"
    assert main(["bench", "throughput", "--model", tiny_config, "--dataset", "prefix-repetition", "--num-prompts", "6",
                 "--prefix-len", "64", "--suffix-len", "8", "--num-prefixes", "2", "--output-len", "4",
                 "--max-num-seqs", "2", "--json-out", str(out), "--no-progress", "--debug"]) == 0
    result = json.loads(out.read_text())["results"]["podium"]
    assert result["total_output_tokens"] == 24
    assert result["prefix_cache_hit_rate"] > 0.3  # 4 of 6 prompts can reuse a 64-token prefix


def test_latency(tiny_config, tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", tiny_config, "--batch-size", "2", "--input-len", "8",
                 "--output-len", "4", "--num-iters", "2", "--json-out", str(out), "--no-progress", "--debug"]) == 0
    r = json.loads(out.read_text())["results"]
    assert r["num_iters"] == 2 and len(r["prefill_s"]) == 2 and r["batch_size"] == 2
    assert all(p > 0 and f > 0 for p, f in zip(r["prefill_s"], r["full_s"]))
    assert r["decode_per_token_s"] == pytest.approx([(f - p) / 3 for p, f in zip(r["prefill_s"], r["full_s"])])
