"""The one-row AWQ GEMV on the warp MMA over a Marlin-style copy of the weight (``podium_cuda.awq_mma_gemv``).

Anywhere: the contract's AWQ_MMA words (``awq_to_mma``), taken apart by the kernel's masks and placed by the PTX ISA's fragment
layout of ``mma.m16n8k16`` (A: lane l = 4 g + q holds row g at k slots 2q, 2q + 1 in a0, row g + 8
in a1, slots 2q + 8, 2q + 9 in a2 / a3; B: b0 slots 2q, 2q + 1, b1 2q + 8, 2q + 9), with x read at the
kernel's offsets and each group's chain started from the zero term, multiply to the contract's
dequantized weight in float64. On an NVIDIA GPU, or under Triton's interpreter with the MMAs emulated
(``_emulated``, the small shapes): the kernel against the same reference, N over several tiles, K over
one and several slices, group sizes 64-256, a bias, each prologue, x of every magnitude (the f16
scaling), each warp / split setting; ``convert_model`` turning a model's AWQ layers into AWQ_MMA in place."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from podium_plugin_api.int4 import AWQ, AWQ_MMA, awq_to_mma, dequantize, random_packed


def _f16_halves(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """32-bit values (int64) -> the f16 pair they hold, as float64 (low half, high half)."""
    halves = np.stack([(bits & 0xFFFF).numpy(), (bits >> 16 & 0xFFFF).numpy()]).astype(np.uint16)
    values = torch.from_numpy(halves.view(np.float16).astype(np.float64))
    return values[0], values[1]


def _emulate(words: torch.Tensor, h: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
             n: int) -> torch.Tensor:
    """What awq_mma_gemv_kernel computes (before ``up``), in float64, MMA by MMA from the PTX fragment layout."""
    tiles, steps = words.shape[0], words.shape[1]
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifted = w >> 8
    magic = 0x64006400
    regs = [(w & 0x000F000F) | magic, (w & 0x00F000F0) | magic, (shifted & 0x000F000F) | magic,
            (shifted & 0x00F000F0) | magic]  # a0..a3, each [T, S, 32 lanes, 4 MMAs]
    a = torch.zeros(tiles, steps, 4, 16, 16, dtype=torch.float64)  # [t, s, u, row, slot]
    b = torch.zeros(steps, 4, 16, dtype=torch.float64)  # [s, u, slot]: x in every column of B
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for reg, (row, slot) in enumerate([(g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8)]):
            lo, hi = _f16_halves(regs[reg][:, :, lane, :])
            a[:, :, :, row, slot], a[:, :, :, row, slot + 1] = lo, hi
        for s in range(steps):  # the lane's x: f16 64 s + 16 q .. + 16, words 2u and 2u + 1 for MMA u
            for u in range(4):
                k0 = 64 * s + 16 * q + 4 * u
                b[s, u, 2 * q], b[s, u, 2 * q + 1] = h[k0], h[k0 + 1]
                b[s, u, 2 * q + 8], b[s, u, 2 * q + 9] = h[k0 + 2], h[k0 + 3]
    d = torch.einsum("tsurk,suk->tsr", a, b)  # [t, s, 16 rows]
    per_group = group // 64
    features = torch.arange(tiles * 16).reshape(tiles, 16)
    shifts = torch.tensor([4 * (0, 2, 4, 6, 1, 3, 5, 7).index(c) for c in range(8)])
    total = torch.zeros(tiles, 16, dtype=torch.float64)
    sixteen = torch.tensor([1.0] * 8 + [16.0] * 8, dtype=torch.float64)
    for gi in range(steps // per_group):
        x_sum = h[gi * group:(gi + 1) * group].sum()
        zero = ((qzeros[gi, features // 8].to(torch.int64) >> shifts[features % 8]) & 15).double()
        acc = -(1024 + sixteen * zero) * x_sum + d[:, gi * per_group:(gi + 1) * per_group].sum(1)
        total += acc * scales[gi, features].double() / sixteen
    return total.reshape(-1)[:n]


@pytest.mark.parametrize("k,n,group", [(256, 48, 128), (128, 16, 64), (512, 32, 256)])
def test_the_mma_words_through_the_fragment_layout_give_the_weight(k, n, group):
    gen = torch.Generator().manual_seed(k + n)
    packed = random_packed(AWQ, k, n, group, False, gen)
    words = awq_to_mma(packed["qweight"])
    assert words.shape == (n // 16, k // 64, 32, 4) and words.dtype == torch.int32
    h = torch.randn(k, generator=gen).half().double()
    w = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], None, group, AWQ).double()
    got = _emulate(words, h, packed["qzeros"], packed["scales"], group, n)
    want = h @ w  # (dequantize's weight is float32: ~1e-7 of its products; a misplaced nibble is ~1)
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * want.abs().max().item()), (got - want).abs().max()


def test_config_gives_every_warp_whole_groups():
    from podium_cuda.awq_mma_gemv import config
    from podium_cuda.tuning import CUDA_TUNING

    for n, k, group in [(4096, 4096, 128), (28672, 4096, 128), (4096, 14336, 128), (6144, 4096, 64), (48, 384, 128)]:
        for programs, warps_wanted, chunk_wanted in itertools.product((0, 2, 8, 64), (1, 4, 8), (1, 2, 4, 3)):
            tuning = dataclasses.replace(CUDA_TUNING, int4_mma_programs=programs, int4_mma_warps=warps_wanted,
                                         int4_mma_groups=chunk_wanted)
            warps, splits, chunk = config(n, k, group, 132, tuning)
            assert (k // group) % (warps * splits * chunk) == 0 and 1 <= warps <= warps_wanted
            assert splits == 1 or n // 16 * splits <= max(1, programs) * 132 + n // 16
            assert chunk & (chunk - 1) == 0 and 1 <= chunk <= 1 << (chunk_wanted - 1).bit_length() and chunk * group <= 256


@pytest.mark.cuda
@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 1.0, 3e4, 0.0])
@pytest.mark.parametrize("prologue", ["plain", "silu_and_mul"])
def test_prepare_puts_every_row_in_f16s_top_binade(magnitude, prologue, kernel_device):
    """The launch before the GEMV, a program a row: h = prologue(x) times a power of two that puts the row's
    max |h| in [2^14, 2^15) (tiny rows scaled up, bf16 rows past f16's range down), exactly undone by its
    ``up``; the groups' sums of h. Three rows of magnitudes 1e6 apart: each row its own power."""
    from podium_cuda import awq_mma_gemv, fused_ops
    from podium_cuda.prologue import PLAIN, SILU

    k = 384
    x = torch.randn(3, 2 * k if prologue == "silu_and_mul" else k, generator=torch.Generator().manual_seed(3))
    x = (x * torch.tensor([[magnitude], [magnitude * 1e-3], [magnitude * 1e3]])).clamp(-3e38, 3e38)
    x = x.to(torch.float32 if kernel_device == "cpu" else torch.bfloat16).to(kernel_device)
    h, sums, up = awq_mma_gemv.prepare(x, k, 128, SILU if prologue == "silu_and_mul" else PLAIN, None, None, 0.0,
                                       None, False)
    assert h.shape == (3, k) and sums.shape == (3, 3) and up.shape == (3,)
    want = (fused_ops.silu_and_mul(x) if prologue == "silu_and_mul" else x).float()
    for row in range(3):
        top = h[row].float().abs().max().item()
        assert top == 0.0 if magnitude == 0 or not want[row].abs().max() else 2 ** 14 <= top < 2 ** 15
        back = h[row].float() * up[row]
        assert ((back - want[row]).abs().max() <= 2 ** -11 * want[row].abs().max()).item()  # f16's rounding
        groups = h[row].double().reshape(3, 128)  # float32 sums in some order: within 2^-20 of the sum of |h|
        assert ((sums[row].double() - groups.sum(1)).abs() <= 2 ** -20 * groups.abs().sum(1)).all()
        assert up[row].item() > 0 and (up[row].item() == 2.0 ** round(torch.log2(up[row]).item()))


def _tuning(**changes):
    from podium_cuda.tuning import CUDA_TUNING

    return dataclasses.replace(CUDA_TUNING, **changes)


@pytest.fixture
def sm80():
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None) \
            or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs an NVIDIA GPU of compute capability 8.0 or newer")
    return torch.device("cuda")


