"""Tensor parallelism on CPU processes over gloo: TP=2 equals TP=1 (greedy tokens exactly, top-5
logprobs within 1e-4 in float32) for tiny random models of every attention/MLP variant, through
ragged batches, chunked prefill, prefix-cache hits and preemption; impossible splits are clear
errors; a killed worker becomes EngineDead within seconds.

The TP=1 engine is the reference: its model is the plain, unsharded one (itself checked against
transformers in test_models.py).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from model_fixtures import ARCHITECTURES, save_tiny_model

from podium import LLM, SamplingParams
from podium.errors import EngineDead
from podium.parallel.sharding import Split, check_split

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# (model fixture, config overrides, engine overrides): tied and untied Llama (the tied one with a
# vocabulary that 2 does not divide: the last rank's shard is padded), Mistral's sliding window,
# Qwen2's q/k/v bias, Qwen3's q/k norm, one KV head over two ranks (replicated) with o/down biases,
# and a mixture of experts (a shared expert, one dense layer) sharded by intermediate size. The Qwen3 case lets the CPU platform try its decode graphs on every rank (a step with a
# collective is not all native kernels: the capture is refused on each rank alike, steps run eagerly);
# the Mistral case runs async scheduling: rank 0 broadcasts each step's sampled tokens, which the
# next step's placeholders read on every rank (no logprobs there: they make steps synchronous); the
# speculative Llama case verifies n-gram drafts: every rank computes the logits of the drafts' rows
# (the plan's sample_drafts), whose vocab-parallel gather they all take part in
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CASES = {
    "llama-untied": ("llama3-rope-untied", {}, {}),
    "llama-speculative-ngram": ("llama3-rope-untied", {}, {"speculative_config": SPEC}),
    "llama-tied-odd-vocab": ("llama2-tied", {"vocab_size": 97}, {}),
    "mistral-sliding-async": ("mistral-sliding", {}, {"async_scheduling": True}),
    "qwen2-bias": ("qwen2-bias", {}, {}),
    "qwen3-qk-norm-graphs": ("qwen3-qk-norm", {}, {"enforce_eager": False}),
    "gqa-1-kv-head-bias": ("llama-bias-linear-rope", {}, {}),
    "qwen2-moe-shared-expert": ("qwen2-moe-shared", {}, {}),
}

ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 4, "max_num_seqs": 6, "max_num_batched_tokens": 24,
          "num_kv_blocks": 20, "enforce_eager": True, "max_model_len": 64}


def prompts() -> list[list[int]]:
    """Ragged prompts; three share a 12-token prefix (prefix-cache hits once the first is cached);
    two exceed the 24-token budget (chunked prefill)."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(1, 90, (12,), generator=g).tolist()
    lens = [3, 30, 7, 41, 1, 9, 16, 5]
    out = [torch.randint(1, 90, (n,), generator=g).tolist() for n in lens]
    out += [shared + [5, 6, 7], shared + [8], shared + [9, 10, 11, 12]]
    return out


def run(folder, tp: int, **extra):
    llm = LLM(str(folder), tensor_parallel_size=tp, **{**ENGINE, **extra})
    try:
        logprobs = None if extra.get("async_scheduling") else 5
        params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=logprobs, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        engine = llm.engine
        assert engine.async_scheduling == bool(extra.get("async_scheduling"))
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, "rank 0's blocks were not all freed"
        return [o.outputs[0] for o in outs], stats
    finally:
        llm.engine.shutdown()


def top5(sample) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in step.items()} for step in sample.logprobs or []]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1(case, tmp_path):
    name, extra, engine = CASES[case]
    model_type, overrides = ARCHITECTURES[name]
    save_tiny_model(model_type, {**overrides, **extra}, tmp_path)
    ref, ref_stats = run(tmp_path, 1, **engine)
    got, stats = run(tmp_path, 2, **engine)
    assert stats.num_preemptions > 0 and ref_stats.num_preemptions > 0, "the KV cache was meant to run out"
    assert stats.prefix_cache_hits > 0
    if "speculative_config" in engine:
        assert stats.spec_decoding.num_draft_tokens > 0, "no step verified drafts"
        assert stats.spec_decoding == ref_stats.spec_decoding
    for i, (a, b) in enumerate(zip(ref, got)):
        assert b.token_ids == a.token_ids, f"prompt {i}: TP=2 {b.token_ids} != TP=1 {a.token_ids}"
        for step, (la, lb) in enumerate(zip(top5(a), top5(b))):
            assert la.keys() == lb.keys(), f"prompt {i} step {step}: top-5 differ"
            worst = max(abs(la[t] - lb[t]) for t in la)
            assert worst < 1e-4, f"prompt {i} step {step}: logprobs differ by {worst}"


