"""The CPU kernels built for the other x86 kinds CI and users run, executed on this CPU.

The platform compiles its kernels with ``-march=native``, so a machine only ever tests its own
kind's code paths. An AVX-512 CPU can also run code built for AVX2 + FMA (AMD Zen 2/3's kind: ymm
linears and attention, the bf16 FMA kernel) and for SSE only (the generic vector paths, no native
linears), so these builds run here too, into their own cache folder: every native linear kernel the
build has must round the exact result once, and the attention (prefill tiles and decode tokens,
sliding window, soft cap) must match the pure-torch reference, with rotary fused bit for bit.
"""

from __future__ import annotations

import platform

import pytest
import torch
from torch import nn

from podium_cpu import native_kernels
from podium_cpu.attention import CpuAttentionBackend
from podium_cpu.linear_choice import runnable_native_kernels
from podium_cpu.linear_packing import NativeLinear
from podium_plugin_api.testing.batches import AttentionCase, build_batch
from podium_plugin_api.testing.report import check_close

KINDS = {"x86-64-v3": "AVX2 + FMA", "x86-64-v2": "SSE only"}
CASES = [
    AttentionCase("prefill-and-decodes", ((70, 70), (20, 90), (1, 40), (3, 3)), num_heads=9, num_kv_heads=3),
    AttentionCase("window-soft-cap", ((40, 60), (1, 50)), num_heads=4, num_kv_heads=2, sliding_window=19, soft_cap=3.0),
]


@pytest.fixture(scope="module", params=list(KINDS), ids=list(KINDS.values()))
def kernels(request, tmp_path_factory):
    if platform.machine() != "x86_64":
        pytest.skip("x86 builds")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        patch.setattr(native_kernels, "FLAGS", tuple(f"-march={request.param}" if f == "-march=native" else f
                                                     for f in native_kernels.FLAGS))
        patch.setattr(native_kernels, "_LOADED", {})
        if not native_kernels.compiler_found():
            pytest.skip("no C compiler")
        loaded, why = native_kernels.load_kernels()
    assert loaded is not None, why
    return request.param, loaded


@pytest.mark.slow
def test_native_linears_of_the_build_round_the_exact_result_once(kernels):
    march, loaded = kernels
    found = runnable_native_kernels(loaded)
    assert {(k.name, k.dtype) for k in found} == ({("fma", torch.float32), ("fma", torch.bfloat16)}
                                                   if march == "x86-64-v3" else set())
    torch.manual_seed(0)
    for kernel in found:
        linear = nn.Linear(70, 100, bias=True).to(kernel.dtype).requires_grad_(False)
        layer = NativeLinear(linear, kernel)
        for rows in (1, 7, 33):
            x = torch.randn(rows, 70).to(kernel.dtype)
            want = x.double() @ linear.weight.double().T + linear.bias.double()
            magnitude = x.double().abs() @ linear.weight.double().abs().T + linear.bias.double().abs()
            unit = 2.0**-8 if kernel.dtype == torch.bfloat16 else 2.0**-24
            assert bool(((layer(x).double() - want).abs() <= unit * want.abs() + 70 * 2.0**-23 * magnitude).all())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_of_the_build_matches_the_reference(kernels, dtype):
    from podium_cpu import CpuPlatform
    from podium_plugin_api import RotaryInputs, ops
    from podium_plugin_api.testing.attention_checks import rotary_table

    backend, host = CpuAttentionBackend(kernels[1]), CpuPlatform()
    for case in CASES:
        batch = build_batch(host, backend, case, dtype, 7)
        out = backend.forward(case.layer(), batch.query, batch.key, batch.value, batch.kv_cache, batch.meta)
        check_close(out, batch.reference_output(), what=f"{kernels[0]} {case.name}", dtype=dtype, locate=batch.locate)
        fused, plain = (build_batch(host, backend, case, dtype, 8) for _ in range(2))
        positions = torch.cat([torch.arange(s - q, s) for q, s in case.seqs])
        table = rotary_table(100, case.head_size)
        got = backend.forward_rotary(case.layer(), fused.query, fused.key, fused.value, fused.kv_cache, fused.meta,
                                     RotaryInputs(positions, table, None))
        query, key = ops.rotary_embedding(positions, plain.query, plain.key, table)
        assert torch.equal(got, backend.forward(case.layer(), query, key, plain.value, plain.kv_cache, plain.meta))


@pytest.mark.slow
def test_gguf_linears_of_the_build(kernels):
    """The GGUF kernels of the build: AVX2's integer sums and float order are the native build's (AMX
    tiles or VNNI where this CPU has them), so x86-64-v3 agrees with it bit for bit, batches and decode
    rows alike; the plain C of x86-64-v2 orders its float sums otherwise and matches the int8-activation
    product within float32 rounding."""
    from podium_cpu import gguf_ops
    from podium_plugin_api.gguf_blocks import BLOCKS, dequantize_rows, random_rows

    march, loaded = kernels
    native, why = native_kernels.load_kernels()
    assert native is not None, why
    gen = torch.Generator().manual_seed(5)
    for ggml_type, (weights, _) in sorted(BLOCKS.items()):
        k = 512 if weights == 256 else 544
        weight = random_rows(ggml_type, 37, k, gen)
        bias = torch.randn(37, generator=gen)
        for rows in (1, 2, 5, 33):
            x = torch.randn(rows, k, generator=gen)
            got = gguf_ops.gguf_linear(loaded, x, weight, ggml_type, bias)
            if march == "x86-64-v3":
                assert torch.equal(got, gguf_ops.gguf_linear(native, x, weight, ggml_type, bias)), (ggml_type, rows)
                continue
            blocks = x.reshape(rows, -1, 32)
            d = blocks.abs().amax(-1, keepdim=True) / 127
            q = torch.round(blocks * torch.where(d != 0, 1 / d, torch.zeros_like(d)))
            want = (q.double() * d.double()).reshape(rows, k) @ dequantize_rows(weight, ggml_type, torch.float64).t()
            want += bias.double()
            assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item(), (ggml_type, rows)