SETTINGS = {"default": {}, "8-warps": {"int4_mma_warps": 8}, "1-warp-many-splits": {"int4_mma_warps": 1, "int4_mma_programs": 64},
            "one-split": {"int4_mma_programs": 0},
            "groups-at-once": {"int4_mma_warps": 2, "int4_mma_groups": 4},  # 2-4 groups a warp's loads
            "bulk-prefetch-capped": {"int4_mma_prefetch": True, "int4_mma_maxnreg": 64, "int4_mma_programs": 8},
            "bulk-prefetch-not-ahead": {"int4_mma_prefetch": True, "int4_mma_ahead": False}}


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prologue", ["plain", "rms_norm", "add_rms_norm", "silu_and_mul"])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 3e4])  # x scaled into f16's range: up (its subnormals), down
@pytest.mark.parametrize("k,n,group", [(512, 48, 128), (4096, 4096, 128), (1536, 272, 64), (1024, 64, 256)])
def test_awq_mma_gemv(rows, setting, dtype, prologue, magnitude, k, n, group, kernel_device, check_dtype):
    """On the GPU the PTX; under Triton's interpreter (the CPU) the same kernel with the MMAs emulated by the
    fragment layout in plain Triton (``_emulated``): every offset, the groups' loop, the zero and scale terms,
    the splits and the prologue launch as on the device, one x row a column of B (rows of different
    magnitudes: each its own f16 scaling). The interpreter takes the small shapes only."""
    check_dtype(dtype)
    if kernel_device == "cpu" and (k * n > 1 << 20 or (rows > 1 and setting not in ("default", "1-warp-many-splits", "groups-at-once"))):
        pytest.skip("the interpreter takes the small shapes")
    sm80 = torch.device(kernel_device)
    from podium_cuda import fused_ops
    from podium_cuda.int4_gemv import ADD_RMSNORM, PLAIN, RMSNORM, SILU, int4_gemv
    from podium_cuda.split_k import counters

    if dtype == torch.float16 and magnitude > 1e4:
        pytest.skip("float16 rows cannot hold inputs of this size (f16's range is the point for bf16 rows)")
    gen = torch.Generator().manual_seed(k + n + group)
    packed = random_packed(AWQ, k, n, group, False, gen)
    w = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], None, group, AWQ).double()
    on = {name: t.to(sm80) for name, t in packed.items()}
    width = 2 * k if prologue == "silu_and_mul" else k
    spread = torch.tensor([[1.0], [0.25], [2.0], [0.5]]).repeat(2, 1)[:rows]  # each row its own scale back
    x = (torch.randn(rows, width, generator=gen) * magnitude * spread).to(dtype).to(sm80)
    residual = (torch.randn(rows, k, generator=gen) * magnitude).to(dtype).to(sm80)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(sm80)
    bias = (torch.randn(n, generator=gen) * magnitude).to(dtype).to(sm80) if n % 32 == 0 else None
    code = {"plain": PLAIN, "rms_norm": RMSNORM, "add_rms_norm": ADD_RMSNORM, "silu_and_mul": SILU}[prologue]
    out, summed = int4_gemv(x, awq_to_mma(on["qweight"]), on["qzeros"], on["scales"], group, AWQ_MMA, bias, code,
                            residual, g, 1e-5, _tuning(**SETTINGS[setting]))
    if prologue == "rms_norm":
        separate = fused_ops.rms_norm(x, g, 1e-5)
    elif prologue == "add_rms_norm":
        separate, want_sum = fused_ops.fused_add_rms_norm(x, residual, g, 1e-5)
        assert torch.equal(summed, want_sum)
    else:
        separate = fused_ops.silu_and_mul(x) if prologue == "silu_and_mul" else x
    want = separate.double().cpu() @ w + (0 if bias is None else bias.double().cpu())
    if not torch.isfinite(want).all():
        pytest.skip("the reference itself overflows at this magnitude")
    # the output's rounding (x's f16 rounding is below it); float16 outputs of tiny rows are subnormal, where
    # the rounding is absolute: up to half of 2^-24
    bound = 1e-2 if dtype == torch.bfloat16 else 2e-3
    floor = 2.0 ** -25 if dtype == torch.float16 else 0.0
    err = (out.double().cpu() - want).abs().amax(1)  # each row against its own largest output
    top = want.abs().amax(1)
    assert (err <= bound * top + floor).all(), \
        f"mma {prologue} {k} -> {n} g{group} {dtype} {setting}: max errors {err.tolist()} of {top.tolist()}"
    assert int(counters(sm80, 1).abs().sum()) == 0, "a split count was left nonzero"


