"""The engine on CUDA equals the engine on CPU (float32, TF32 off) and keeps its invariants.

Weights are random from a fixed seed, built on the CPU and saved as a Hugging Face folder, so
both platforms load the very same tensors (the real GGUF is too big to travel to the GPU box).
``PODIUM_TEST_GPU_DEVICE=rocm`` (with ``PODIUM_ROCM_FORCE_ON_CUDA=1`` on an NVIDIA GPU) runs the
same tests on the ROCm platform's code path.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from podium import LLM, SamplingParams

pytestmark = pytest.mark.cuda

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
GPU = os.environ.get("PODIUM_TEST_GPU_DEVICE", "cuda")  # the platform under test


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # peaked logits: greedy choices far from ties
        model.model.embed_tokens.weight.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("random-llama")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(4096) for _ in range(rng.randint(3, 200))] for _ in range(12)]


@pytest.fixture(scope="module")
def cuda_llm(model_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return LLM(model_dir, device=GPU, dtype="float32", max_num_seqs=64, kv_cache_memory="2GiB")


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def all_free(llm) -> bool:
    s = llm.engine.stats()
    return s.num_free_blocks == s.num_total_blocks


def test_cuda_greedy_equals_cpu(model_dir, prompts, cuda_llm):
    cpu = LLM(model_dir, device="cpu", dtype="float32")
    want = tokens(cpu.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    got = tokens(cuda_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    for i, (g, w) in enumerate(zip(got, want)):
        first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert g == w, f"prompt {i}: first difference at output token {first}"


def test_cuda_fp8_kv_cache_equals_cpu_fp8_and_is_batch_invariant(model_dir, prompts, cuda_llm):
    """kv_cache_dtype="fp8": a quarter of a float32 cache's bytes a block (4x the blocks in the same
    memory); greedy tokens equal the CPU platform's fp8 cache (the same casts, peaked logits) and
    do not depend on what else is in the batch."""
    if GPU != "cuda":
        pytest.skip("the ROCm backend lists no fp8 cache (its kernels never ran on an AMD GPU)")
    fp8 = LLM(model_dir, device=GPU, dtype="float32", max_num_seqs=64, kv_cache_memory="2GiB", kv_cache_dtype="fp8")
    assert fp8.engine.kv_caches[0].dtype == torch.float8_e4m3fn
    assert fp8.engine.num_kv_blocks == 4 * cuda_llm.engine.num_kv_blocks
    cpu = LLM(model_dir, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    batch = [{"prompt_token_ids": p} for p in prompts]
    got = tokens(fp8.generate(batch, GREEDY, use_tqdm=False))
    assert got == tokens(cpu.generate(batch, GREEDY, use_tqdm=False))
    alone = [tokens(fp8.generate([b], GREEDY, use_tqdm=False))[0] for b in batch[:3]]
    assert alone == got[:3]
    assert all_free(fp8)


def test_cuda_batch_chunk_and_preemption_invariance(model_dir, prompts, cuda_llm):
    alone = [tokens(cuda_llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False))[0] for p in prompts[:3]]
    rng = random.Random(1)
    crowd = prompts[:3] + [[rng.randrange(4096) for _ in range(rng.randint(1, 300))] for _ in range(29)]
    params = [GREEDY] * 3 + [SamplingParams(temperature=0.7, seed=i, max_tokens=rng.randint(1, 40),
                                            ignore_eos=True) for i in range(29)]
    together = tokens(cuda_llm.generate([{"prompt_token_ids": p} for p in crowd], params, use_tqdm=False))
    assert together[:3] == alone
    assert all_free(cuda_llm)
    small = LLM(model_dir, device=GPU, dtype="float32", max_num_batched_tokens=32, num_kv_blocks=40,
                max_model_len=512)
    again = tokens(small.generate([{"prompt_token_ids": p} for p in crowd], params, use_tqdm=False))
    assert again[:3] == alone
    assert small.engine.stats().num_preemptions > 0
    assert all_free(small)


def test_cuda_graphs_were_captured_and_eager_agrees(model_dir, prompts, cuda_llm):
    assert cuda_llm.engine.runner.graphs, "no decode graph was captured"
    eager = LLM(model_dir, device=GPU, dtype="float32", enforce_eager=True, kv_cache_memory="2GiB")
    assert not eager.engine.runner.graphs
    batch = [{"prompt_token_ids": p} for p in prompts[:6]]
    assert tokens(eager.generate(batch, GREEDY, use_tqdm=False)) == tokens(
        cuda_llm.generate(batch, GREEDY, use_tqdm=False))


def test_cuda_async_scheduling_equals_sync(model_dir, prompts, cuda_llm):
    """The engine overlaps host and GPU by default here; the tokens equal a synchronous engine's,
    with sampling, stop token ids and EOS ending sequences while the next step is in flight."""
    assert cuda_llm.engine.async_scheduling
    sync = LLM(model_dir, device=GPU, dtype="float32", max_num_seqs=64, kv_cache_memory="2GiB",
               async_scheduling=False)
    assert not sync.engine.async_scheduling
    rng = random.Random(2)
    params = [SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=rng.randint(1, 40),
                             stop_token_ids=[rng.randrange(4096) for _ in range(40)]) if i % 2 else GREEDY
              for i in range(len(prompts))]
    batch = [{"prompt_token_ids": p} for p in prompts]
    want = tokens(sync.generate(batch, params, use_tqdm=False))
    got = tokens(cuda_llm.generate(batch, params, use_tqdm=False))
    assert got == want
    assert all_free(cuda_llm)


def test_cuda_bf16_batch_one_decode_takes_the_gemv_and_follows_transformers(model_dir, prompts):
    """bfloat16: a request decoding alone runs its linears as the Triton GEMV (norm / SiLU-mul fused
    in); the same requests decoding together run cuBLAS. Both stay as close to float32 transformers,
    teacher-forced on each run's own tokens, as bf16 allows: the GEMV path may not be further off."""
    if GPU != "cuda":
        pytest.skip("the batch-1 GEMV is the CUDA platform's (ROCm keeps hipBLAS: gemv_batch1=False)")
    from model_fixtures import teacher_forced_gaps
    from transformers import AutoModelForCausalLM

    from podium_cuda.fused_linear import FUSED_LINEAR_OPS
    from podium_cuda.gemv import BatchOneLinear

    llm = LLM(model_dir, device=GPU, dtype="bfloat16", kv_cache_memory="2GiB")
    assert llm.engine.ops["rms_norm_linear"] is FUSED_LINEAR_OPS["rms_norm_linear"]
    assert type(llm.engine.model.lm_head) is BatchOneLinear
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    batch = [{"prompt_token_ids": p} for p in prompts[:4]]
    alone = [llm.generate([b], params, use_tqdm=False)[0].outputs[0] for b in batch]
    together = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    gemv_gap = float(teacher_forced_gaps(hf, prompts, alone).mean())
    cublas_gap = float(teacher_forced_gaps(hf, prompts, together).mean())
    assert gemv_gap < 2 * cublas_gap + 0.02, (gemv_gap, cublas_gap)
    assert all_free(llm)
