"""The CPU GGUF kernels (native/gguf_linear.c) against a reference written here: activations quantized
to int8 per 32 values as llama.cpp does (d = max|x| / 127, q = round(x / d), to nearest even), times
the weights as the contract dequantizes them (``dequantize_rows``, itself bit-exact with gguf-py's
``dequantize``, tests/test_gguf_blocks.py), summed in float64. Needs no gguf-py (only the AMX check
against it skips without), so it also runs on the GPU machine's CPU (benchmarks/quant_gpu.sh), whose
VNNI instructions this one lacks. Where AMX-INT8 runs, batches go to its tiles: checked bit for bit
against the AVX2 / VNNI path they replace."""

from __future__ import annotations

import pytest
import torch

from podium_cpu import gguf_ops
from podium_cpu.platform import CpuPlatform
from podium_plugin_api.gguf_blocks import BLOCKS, NAMES, dequantize_rows, random_rows

TYPES = sorted(BLOCKS)



def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> its int8-per-32 approximation d * q, float64 (computed in float32 as the kernel does)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse)  # half to even, like the kernel's cvtps2dq
    return (q.double() * d.double()).reshape(x.shape)


def columns_for(ggml_type: int) -> int:
    """A K of whole blocks that is not a multiple of 8 chunks of 32 (a partial group of scales)."""
    return 768 if BLOCKS[ggml_type][0] == 256 else 544


