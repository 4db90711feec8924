"""SmolLM2 end to end on the CPU platform: its fast paths give the same greedy tokens as its plain ones.

float32, EOS ignored: the platform as installed (native kernel and fused ops) and, where IPEX
imports (`make test-ipex`), the platform on IPEX's attention (chosen the way a user would, with
PODIUM_CPU_ATTENTION=ipex and the engine's own platform selection), each against the same
platform with the pure-torch attention and the reference ops.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_fixtures import run_engines_on

from podium import LLM, SamplingParams
from podium.shard import resolve_dtype
from podium_cpu import CpuPlatform
from podium_cpu.attention import CpuAttentionBackend
from podium_cpu.ipex_support import ipex_status
from podium_cpu.platform import ATTENTION_ENV

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]


class PlainCpuPlatform(CpuPlatform):
    """The CPU platform without its fast paths: torch attention, reference ops."""

    def attention_backend(self):
        return CpuAttentionBackend(kernels=None)

    def custom_ops(self) -> dict:
        return {}


class UnpreparedCpuPlatform(CpuPlatform):
    """The CPU platform leaving the loaded model as built (no packed linears)."""

    def prepare_model(self, model):
        return model


def on_platform(monkeypatch, platform, dtype: str = "float32", **options) -> LLM:
    run_engines_on(monkeypatch, platform)
    return LLM("smollm2-135m-instruct", dtype=dtype, max_model_len=256, **options)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_tokens():
    with pytest.MonkeyPatch.context() as monkeypatch:
        llm = on_platform(monkeypatch, PlainCpuPlatform())
        assert llm.engine.platform.attention_backend().name == "cpu-paged"
        return greedy(llm)


@pytest.mark.slow
def test_native_paths_give_the_plain_paths_tokens(plain_tokens):
    fast = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=256)
    assert fast.engine.platform.attention_backend().name == "cpu-paged-native"
    assert greedy(fast) == plain_tokens


@pytest.mark.slow
def test_ipex_attention_gives_the_plain_paths_tokens(plain_tokens, monkeypatch):
    if ipex_status()[0] is None:
        if os.environ.get("PODIUM_EXPECT_IPEX"):
            pytest.fail(f"intel_extension_for_pytorch did not load: {ipex_status()[1]}")
        pytest.skip("intel_extension_for_pytorch is not installed")
    monkeypatch.setenv(ATTENTION_ENV, "ipex")
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=256)
    assert llm.engine.platform.attention_backend().name == "cpu-ipex"
    assert greedy(llm) == plain_tokens


def packed_lm_head_kernel(llm: LLM) -> str:
    """The kernel the loaded model's head runs on at one row, as the module says; checked against
    what the platform says it runs."""
    head = llm.engine.model.lm_head
    kernel = getattr(head, "kernel_name", "torch")
    dtype = head.weight.dtype if hasattr(head, "weight") else head.packed.dtype  # (a packed-only head)
    assert kernel == llm.engine.platform.linear_kernel(dtype, 49152, 576, 1).kernel
    return kernel


@pytest.mark.slow
def test_prepared_model_gives_the_unprepared_tokens_in_float32(monkeypatch):
    packed = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=256)
    packed_lm_head_kernel(packed)
    assert greedy(packed) == greedy(on_platform(monkeypatch, UnpreparedCpuPlatform(), "float32"))


def prompt_logprobs(llm: LLM, sequences: list[list[int]]) -> torch.Tensor:
    """Each sequence's teacher-forced logprobs of its own tokens (after the first), concatenated."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return torch.tensor([lp[t].logprob for o, s in zip(outs, sequences) for lp, t in zip(o.prompt_logprobs[1:], s[1:])])


@pytest.mark.slow
def test_prepared_model_is_as_close_to_float32_as_the_unprepared_in_bf16(monkeypatch):
    """bf16 on any CPU: the linears packed for the kernel the platform names (native, oneDNN, or left
    as built where neither runs: no crash at load). A native kernel sums in another order than
    torch's bf16 matmul, so greedy tokens may part where two logits are within bf16 rounding: the
    property is that, teacher-forced on the same tokens, the prepared model's logprobs are as close
    to float32's as the unprepared model's are (the kernels add no error of their own)."""
    # no prefix caching: a request's cached prompt positions get no prompt logprobs
    packed = LLM("smollm2-135m-instruct", dtype="bfloat16", device="cpu", max_model_len=256,
                 enable_prefix_caching=False)
    packed_lm_head_kernel(packed)
    unprepared = on_platform(monkeypatch, UnpreparedCpuPlatform(), "bfloat16", enable_prefix_caching=False)
    prompts = [o.prompt_token_ids + list(o.outputs[0].token_ids) for o in unprepared.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    float32 = prompt_logprobs(on_platform(monkeypatch, UnpreparedCpuPlatform(), "float32"), prompts)
    near = (prompt_logprobs(unprepared, prompts) - float32).abs()
    gap = (prompt_logprobs(packed, prompts) - float32).abs()
    assert float(gap.mean()) <= 1.5 * float(near.mean()) + 1e-3 and float(gap.max()) <= 2 * float(near.max()) + 1e-2


def test_auto_dtype_is_bf16_where_the_cpu_has_it():
    platform = CpuPlatform()
    native = platform.capabilities().extra["native_bf16"]
    assert resolve_dtype("auto", platform) == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("float32", platform) == torch.float32


