"""The batch-invariant mode on the real SmolLM2 in bfloat16 (CPU): a request's tokens never depend on
its company, its chunking, a prefix-cache hit or a preemption.

bf16 is where this bites: the default mode's prefill attention is tiled flash style while a decode
scores its keys in one pass, so the same query's result differs in the last bits between the two,
and a near-tie between two tokens flips. The reference here is each request run alone, with no
prefix cache and its whole prompt in one step; every other way of running it must match it token
for token. Seeded sampling is held to the same rule.
"""

from __future__ import annotations

import argparse
import random

import pytest
from engine_fixtures import GOLDEN_PROMPTS, smollm2_gguf

from podium import LLM, SamplingParams
from podium.engine import LLMEngine
from podium.engine_args import engine_config
from podium.engine_flags import add_engine_flags, engine_kwargs
from podium.platform_setup import use_batch_invariant_kernels
from podium_plugin_api import Capabilities, Platform

NUM_GREEDY, NUM_SEEDED = 64, 16
NUM_TARGETS = NUM_GREEDY + NUM_SEEDED
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SHARED = "You are a helpful assistant who answers questions about geography and history in detail. "
WORDS = "alpha beta gamma delta river mountain code python music light paris tokyo seven blue".split()


def make_llm(**kwargs) -> LLM:
    smollm2_gguf()
    return LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", batch_invariant=True, **kwargs)


def target_requests() -> list[tuple[str, SamplingParams]]:
    """64 greedy and 16 seeded requests: golden prompts, word salads of 2-60 words, prompts sharing a
    3-block prefix (prefix-cache hits); every fifth one sampled with its own seed."""
    rng = random.Random(34)
    prompts = list(GOLDEN_PROMPTS)
    while len(prompts) < NUM_TARGETS:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60)))
        prompts.append(SHARED + words if len(prompts) % 3 == 0 else words)
    params = [GREEDY if i % 5 else SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, seed=i,
                                                  ignore_eos=True)
              for i in range(NUM_TARGETS)]
    return list(zip(prompts, params))


def fillers(count: int, seed: int, max_tokens: int = 8) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))),
             SamplingParams(temperature=rng.choice([0, 1.0]), max_tokens=rng.randint(1, max_tokens), ignore_eos=True))
            for _ in range(count)]


def run(llm: LLM, requests: list[tuple[str, SamplingParams]]) -> dict[str, list[int]]:
    outs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return {p: list(o.outputs[0].token_ids) for (p, _), o in zip(requests, outs)}


def mixed(targets, size: int, seed: int) -> list[tuple[str, SamplingParams]]:
    """``targets`` shuffled among fillers up to ``size`` requests."""
    batch = list(targets) + fillers(max(0, size - len(targets)), seed)
    random.Random(seed).shuffle(batch)
    return batch


def all_blocks_free(engine: LLMEngine) -> bool:
    stats = engine.stats()
    return stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def assert_same(got: dict[str, list[int]], alone: dict[str, list[int]], how: str) -> None:
    differ = [p for p in alone if got[p] != alone[p]]
    assert not differ, f"{len(differ)} of {len(alone)} requests changed {how}: {differ[:3]}"


@pytest.fixture(scope="module")
def targets():
    return target_requests()


@pytest.fixture(scope="module")
def alone(targets) -> dict[str, list[int]]:
    """Each request alone: no prefix cache, whole prompt in one step."""
    llm = make_llm(enable_prefix_caching=False, max_num_seqs=1)
    return {p: run(llm, [(p, s)])[p] for p, s in targets}


