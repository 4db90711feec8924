"""CPU graph capture (podium_cpu/graphs.py): a decode step's native calls recorded once, replayed from C.

The properties a bug would break: a replayed step gives the eager step's logits bit for bit on
inputs the capture never saw (new tokens, longer sequences, other slots, other block tables,
padded rows); greedy generation through graphs gives the eager engine's tokens at every batch
bucket while sequences finish and the batch shrinks, and frees every block; a step with an op
outside the native kernels is refused at capture (the engine stays eager) instead of replaying
wrongly; the embedding kernel is F.embedding's lookup.

Whether an engine captures depends on the kernels its CPU runs the linears on, so the tests ask the
engine (``linear_kernels``) instead of guessing from CPU flags: bf16 linears on the native AMX or
FMA kernel are captured; on oneDNN (AVX-512 without AMX) the step is refused and stays eager.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from podium import LLM, SamplingParams
from podium_cpu import CpuPlatform
from podium_cpu.embedding import NativeEmbedding
from podium_cpu.graphs import MAX_GRAPH_BATCH, CpuGraphRunner, capturing
from podium_cpu.linear_packing import NativeLinear, PackedLinear
from podium_cpu.native_kernels import load_kernels
from podium_plugin_api import GraphCaptureUnsupported
from podium_plugin_api.testing.attention_checks import check_graph_capture


@pytest.fixture(scope="module")
def kernels():
    loaded, why = load_kernels()
    if loaded is None:
        pytest.skip(f"native kernels unavailable: {why}")
    return loaded


def linear_kernels(llm) -> set[str]:
    """The kernels the engine packed its model's linears for: "amx", "fma" (native) or "onednn"."""
    return {m.kind if isinstance(m, NativeLinear) else "onednn"
            for m in llm.engine.model.modules() if isinstance(m, (NativeLinear, PackedLinear))}


def captures(llm) -> bool:
    """Whether this engine's decode step can be captured: every linear on a native kernel."""
    kinds = linear_kernels(llm)
    return bool(kinds) and kinds <= {"amx", "fma"}


def skip_unless_captured(llm) -> None:
    if not captures(llm):
        pytest.skip(f"bf16 linears run on {sorted(linear_kernels(llm))} here, not a native kernel: no graphs "
                    "to compare (test_engine_captures_decode_buckets_up_to_the_limit checks the refusal)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_captured_attention_replays_equal_eager_forwards(kernels, dtype):
    """The kit's check: capture one decode step, then replay it on longer sequences, new slots and
    new rows; each replay equals an eager forward. Not declined: the native attention is captured."""
    platform = CpuPlatform()
    assert platform.capabilities().graph_capture
    assert check_graph_capture(platform, platform.attention_backend(), dtype) is None


@pytest.fixture(scope="module")
def bf16_llm(kernels):
    return LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", max_model_len=256, max_num_seqs=32)


def test_engine_captures_decode_buckets_up_to_the_limit(bf16_llm):
    """Native linears: every bucket up to max_num_seqs is captured. oneDNN linears (a torch op):
    the capture is refused, no graph is kept, and the engine still generates."""
    graphs = bf16_llm.engine.runner.graphs
    assert linear_kernels(bf16_llm)  # the platform packed the model's bf16 linears for some kernel
    if captures(bf16_llm):
        assert sorted(graphs) == [1, 2, 4, 8, 16, 24, 32]  # max_num_seqs 32, under MAX_GRAPH_BATCH
    else:
        assert graphs == {}
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        assert len(bf16_llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].token_ids) == 3
    assert not capturing()


