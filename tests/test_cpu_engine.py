"""SmolLM2 end to end on the CPU platform: its fast paths give the same greedy tokens as its plain ones.

float32, EOS ignored: the platform as installed (native kernel and fused ops, or IPEX's attention in
`make test-ipex`) against the same platform with the pure-torch attention and the reference ops.
"""

from __future__ import annotations

import pytest
import torch

from podium import LLM, SamplingParams
from podium.discovery import PlatformEntry
from podium.engine import LLMEngine
from podium_cpu import CpuPlatform
from podium_cpu.attention import CpuAttentionBackend
from podium_plugin_api import Availability

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]


class PlainCpuPlatform(CpuPlatform):
    """The CPU platform without its fast paths: torch attention, reference ops."""

    def attention_backend(self):
        return CpuAttentionBackend(kernels=None)

    def custom_ops(self) -> dict:
        return {}


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.slow
def test_fast_paths_give_the_plain_paths_tokens(monkeypatch):
    fast = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=256)
    assert fast.engine.platform.attention_backend().name in ("cpu-paged-native", "cpu-ipex", "cpu-paged")
    want_fast = greedy(fast)
    del fast
    entry = PlatformEntry(PlainCpuPlatform(), "test", "0", Availability(True))
    monkeypatch.setattr("podium.engine.select_platform", lambda name: entry)
    plain = LLM("smollm2-135m-instruct", dtype="float32", max_model_len=256)
    assert plain.engine.platform.attention_backend().name == "cpu-paged"
    assert greedy(plain) == want_fast


def test_auto_dtype_is_bf16_where_the_cpu_has_it():
    platform = CpuPlatform()
    native = platform.capabilities().extra["native_bf16"]
    assert LLMEngine._resolve_dtype("auto", platform) == (torch.bfloat16 if native else torch.float32)
    assert LLMEngine._resolve_dtype("float32", platform) == torch.float32