@pytest.mark.parametrize("ggml_type", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize("rows", [1, 2, 3, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_linear_is_the_int8_activation_product(kernels, ggml_type, rows, dtype):
    """The decode path (1-2 rows, weights unpacked into registers) and the batch path (the rest) both;
    61 output columns: a short last group of 8."""
    gen = torch.Generator().manual_seed(10 * ggml_type + rows)
    k = columns_for(ggml_type)
    weight = random_rows(ggml_type, 61, k, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(61, generator=gen).to(dtype)
    got = gguf_ops.gguf_linear(kernels, x, weight, ggml_type, bias)
    want = quantized_activations(x) @ dequantize_rows(weight, ggml_type, torch.float64).t() + bias.double()
    exact = x.double() @ dequantize_rows(weight, ggml_type, torch.float64).t() + bias.double()
    scale = want.abs().max().item()
    assert got.dtype == dtype and got.shape == (rows, 61)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-5  # bf16 out: one rounding of the result
    assert (got.double() - want).abs().max().item() <= tol * scale
    # what the activations' rounding costs against the float product: well inside bf16's tolerance
    assert (got.double() - exact).abs().max().item() <= 2e-2 * scale


@pytest.mark.parametrize("ggml_type", TYPES, ids=[NAMES[t] for t in TYPES])
def test_a_rows_result_does_not_depend_on_the_batch(kernels, ggml_type):
    """Row i of a 37-row call (batch path) equals the same row alone and in a pair (decode path), bit for
    bit: the invariant greedy decoding rests on."""
    gen = torch.Generator().manual_seed(ggml_type)
    k = columns_for(ggml_type)
    weight = random_rows(ggml_type, 29, k, gen)
    x = torch.randn(37, k, generator=gen)
    batch = gguf_ops.gguf_linear(kernels, x, weight, ggml_type)
    for i in (0, 17, 36):
        assert torch.equal(gguf_ops.gguf_linear(kernels, x[i:i + 1], weight, ggml_type), batch[i:i + 1])
        assert torch.equal(gguf_ops.gguf_linear(kernels, x[i:i + 2], weight, ggml_type)[:1], batch[i:i + 1])


def test_zero_and_large_activations(kernels):
    """An all-zero block (d = 0) and a block with one large value next to small ones."""
    gen = torch.Generator().manual_seed(3)
    weight = random_rows(3, 16, 64, gen)
    x = torch.randn(3, 64, generator=gen)
    x[0, :32] = 0
    x[1, 5] = 1e4
    got = gguf_ops.gguf_linear(kernels, x, weight, 3)
    want = quantized_activations(x) @ dequantize_rows(weight, 3, torch.float64).t()
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.fixture(params=["amx", "vnni512"])
def batch_path(request, kernels):
    """(kernels, use): one of the 512-bit batch paths (gguf_amx.h: AMX-INT8 tiles, or its layout on
    AVX-512 VNNI), skipped where this CPU, build or process has none; use(True) runs batches on it,
    use(False) on the AVX2 / VNNI-256 rows. The load-time switches are restored afterwards."""

    def use(on: bool) -> None:
        kernels.gguf_amx(1 if on and request.param == "amx" else 0)
        kernels.gguf_vnni512(1 if on and request.param == "vnni512" else 0)

    if request.param == "amx" and (not kernels.amx_linear or not kernels.gguf_amx(1)):  # the OS granted AMX
        pytest.skip("no AMX-INT8 tiles here")
    kernels.gguf_amx(0)
    if request.param == "vnni512" and not kernels.gguf_vnni512(1):
        kernels.gguf_amx(1 if kernels.amx_linear else 0)
        pytest.skip("no AVX-512 VNNI here")
    use(True)
    yield kernels, use
    kernels.gguf_amx(1 if kernels.amx_linear else 0)
    kernels.gguf_vnni512(1)


def gguf_py_weights(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The rows as gguf-py's ``dequantize`` gives them, float64."""
    import numpy as np

    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    values = gguf_quants.dequantize(weight.numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))


@pytest.mark.parametrize("ggml_type", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_512_bit_batches_equal_the_vector_path(batch_path, ggml_type, dtype):
    """AMX-INT8 tiles, or vpdpbusd over their layout, sum the same integers and scale them in the same
    float order as the AVX2 / VNNI batch path, so the results agree bit for bit: 8 rows (the smallest
    such call), 16, and 50 (a short last tile of x rows); 61 output columns (a short last group of 16
    weight rows); K of an odd number of chunks, so the last step of sums is short."""
    kernels, use = batch_path
    gen = torch.Generator().manual_seed(100 + ggml_type)
    k = columns_for(ggml_type) + (BLOCKS[ggml_type][0] if BLOCKS[ggml_type][0] == 256 else 0)
    weight = random_rows(ggml_type, 61, k, gen)
    bias = torch.randn(61, generator=gen)
    for rows in (8, 16, 50):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        use(True)
        tiles = gguf_ops.gguf_linear(kernels, x, weight, ggml_type, bias)
        use(False)
        vectors = gguf_ops.gguf_linear(kernels, x, weight, ggml_type, bias)
        assert torch.equal(tiles, vectors), (rows, (tiles.double() - vectors.double()).abs().max().item())


@pytest.mark.parametrize("ggml_type", TYPES, ids=[NAMES[t] for t in TYPES])
def test_512_bit_batches_against_gguf_py(batch_path, ggml_type):
    """32 rows on AMX tiles or AVX-512 VNNI (strided x, as a model's slices give) against x's int8-per-32
    approximation times gguf-py's dequantized weights in float64, and against the unquantized float product."""
    gen = torch.Generator().manual_seed(200 + ggml_type)
    k = columns_for(ggml_type)
    weight = random_rows(ggml_type, 96, k, gen)
    x = torch.randn(32, k + 64, generator=gen)[:, 16:16 + k]
    got = gguf_ops.gguf_linear(batch_path[0], x, weight, ggml_type)
    dense = gguf_py_weights(weight, ggml_type)
    want = quantized_activations(x) @ dense.t()
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 1e-5 * scale
    assert (got.double() - x.double() @ dense.t()).abs().max().item() <= 2e-2 * scale


def test_the_platform_states_the_gguf_batch_path(batch_path):
    """``podium platforms --verbose``'s "gguf batches" line follows the switches that choose the path,
    and asking does not change them: the 512-bit path's name while it is on, the AVX2 / VNNI-256 rows
    for every batch while it is off."""
    kernels, use = batch_path
    wide = "AMX-INT8" if kernels.gguf_amx(-1) else "AVX-512 VNNI"
    assert gguf_ops.batch_path(kernels).startswith(wide)
    use(False)
    assert gguf_ops.batch_path(kernels) == "the AVX2 / VNNI-256 rows (gguf_linear.c) for every batch"
    assert not kernels.gguf_amx(-1) and not kernels.gguf_vnni512(-1)
    use(True)
    assert gguf_ops.batch_path(kernels).startswith(wide)
    extra = CpuPlatform().capabilities().extra
    assert extra["gguf batches"] == gguf_ops.batch_path(kernels)


def test_the_amx_option_turns_off_the_gguf_amx_batches(kernels):
    """The platform option ``amx`` off runs the GGUF batches as on a CPU without AMX, as it does the
    bf16 linears and the prefill attention: the switch is off once the platform hands out its ops and
    its capabilities say so; on again (where this process may use AMX) with the option on."""
    options = {"attention": "auto", "kv_cache_commit": False, "linears": "auto", "amx_plain_weights": False}
    try:
        off = CpuPlatform()
        off.activate(options | {"amx": False})
        kernels.gguf_amx(1 if kernels.amx_linear else 0)
        off.custom_ops()
        assert not kernels.gguf_amx(-1)
        assert not off.capabilities().extra["gguf batches"].startswith("AMX")
        on = CpuPlatform()
        on.activate(options | {"amx": True})
        on.custom_ops()
        assert kernels.gguf_amx(-1) == (1 if kernels.amx_linear else 0)
        assert on.capabilities().extra["gguf batches"].startswith("AMX") == bool(kernels.amx_linear)
    finally:
        kernels.gguf_amx(1 if kernels.amx_linear else 0)