@pytest.mark.slow
def test_graphs_give_the_eager_engines_tokens_and_logprobs(bf16_llm):
    """Batches of 1 to 29 decodes (every bucket up to 32, padded rows included), sequences finishing
    at different lengths so the batch shrinks through the buckets: the same tokens as eager and the
    same top-3 logprobs to the bit (the replayed logits are the eager ones), every block free after."""
    skip_unless_captured(bf16_llm)
    eager = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", max_model_len=256, max_num_seqs=32,
                enforce_eager=True)
    assert not eager.engine.runner.graphs
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 60))]}
               for _ in range(29)]
    # sequence i stops after 2 + i tokens: the batch shrinks one by one from 29 to 1
    params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True, logprobs=3) for i in range(len(prompts))]
    used = []
    original = bf16_llm.engine.runner._replay

    def counting(size, *args, **kwargs):
        used.append(size)
        return original(size, *args, **kwargs)

    bf16_llm.engine.runner._replay = counting
    try:
        got = [o.outputs[0] for o in bf16_llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del bf16_llm.engine.runner._replay
    want = [o.outputs[0] for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert set(used) == {1, 2, 4, 8, 16, 24, 32}  # the batch went through every bucket
    stats = bf16_llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_step_with_a_torch_op_is_refused_not_replayed(kernels):
    """float32 linears run on oneDNN (a torch op): the capture is refused and the engine stays eager."""
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=128, max_num_seqs=4)
    assert llm.engine.runner.graphs == {}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    runner = CpuGraphRunner()
    linear = nn.Linear(8, 8)
    with pytest.raises(GraphCaptureUnsupported, match="not a native kernel"):
        runner.capture(lambda: linear(torch.ones(2, 8)))
    assert not capturing()  # the recorder is gone after a refused capture too


def test_graphs_stop_at_the_runners_limit(kernels):
    """max_num_seqs 100 would add a 100-row graph; the runner's max_batch_size stops the buckets at 64."""
    llm = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", max_model_len=128, max_num_seqs=100)
    skip_unless_captured(llm)
    assert sorted(llm.engine.runner.graphs) == [1, 2, 4, 8, 16, 24, 32, 48, MAX_GRAPH_BATCH]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_native_embedding_is_f_embedding(kernels, dtype):
    base = nn.Embedding(50, 12).to(dtype)
    layer = NativeEmbedding(base, kernels.embed_rows[dtype])
    ids = torch.tensor([3, 0, 49, 3, 17])
    assert torch.equal(layer(ids), F.embedding(ids, base.weight))
    assert torch.equal(layer(ids.view(1, 5)), F.embedding(ids.view(1, 5), base.weight))  # other shapes: torch
    assert layer.weight is base.weight
    with pytest.raises(IndexError, match=r"in \[0, 50\), got \[-1, 17\]"):
        layer(torch.tensor([5, -1, 17]))
    with pytest.raises(IndexError, match=r"got \[0, 50\]"):
        layer(torch.tensor([0, 50]))


def test_smaller_graphs_share_the_largest_ones_buffers(kernels):
    """Captured largest first (as the engine does), a smaller step's tensors are views of the larger
    one's: one set of buffers for every size. Each replay reads its own ids anew."""
    embedding = NativeEmbedding(nn.Embedding(50, 12).bfloat16(), kernels.embed_rows[torch.bfloat16])
    big, small = torch.zeros(8, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    runner = CpuGraphRunner()
    replay_big = runner.capture(lambda: embedding(big))
    replay_small = runner.capture(lambda: embedding(small))
    big.copy_(torch.tensor([1, 2, 3, 4, 5, 6, 7, 49]))
    small.copy_(torch.tensor([9, 0]))
    out_big = replay_big()
    assert torch.equal(out_big, F.embedding(big, embedding.weight))
    out_small = replay_small()
    assert torch.equal(out_small, F.embedding(small, embedding.weight))
    assert out_small.data_ptr() == out_big.data_ptr()  # the same memory: the big output is overwritten now


@pytest.mark.parametrize("arch", ["mistral-sliding", "qwen2-bias", "llama-bias-linear-rope", "qwen3-qk-norm"])
def test_architectures_replay_their_eager_logprobs(kernels, arch, tmp_path):
    """Sliding windows, biases, rope scaling through graphs: eager's tokens and logprobs. Qwen3's
    q/k norms copy the heads out of the fused projection (a torch op): refused, eager, same results.
    Where the linears run on oneDNN every architecture is refused: eager twice, same results."""
    from model_fixtures import ARCHITECTURES, save_tiny_model

    model_type, overrides = ARCHITECTURES[arch]
    save_tiny_model(model_type, {**overrides, "max_position_embeddings": 128}, tmp_path, seed=3)
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(96) for _ in range(rng.randrange(2, 12))]} for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=2) for i in range(6)]
    outputs = {}
    for eager in (True, False):
        llm = LLM(str(tmp_path), dtype="bfloat16", device="cpu", max_num_seqs=8, enforce_eager=eager)
        assert bool(llm.engine.runner.graphs) == (not eager and arch != "qwen3-qk-norm" and captures(llm))
        outputs[eager] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in outputs[False]] == [o.token_ids for o in outputs[True]]
    assert [o.logprobs for o in outputs[False]] == [o.logprobs for o in outputs[True]]
