"""CPU graph capture (podium_cpu/graphs.py): a decode step's native calls recorded once, replayed from C.

The properties a bug would break: a replayed step gives the eager step's logits bit for bit on
inputs the capture never saw (new tokens, longer sequences, other slots, other block tables,
padded rows); greedy generation through graphs gives the eager engine's tokens at every batch
bucket while sequences finish and the batch shrinks, and frees every block, in every dtype whose
linears run on a native kernel here (the platform says which: ``CpuPlatform.linear_kernel``); a
step with an op outside the native kernels is refused at capture (the engine stays eager) instead
of replaying wrongly; the embedding kernel is F.embedding's lookup.
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
from podium_plugin_api import GraphCaptureUnsupported
from podium_plugin_api.testing.attention_checks import check_graph_capture

# SmolLM2-135M's linears: q|k|v, o, gate|up, down, lm_head (out_features, in_features)
SMOLLM2_LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def captured_here(dtype: torch.dtype, rows: int = MAX_GRAPH_BATCH) -> bool:
    """Whether decode steps of ``rows`` sequences are all-native in ``dtype`` here, as the platform says."""
    platform = CpuPlatform()
    return all(platform.linear_kernel(dtype, n, k, rows).native for n, k in SMOLLM2_LINEARS)


def needs_native_linears(dtype: torch.dtype) -> None:
    if not captured_here(dtype):
        choice = CpuPlatform().linear_kernel(dtype, 576, 576, MAX_GRAPH_BATCH)
        pytest.skip(f"{dtype} linears are not native here, nothing to capture: {choice.kernel} ({choice.reason})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_captured_attention_replays_equal_eager_forwards(kernels, dtype):
    """The kit's check: capture one decode step, then replay it on longer sequences, new slots and
    new rows; each replay equals an eager forward. Not declined: the native attention is captured."""
    platform = CpuPlatform()
    assert platform.capabilities().graph_capture
    assert check_graph_capture(platform, platform.attention_backend(), dtype) is None


DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def graph_llm(request, kernels):
    needs_native_linears(request.param)
    return LLM("smollm2-135m-instruct", dtype=name(request.param), device="cpu", max_model_len=256, max_num_seqs=32)


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(llm: LLM) -> str:
    return name(next(llm.engine.model.parameters()).dtype)


def test_engine_captures_decode_buckets_up_to_the_limit(graph_llm):
    graphs = graph_llm.engine.runner.graphs
    assert sorted(graphs) == [1, 2, 4, 8, 16, 24, 32]  # max_num_seqs 32, under MAX_GRAPH_BATCH
    assert not capturing()


@pytest.mark.slow
def test_graphs_give_the_eager_engines_tokens_and_logprobs(graph_llm):
    """Batches of 1 to 29 decodes (every bucket up to 32, padded rows included), sequences finishing
    at different lengths so the batch shrinks through the buckets: the same tokens as eager and the
    same top-3 logprobs to the bit (the replayed logits are the eager ones), every block free after."""
    eager = LLM("smollm2-135m-instruct", dtype=dtype_of(graph_llm), device="cpu", max_model_len=256, max_num_seqs=32,
                enforce_eager=True)
    assert not eager.engine.runner.graphs
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 60))]}
               for _ in range(29)]
    # sequence i stops after 2 + i tokens: the batch shrinks one by one from 29 to 1
    params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True, logprobs=3) for i in range(len(prompts))]
    used = []
    graphs = graph_llm.engine.runner.decode_graphs
    original = graphs.replay

    def counting(size, *args, **kwargs):
        used.append(size)
        return original(size, *args, **kwargs)

    graphs.replay = counting
    try:
        got = [o.outputs[0] for o in graph_llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del graphs.replay
    want = [o.outputs[0] for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert set(used) == {1, 2, 4, 8, 16, 24, 32}  # the batch went through every bucket
    stats = graph_llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_step_with_a_torch_op_is_refused_not_replayed(kernels):
    """float16 linears are F.linear (a torch op; the platform says so): the capture is refused and the
    engine stays eager."""
    assert CpuPlatform().linear_kernel(torch.float16, 576, 576, 1).kernel == "torch"
    llm = LLM("smollm2-135m-instruct", dtype="float16", device="cpu", max_model_len=128, max_num_seqs=4)
    assert llm.engine.runner.graphs == {}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    runner = CpuGraphRunner()
    linear = nn.Linear(8, 8)
    with pytest.raises(GraphCaptureUnsupported, match="not a native kernel"):
        runner.capture(lambda: linear(torch.ones(2, 8)))
    assert not capturing()  # the recorder is gone after a refused capture too


@DTYPES
def test_graphs_stop_at_the_runners_limit(kernels, dtype):
    """max_num_seqs 100 would add a 100-row graph; the runner's max_batch_size stops the buckets at 64."""
    needs_native_linears(dtype)
    llm = LLM("smollm2-135m-instruct", dtype=name(dtype), device="cpu", max_model_len=128, max_num_seqs=100)
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


@DTYPES
@pytest.mark.parametrize("arch", ["mistral-sliding", "qwen2-bias", "llama-bias-linear-rope", "qwen3-qk-norm"])
def test_architectures_replay_their_eager_logprobs(kernels, arch, dtype, tmp_path):
    """Sliding windows, biases, rope scaling through graphs: eager's tokens and logprobs. Qwen3's
    q/k norms copy the heads out of the fused projection (a torch op): refused, eager, same results."""
    needs_native_linears(dtype)
    from model_fixtures import ARCHITECTURES, save_tiny_model

    model_type, overrides = ARCHITECTURES[arch]
    save_tiny_model(model_type, {**overrides, "max_position_embeddings": 128}, tmp_path, seed=3)
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(96) for _ in range(rng.randrange(2, 12))]} for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True, logprobs=2) for i in range(6)]
    outputs = {}
    for eager in (True, False):
        llm = LLM(str(tmp_path), dtype=name(dtype), device="cpu", max_num_seqs=8, enforce_eager=eager)
        assert bool(llm.engine.runner.graphs) == (not eager and arch != "qwen3-qk-norm")
        outputs[eager] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in outputs[False]] == [o.token_ids for o in outputs[True]]
    assert [o.logprobs for o in outputs[False]] == [o.logprobs for o in outputs[True]]