def test_inside_mixed_batches_and_after_prefix_hits(targets, alone):
    """Batches of 2-16 (each target with a few others), halves of the targets in batches of 64 and
    128, then all of them among others up to 256."""
    llm = make_llm(max_num_seqs=256)
    got, start, rng = {}, 0, random.Random(1)
    while start < NUM_TARGETS:
        size = rng.randint(2, 16)
        group = targets[start:start + max(1, size // 2)]
        got.update({p: t for p, t in run(llm, mixed(group, size, start)).items() if p in alone})
        start += len(group)
    assert_same(got, alone, "inside batches of 2-16")
    half = NUM_TARGETS // 2
    for size, group in ((64, targets[:half]), (128, targets[half:])):
        got = {p: t for p, t in run(llm, mixed(group, size, size)).items() if p in alone}
        assert_same(got, {p: alone[p] for p, _ in group}, f"inside a batch of {size}")
    assert_same(run(llm, mixed(targets, 256, 3)), alone, "inside a batch of 256")
    hits_before = llm.engine.stats().prefix_cache_hits
    again = run(llm, targets)  # every prompt's full blocks are cached by now
    assert llm.engine.stats().prefix_cache_hits - hits_before >= 16 * (NUM_TARGETS // 3)
    assert_same(again, alone, "after prefix-cache hits")
    assert all_blocks_free(llm.engine)


def test_with_chunked_prefill_and_preemption(targets, alone):
    llm = make_llm(max_num_batched_tokens=24, max_num_seqs=32, num_kv_blocks=16, max_model_len=256)
    batch = targets + fillers(16, 5, max_tokens=64)  # long outputs: running sequences outgrow the 16 blocks
    random.Random(5).shuffle(batch)
    got = run(llm, batch)
    assert llm.engine.stats().num_preemptions > 0
    assert_same(got, alone, "with 24-token prefill chunks and preemptions")
    assert all_blocks_free(llm.engine)


class _Plain(Platform):
    name = "plain"


class _Declared(Platform):
    name = "declared"

    def __init__(self) -> None:
        self.switched = False

    def capabilities(self) -> Capabilities:
        return Capabilities(batch_invariant=True)

    def use_batch_invariant_kernels(self) -> None:
        self.switched = True


def test_a_platform_without_the_capability_refuses_the_mode_with_its_reason():
    with pytest.raises(ValueError, match="not available on platform 'plain': it declares no batch-invariant"):
        use_batch_invariant_kernels(_Plain())
    declared = _Declared()
    use_batch_invariant_kernels(declared)
    assert declared.switched


def test_the_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(**engine_kwargs(parser.parse_args(["--batch-invariant"]))).batch_invariant is True
    assert engine_config(**engine_kwargs(parser.parse_args([]))).batch_invariant is False
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        engine_config(batch_invariant="yes")


@pytest.mark.parametrize("invariant", [True, False])
def test_tensor_parallel_ranks_run_the_invariant_kernels(invariant, tmp_path):
    """TP=3 (every rank's platform switched by start_platform; partial outputs summed in rank order,
    RankOrderSum): a prompt's tokens and logprobs are bit-identical alone and, later, among others
    with chunked prefill and a prefix-cache hit. The default mode (invariant=False) is shown to
    differ here, so the property is not vacuous."""
    from model_fixtures import save_tiny_model

    save_tiny_model("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16,
                              "intermediate_size": 96}, tmp_path)
    llm = LLM(str(tmp_path), tensor_parallel_size=3, dtype="bfloat16", device="cpu", batch_invariant=invariant,
              block_size=4, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=96)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
        prompt = {"prompt_token_ids": [(7 * i + 3) % 90 + 1 for i in range(37)]}
        others = [{"prompt_token_ids": [(5 * i + k) % 90 + 1 for i in range(3 + 4 * k)]} for k in range(6)]
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        batch = llm.generate(others[:3] + [prompt] + others[3:], params, use_tqdm=False)[3].outputs[0]
        assert llm.engine.stats().prefix_cache_hits > 0
    finally:
        llm.engine.shutdown()
    same = batch.token_ids == alone.token_ids and [
        {t: lp.logprob for t, lp in step.items()} for step in batch.logprobs] == [
        {t: lp.logprob for t, lp in step.items()} for step in alone.logprobs]
    assert same == invariant
