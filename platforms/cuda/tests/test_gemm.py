"""The decode-batch GEMM (``podium_cuda.gemm``) against a float64 reference.

Ragged M, N and K (not multiples of the tile), every schedule (whole tiles, stream-K shares of the
last wave, all stream-K), both loaders, the fused SiLU-and-mul variant, an output poisoned with NaN
(every element must be written), bit-equal repeats, and CUDA-graph replay equal to eager.
Under ``TRITON_INTERPRET=1`` the grid is 4 programs and the tiles small, so stream-K splits happen
at small shapes too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from podium_cuda.gemm import gemm, gemm_silu_mul, pair_gate_up, plan_schedule
from podium_cuda.tuning import GemmTiling

pytestmark = pytest.mark.cuda

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def small(loader: str, waves: int) -> GemmTiling:
    return GemmTiling(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2, loader=loader,
                      stream_k_waves=waves)


def dtypes(device: str) -> list:
    return [torch.float32, torch.float16] if device == "cpu" else [torch.bfloat16]  # few builds on the GPU


def inputs(M, N, K, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen, dtype=torch.float64)
    w = torch.randn(N, K, generator=gen, dtype=torch.float64) * K**-0.5
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def reference(x, w, gated):
    full = x.cpu().double() @ w.cpu().double().T
    if not gated:
        return full
    inter = w.shape[0] // 2
    return F.silu(full[:, :inter]) * full[:, inter:]


def run(x, w, gated, tiling):
    """gated: False (plain gemm), True or "halves" ([gate; up] weights), "paired" (rows interleaved)."""
    out = torch.full((x.shape[0], w.shape[0] // 2 if gated else w.shape[0]), float("nan"), dtype=x.dtype,
                     device=x.device)  # poisoned: an unwritten element stays NaN and fails the check
    if gated == "paired":
        gemm_silu_mul(x, pair_gate_up(w), tiling, out=out, paired=True)
    else:
        (gemm_silu_mul if gated else gemm)(x, w, tiling, out=out)
    return out


def assert_close(out, ref, dtype):
    assert torch.isfinite(out).all(), "output has unwritten (NaN) elements"
    err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert err < TOL[dtype], f"relative error {err:.2e} over {TOL[dtype]:.0e}"


@pytest.mark.parametrize("gated", [False, "halves", "paired"])
@pytest.mark.parametrize("loader", ["ptr", "tma"])
@pytest.mark.parametrize("waves", [0, 1, -1])
def test_small_tiles_ragged(gated, loader, waves, kernel_device):
    M, N, K = 37, 2 * 40 if gated else 72, 88  # M, N and K all off the 16 x 32 x 16 tile
    for i, dtype in enumerate(dtypes(kernel_device)):
        x, w = inputs(M, N, K, dtype, kernel_device, seed=10 * waves + i + 100 * bool(gated))
        assert_close(run(x, w, gated, small(loader, waves)), reference(x, w, gated), dtype)


@pytest.mark.parametrize("M", [1, 16, 50])
def test_row_counts(M, kernel_device):
    x, w = inputs(M, 96, 64, torch.float16, kernel_device, seed=M)
    assert_close(run(x, w, False, small("ptr", -1)), reference(x, w, False), torch.float16)


def test_repeat_is_bit_equal(kernel_device):
    """Stream-K pieces are added in program order, whoever arrives last: no run-to-run drift."""
    x, w = inputs(45, 2 * 48, 96, torch.float16, kernel_device, seed=7)
    first = run(x, w, "halves", small("ptr", -1))
    assert torch.equal(first, run(x, w, "halves", small("ptr", -1)))


@pytest.mark.parametrize("gated", [False, "halves", "paired"])
@pytest.mark.parametrize("loader", ["ptr", "tma"])
def test_decode_tiling_on_gpu(gated, loader, gpu):
    """The bench's tile shapes at a ragged decode-like shape, with stream-K over 132 programs."""
    tiling = GemmTiling(block_m=128, block_n=128 if gated == "halves" else 256, block_k=64, num_warps=8,
                        num_stages=3 if loader == "ptr" else 4, loader=loader, stream_k_waves=1)
    x, w = inputs(200, 2 * 1000 if gated else 1000, 4096, torch.bfloat16, gpu, seed=3)
    out = run(x, w, gated, tiling)
    assert_close(out, reference(x, w, gated), torch.bfloat16)
    assert torch.equal(out, run(x, w, gated, tiling))


@pytest.mark.parametrize("gated", [False, True], ids=["gemm", "silu_mul"])
def test_graph_replay_equals_eager(gated, gpu):
    tiling = GemmTiling(block_m=128, block_n=128 if gated else 256, block_k=64, num_warps=8, num_stages=4,
                        loader="tma", stream_k_waves=1)
    x, w = inputs(256, 2 * 1024 if gated else 2048, 4096, torch.bfloat16, gpu, seed=5)
    op = gemm_silu_mul if gated else gemm
    out = torch.full((256, w.shape[0] // 2 if gated else w.shape[0]), float("nan"), dtype=x.dtype, device=gpu)
    op(x, w, tiling, out=out)  # warm-up outside capture: build, scratch allocation
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(x, w, tiling, out=out)
    out.fill_(float("nan"))
    graph.replay()
    graph.replay()  # a second replay finds the stream-K counters reset by the first
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(torch.randn_like(x))  # new inputs in place: the replay computes the new product
    graph.replay()
    assert_close(out, reference(x, w, gated), torch.bfloat16)


def test_plan_schedule():
    # 224 tiles on 132 programs: one wave whole, the remaining 92 tiles' k-steps shared by all 132
    assert plan_schedule(224, 64, 132, 1) == (132, 132)
    assert plan_schedule(224, 64, 132, 0) == (132, 224)
    assert plan_schedule(224, 64, 132, -1) == (132, 0)
    assert plan_schedule(224, 64, 132, 2) == (132, 0)
    assert plan_schedule(32, 224, 132, 1) == (132, 0)  # down at M=256: 32 tiles, all stream-K
    assert plan_schedule(32, 224, 132, 0) == (32, 32)  # whole tiles: one program each
    assert plan_schedule(8, 10, 132, 1) == (8, 8)  # fewer k-steps than programs: whole tiles


def test_pair_gate_up_layout():
    w = torch.arange(12.0).view(6, 2)  # gate rows 0..2, up rows 3..5
    assert pair_gate_up(w)[:, 0].tolist() == [0.0, 6.0, 2.0, 8.0, 4.0, 10.0]


def test_rejects_bad_shapes():
    x = torch.zeros(4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="must be"):
        gemm(x, torch.zeros(16, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="even"):
        gemm_silu_mul(x, torch.zeros(15, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="share"):
        gemm(x, torch.zeros(16, 8, dtype=torch.bfloat16))
