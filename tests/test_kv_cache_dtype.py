"""``kv_cache_dtype``: what the paged KV cache stores (vLLM's option of that name).

The option is checked at the edge, resolved through the platform's fp8 flavour and the attention
backend's ``kv_cache_dtypes`` (plugin API 1.4), and sizes the cache by its own element size. fp8
stores follow ``to_cache_dtype`` (round to nearest even, saturating). Numerics end to end: the
SmolLM2 golden test against transformers with the same rounding; the CUDA kernels bit for bit in
platforms/cuda/tests/test_fp8_cache.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from engine_fixtures import run_engines_on

from podium import LLM, SamplingParams
from podium.config import KV_CACHE_DTYPES, EngineConfig
from podium.kv_cache import resolve_kv_cache_dtype
from podium_cpu import CpuPlatform
from podium_plugin_api import AttentionBackend, Capabilities, Platform, fp8_dtypes, to_cache_dtype


class Fp8Platform(Platform):
    name = "fake-fp8"

    def __init__(self, flavour):
        self.flavour = flavour

    def capabilities(self):
        return Capabilities(fp8=self.flavour)


class ListingBackend(AttentionBackend):
    name = "listing"

    def __init__(self, *extra):
        self.extra = extra

    def kv_cache_dtypes(self, model_dtype):
        return (model_dtype, *self.extra)


def test_config_names_the_choices_on_a_bad_kv_cache_dtype():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, .*fp8_e5m2, got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("smollm2-135m-instruct", device="cpu", kv_cache_dtype="fp16")


@pytest.mark.parametrize("flavour,e4m3,e5m2", [("e4m3fn", torch.float8_e4m3fn, torch.float8_e5m2),
                                               ("e4m3fnuz", torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)])
def test_fp8_names_resolve_to_the_platforms_flavour(flavour, e4m3, e5m2):
    platform, backend = Fp8Platform(flavour), ListingBackend(*fp8_dtypes(flavour).values())
    resolve = lambda name: resolve_kv_cache_dtype(name, torch.bfloat16, platform, backend)  # noqa: E731
    assert resolve("auto") == resolve("bfloat16") == torch.bfloat16
    assert resolve("fp8") == resolve("fp8_e4m3") == e4m3
    assert resolve("fp8_e5m2") == e5m2


def test_unsupported_kv_cache_dtypes_are_refused_with_what_is_supported():
    with pytest.raises(ValueError, match="platform 'fake-fp8' has no fp8 formats"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, Fp8Platform(None), ListingBackend())
    with pytest.raises(ValueError, match=r"not supported by platform 'fake-fp8'.*backend 'torch-reference' for a "
                                         r"bfloat16 model; it supports: auto$"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, Fp8Platform("e4m3fn"), AttentionBackend())
    with pytest.raises(ValueError, match=r"'float32' \(float32\).*it supports: auto, float8_e4m3fn"):
        resolve_kv_cache_dtype("float32", torch.bfloat16, Fp8Platform("e4m3fn"), ListingBackend(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="unknown fp8 flavour 'e3m4'"):
        fp8_dtypes("e3m4")


@pytest.mark.parametrize("dtype,largest", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0),
                                           (torch.float8_e4m3fnuz, 240.0)])
def test_fp8_stores_round_to_nearest_even_and_saturate(dtype, largest):
    x = torch.tensor([1e6, -1e6, float("inf"), -float("inf"), largest, 0.0, 1.0], dtype=torch.bfloat16)
    got = to_cache_dtype(x, dtype).float()
    assert got.tolist() == [largest, -largest, largest, -largest, largest, 0.0, 1.0]
    assert to_cache_dtype(torch.tensor([1.0625, 1.1875]), torch.float8_e4m3fn).float().tolist() == [1.0, 1.25]
    assert to_cache_dtype(torch.tensor([3.0]), torch.bfloat16).dtype == torch.bfloat16  # other dtypes: a cast


def test_every_kv_cache_dtype_name_means_something_on_the_cpu():
    platform = CpuPlatform()
    backend = platform.attention_backend()
    got = {name: resolve_kv_cache_dtype(name, torch.float32, platform, backend)
           for name in KV_CACHE_DTYPES if name not in ("bfloat16", "float16")}
    assert got == {"auto": torch.float32, "float32": torch.float32, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def test_fp8_cache_holds_twice_the_blocks_and_serves(caplog):
    """The same kv_cache_memory holds twice a bf16 cache's blocks; the log says so; generation runs
    and sequences free their blocks."""
    caplog.set_level(logging.INFO, logger="podium")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bf16 = LLM("smollm2-135m-instruct", device="cpu", dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512)
    fp8 = LLM("smollm2-135m-instruct", device="cpu", dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512,
              kv_cache_dtype="fp8")
    assert bf16.engine.kv_caches[0].dtype == torch.bfloat16
    assert fp8.engine.kv_cache_dtype == fp8.engine.kv_caches[0].dtype == torch.float8_e4m3fn
    assert fp8.engine.num_kv_blocks == 2 * bf16.engine.num_kv_blocks
    assert any("float8_e4m3fn" in r.getMessage() and "KV cache" in r.getMessage() for r in caplog.records)
    outs = fp8.generate(["The capital of France is", "def fib(n):"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    stats = fp8.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_backend_without_fp8_refuses_it_at_startup(monkeypatch):
    class NoFp8Cpu(CpuPlatform):
        def attention_backend(self):
            return AttentionBackend()

    run_engines_on(monkeypatch, NoFp8Cpu())
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' \\(float8_e4m3fn\\) is not supported"):
        LLM("smollm2-135m-instruct", dtype="float32", kv_cache_dtype="fp8")