def test_impossible_splits_name_the_numbers():
    from types import SimpleNamespace

    smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's attention heads \(9\)"):
        check_split(smollm2, 2)
    check_split(smollm2, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 cannot share the model's 3 key/value heads"):
        check_split(SimpleNamespace(num_attention_heads=12, num_key_value_heads=3), 4)
    assert Split(1, 3).vocab(97) == (33, 33, 33) and Split(2, 3).vocab(97) == (66, 31, 33)
    # one KV head over 4 ranks: each rank keeps it; 8 KV heads over 4: two each
    assert [Split(r, 4).kv_heads(8, 1) for r in range(4)] == [(0, 1)] * 4
    assert [Split(r, 4).kv_heads(8, 8) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [Split(r, 4).kv_heads(8, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]


def test_more_ranks_than_devices_is_a_clear_error(tmp_path):
    from podium.parallel.worker import _check_devices
    from podium_plugin_api import Platform

    class TwoDevices(Platform):
        name = "two"

        def device_count(self) -> int:
            return 2

    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 needs a device for each rank, but platform 'two' "
                                         r"has 2 device\(s\)"):
        _check_devices(TwoDevices(), 4)


def test_smollm2_gguf_tp3_equals_tp1_and_tp2_is_refused_and_a_killed_rank_is_engine_dead():
    """The real SmolLM2 GGUF (9 heads, 3 KV heads): TP=3 is its one even split, each rank reading
    only its rows of the Q4_1 tensors; TP=2 names the numbers before any process starts. Then one
    rank is killed mid-run: the engine raises EngineDead within seconds, never hangs."""
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's attention heads \(9\)"):
        LLM("smollm2-135m-instruct", tensor_parallel_size=2, device="cpu")
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (n,), generator=g).tolist()}
               for n in (5, 17, 33, 9, 64, 2, 21, 40)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    common = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "enforce_eager": True}
    ref = LLM("smollm2-135m-instruct", **common)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    finally:
        ref.engine.shutdown()
    llm = LLM("smollm2-135m-instruct", tensor_parallel_size=3, **common)
    engine = llm.engine
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert got == want
        engine.add_request("a", list(range(100, 120)), SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        os.kill(engine.tp.procs[1].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDead, match="tensor-parallel worker podium-tp-rank2 .* exited"):
            while time.monotonic() - started < 10:
                engine.step()
        assert time.monotonic() - started < 10
    finally:
        engine.shutdown()


def test_a_shape_model_has_the_same_random_weights_at_every_tp_size_and_a_hung_rank_ends(tmp_path, monkeypatch):
    """A config without weights (a named shape's kind) gets random weights; each rank loads its
    slices of the very weights TP=1 makes, so the GPU scripts can compare TP sizes on shapes. Then
    one rank is stopped (not killed): its heartbeat goes silent and the engine is dead within
    HEARTBEAT_TIMEOUT_S (shortened here), long before a step's own timeout."""
    from model_fixtures import tiny_config

    from podium.parallel import worker

    monkeypatch.setattr(worker, "HEARTBEAT_TIMEOUT_S", 3.0)

    tiny_config("qwen3", head_dim=32, tie_word_embeddings=False).save_pretrained(tmp_path)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 2, 7], list(range(1, 30)))]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    results = []
    for tp in (1, 2):
        llm = LLM(str(tmp_path / "config.json"), tensor_parallel_size=tp, **ENGINE)
        try:
            results.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
            if tp == 2:
                _stop_a_rank_and_expect_engine_dead(llm.engine)
        finally:
            llm.engine.shutdown()
    for a, b in zip(*results):
        assert a.token_ids == b.token_ids
        assert max(abs(x[t] - y[t]) for x, y in zip(top5(a), top5(b)) for t in x) < 1e-4


def _stop_a_rank_and_expect_engine_dead(engine) -> None:
    engine.add_request("a", list(range(1, 20)), SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    os.kill(engine.tp.procs[0].pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(EngineDead, match="rank 1 has not answered for .* s \\(one hangs\\)"):
        while time.monotonic() - started < 15:
            engine.step()
    assert time.monotonic() - started < 10