class _Layer(torch.nn.Module):
    """What convert_model reads of a layer: the contract's packed tensors, ``format``, ``group_size``."""

    def __init__(self, k: int, n: int, group: int, fmt: str, device, gen: torch.Generator) -> None:
        super().__init__()
        packed = random_packed(fmt, k, n, group, False, gen)
        for name, t in packed.items():
            setattr(self, name, torch.nn.Parameter(t.to(device), requires_grad=False))
        self.format, self.group_size = fmt, group

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.qweight.cpu(), self.qzeros.cpu(), self.scales.cpu(), None, self.group_size, self.format)


@pytest.mark.cuda
def test_convert_model_turns_awq_layers_into_awq_mma_in_place(kernel_device):
    """The AWQ layers that fit become AWQ_MMA (the same bytes, the same dequantized weight; converted a slice of
    columns at a time), the others stay; the converted layer's one and five rows (the MMA GEMV) and twelve
    (int4.py's GEMM over the MMA layout) equal the reference."""
    from podium_cuda import awq_mma_gemv

    gen = torch.Generator().manual_seed(7)
    model = torch.nn.ModuleDict({"fits": _Layer(256, 80, 128, AWQ, kernel_device, gen),
                                 "groups_of_32": _Layer(256, 64, 32, AWQ, kernel_device, gen),
                                 "gptq": _Layer(256, 64, 128, "gptq", kernel_device, gen)})
    before = {name: (layer.dequantized(), layer.qweight.numel()) for name, layer in model.items()}
    assert awq_mma_gemv.convert_model(model, columns=32) == 1  # 80 columns: slices of 32, 32, 16
    assert [layer.format for layer in model.values()] == [AWQ_MMA, AWQ, "gptq"]
    for name, layer in model.items():
        assert torch.equal(layer.dequantized(), before[name][0]) and layer.qweight.numel() == before[name][1]
    layer = model["fits"]
    for rows in (1, 5, 12):
        x = torch.randn(rows, 256, generator=gen).to(kernel_device, torch.float16)
        got = int4_linear_on(x, layer)
        want = x.double().cpu() @ before["fits"][0].double()
        assert (got.double().cpu() - want).abs().max().item() <= 3e-3 * want.abs().max().item(), rows


@pytest.mark.cuda
def test_awq_mma_gemv_refuses_more_rows_than_b_has_columns(kernel_device):
    from podium_cuda.int4_gemv import int4_gemv

    packed = {name: t.to(kernel_device) for name, t in random_packed(AWQ, 128, 16, 64).items()}
    x = torch.randn(9, 128).to(kernel_device, torch.float16)
    with pytest.raises(ValueError, match="1 to 8 rows, not 9"):
        int4_gemv(x, awq_to_mma(packed["qweight"]), packed["qzeros"], packed["scales"], 64, AWQ_MMA)


def int4_linear_on(x: torch.Tensor, layer: _Layer) -> torch.Tensor:
    from podium_cuda.int4 import int4_linear as kernel

    return kernel(x, layer.qweight, layer.qzeros, layer.scales, None, layer.group_size, layer.format)
