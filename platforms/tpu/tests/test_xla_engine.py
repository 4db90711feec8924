"""The TPU platform's XLA path end to end, on XLA's CPU device (``make test-tpu``; needs torch_xla).

What this proves: the plugin's code path (KV cache on the XLA device, bucketed static shapes,
pure-XLA paged attention, graph cutting per step) gives the CPU platform's greedy tokens and
compiles a bounded number of graphs. It runs on XLA:CPU with ``PODIUM_TPU_ALLOW_XLA_CPU=1``, a
test-only switch: it is not a run on a TPU, and the Pallas kernel is (correctly) not used here.
"""

from __future__ import annotations

import os

import pytest

from podium import LLM, SamplingParams
from podium_tpu.selection import probe_device_kind, tpu_generation
from podium_tpu.xla_attention import XlaAttentionBackend

metrics = pytest.importorskip("torch_xla.debug.metrics")

GOLDEN_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
SETTINGS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=48,
                enforce_eager=True, enable_prefix_caching=False)


@pytest.fixture(scope="module", autouse=True)
def xla_cpu_stands_in_for_a_tpu():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PODIUM_TPU_ALLOW_XLA_CPU", "1")
        patch.setenv("PJRT_DEVICE", os.environ.get("PJRT_DEVICE", "CPU"))
        yield


def compilations() -> int:
    data = metrics.metric_data("CompileTime")
    return int(data[0]) if data else 0


def greedy_tokens(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def smollm2_on_xla():
    return LLM("smollm2-135m-instruct", device="tpu", **SETTINGS)


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_the_cpu_platform(smollm2_on_xla):
    cpu = LLM("smollm2-135m-instruct", device="cpu", **SETTINGS)
    expected = greedy_tokens(cpu, GOLDEN_PROMPTS, max_tokens=8)
    assert greedy_tokens(smollm2_on_xla, GOLDEN_PROMPTS, max_tokens=8) == expected
    assert greedy_tokens(smollm2_on_xla, GOLDEN_PROMPTS[1], max_tokens=8) == expected[1:2]  # alone: same tokens


def test_pallas_is_not_selected_on_xla_cpu(smollm2_on_xla):
    engine = smollm2_on_xla.engine
    assert tpu_generation(probe_device_kind()) is None
    assert engine.platform.attention_choice.kernel == "xla"
    assert type(engine.runner.backend) is XlaAttentionBackend


def record_step_shapes(llm: LLM) -> set[tuple[int, int, int]]:
    """Collect every step's padded (tokens, sequences, block-table width) as the backend sees it."""
    backend, seen = llm.engine.runner.backend, set()
    original = backend.prepare_metadata

    def prepare(meta):
        seen.add((meta.num_tokens, meta.num_seqs, int(meta.block_tables.shape[1])))
        return original(meta)

    backend.prepare_metadata = prepare
    return seen


def bucket_grid(settings: dict, block_size: int = 16) -> int:
    """How many (tokens, sequences, width) buckets the core's padding can produce for these settings."""
    def powers(lo: int, hi: int) -> int:
        return len([1 << k for k in range(16) if lo <= 1 << k <= max(lo, 1 << (hi - 1).bit_length())])

    max_blocks = -(-settings["max_model_len"] // block_size)
    return (powers(16, settings["max_num_batched_tokens"]) * powers(8, settings["max_num_seqs"])
            * powers(1, max_blocks))


@pytest.fixture(scope="module")
def tiny_llama_on_xla(tmp_path_factory):
    """A 2-layer random Llama saved as a Hugging Face folder: compiles in seconds, same shapes logic."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return LLM(str(folder), device="tpu", **SETTINGS)


def test_compilations_stay_within_the_buckets(tiny_llama_on_xla):
    """Varying batch sizes and prompt lengths over ~40 steps: compilations are bounded by the
    buckets, not by the number of steps, and a second pass over the same shapes compiles nothing."""
    llm = tiny_llama_on_xla
    shapes = record_step_shapes(llm)
    base = [101 + i for i in range(60)]
    workload = [([base[:5]], 12), ([base[:9], base[3:20]], 10), ([base[:40]], 6),
                ([base[i:i + 3 + 4 * i] for i in range(5)], 8), ([base[7:60]], 4)]
    before = compilations()
    for prompts, max_tokens in workload:
        greedy_tokens(llm, [{"prompt_token_ids": p} for p in prompts], max_tokens)
    first_pass = compilations() - before
    for prompts, max_tokens in workload:  # same lengths, other token values: the same shapes
        greedy_tokens(llm, [{"prompt_token_ids": [t + 1000 for t in p]} for p in prompts], max_tokens)
    second_pass = compilations() - before - first_pass
    seen = f"{len(shapes)} bucketed (tokens, sequences, width) step shapes {sorted(shapes)}"
    assert len(shapes) <= bucket_grid(SETTINGS)
    assert second_pass == 0, f"{second_pass} new compilations when replaying the same {seen}"
    assert first_pass <= 2 * len(shapes), (
        f"{first_pass} compilations for {seen}: expected at most two graphs per bucket (the step, cut by a "
        f"synchronize after the forward; logits and sampling at the padded sequence count)")


def test_captured_decode_replays_equal_eager_steps(tiny_llama_on_xla):
    """Decode graphs captured at token buckets (16, 32, ...), replayed for batches smaller than the
    bucket (padding rows write nowhere) with whole-bucket input copies: the same greedy tokens as the
    eager XLA engine, and a second pass over the same batch sizes compiles nothing new."""
    folder = tiny_llama_on_xla.engine.config.model
    graphed = LLM(folder, device="tpu", **{**SETTINGS, "enforce_eager": False})
    assert sorted(graphed.engine.runner.graphs) == [16]  # max_num_seqs 8: one token bucket
    prompts = [{"prompt_token_ids": [101 + i + j for j in range(5 + 3 * i)]} for i in range(3)]
    want = greedy_tokens(tiny_llama_on_xla, prompts, max_tokens=6)
    replays = []
    replay = graphed.engine.runner.decode_graphs.replay
    graphed.engine.runner.decode_graphs.replay = lambda *args: replays.append(args[0]) or replay(*args)
    assert greedy_tokens(graphed, prompts, max_tokens=6) == want
    assert replays and set(replays) == {16}
    before = compilations()
    assert greedy_tokens(graphed, [{"prompt_token_ids": [t + 7 for t in p["prompt_token_ids"]]} for p in prompts],
                         max_tokens=6)
    assert compilations() == before
