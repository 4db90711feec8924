"""The runner's captured-decode path (static buffers, padding, replay) equals its eager path.

A platform that claims graph capture gets its decode steps replayed from static buffers. Here a
CPU platform "captures" by keeping the function and re-running it on replay, which exercises
exactly the runner's side of the contract (buffers filled in place, padded rows that write
nowhere, block tables updated column-wise) without a GPU.
"""

from __future__ import annotations

import random

import pytest
from engine_fixtures import run_engines_on

import podium.engine
from podium import LLM, SamplingParams
from podium_cpu import CpuPlatform
from podium_plugin_api import Capabilities, GraphRunner


class RerunGraphRunner(GraphRunner):
    def __init__(self) -> None:
        self.captures = 0

    def capture(self, fn):
        fn()
        self.captures += 1
        return fn  # "replay" re-runs the same function over the same static tensors


class GraphCpuPlatform(CpuPlatform):
    name = "cpu-graph-sim"

    def capabilities(self) -> Capabilities:
        base = super().capabilities()
        return Capabilities(dtypes=base.dtypes, default_dtype=base.default_dtype, graph_capture=True)

    def graph_runner(self) -> GraphRunner:
        return RerunGraphRunner()


@pytest.fixture
def tiny_model(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_replayed_decode_equals_eager(tiny_model, monkeypatch, async_scheduling):
    """Graph replay (with async scheduling: placeholders filled inside the static input buffer)."""
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(512) for _ in range(rng.randint(1, 40))]} for _ in range(11)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eager = LLM(tiny_model, device="cpu", dtype="float32", block_size=4)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]

    platform = GraphCpuPlatform()
    run_engines_on(monkeypatch, platform)
    graphed = LLM(tiny_model, dtype="float32", block_size=4, max_num_seqs=16, async_scheduling=async_scheduling)
    runner = graphed.engine.runner
    assert sorted(runner.graphs) == [1, 2, 4, 8, 16]
    used, launched = [], []
    original, launch = runner.execute, podium.engine.launch
    monkeypatch.setattr(runner, "execute", lambda *args, **kwargs: used.append(r := original(*args, **kwargs)) or r)
    monkeypatch.setattr(podium.engine, "launch", lambda *args: launched.append(r := launch(*args)) or r)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert any(r.used_graph for r in used) and not all(r.used_graph for r in used)
    assert bool(launched) == async_scheduling  # deferred steps: tokens read a step later
    stats = graphed.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
