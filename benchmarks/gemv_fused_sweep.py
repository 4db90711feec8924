"""Can a Triton GEMV for 1-4 rows, with the elementwise op before it fused into its prologue, beat
"separate elementwise kernel + cuBLAS" at batch-1 decode shapes (Llama-3.2-1B, Llama-3.1-8B)?

    python benchmarks/gemv_fused_sweep.py [--quick] [--smoke] [--out F]

Variants: W [N, K] bf16 (nn.Linear's layout), M in {1, 2, 4} rows, fp32 accumulation, bf16 out.
    gemv              y = x @ W^T                                  baseline F.linear (cuBLAS)
    rmsnorm_gemv      y = rmsnorm(x) @ W^T                         baseline rms_norm, F.linear
    add_rmsnorm_gemv  y = rmsnorm(a + r) @ W^T, a + r stored too   baseline fused_add_rms_norm, F.linear
    silu_gemv         y = (silu(gate) * up) @ W^T, h = [gate | up] baseline silu_and_mul, F.linear
The separate kernels are podium_cuda.fused_ops' (torch versions, said so in the output, if it does
not import). The fused prologue rounds to bf16 wherever the separate kernel writes bf16.

Kernel: a program owns BLOCK_N output features and a 1/SPLIT_K slice of K; it loops over that slice
in [BLOCK_N, BLOCK_K] weight tiles and, for each row, multiplies elementwise and reduces with tl.sum
(no tl.dot, so no 16-row padding). An rmsnorm prologue recomputes the row's sum of squares in every
program (the row is K elements in L2): no global sync. SPLIT_K > 1 writes fp32 partials to a
[SPLIT_K, M, N] workspace that a second small kernel sums and casts: deterministic, and one extra
launch where atomics would need two (zeroing the buffer, then the cast).

Timing: weights must come from HBM, as in a decode step, not from the 50 MB L2. A shape gets
ceil(200 MB / weight bytes) copies of W (at least 2); one CUDA graph runs the op once per copy
(activations shared); after warm-up, 20 replays, enqueued back to back, are timed with CUDA events.
Reported: median replay time / copies (µs per op, the graph's launch gaps included, as a captured
decode step pays them) and weight bytes / that time (GB/s). Baselines are timed the same way.

Sweep: BLOCK_N x BLOCK_K x SPLIT_K x num_warps x num_stages x PREFETCH, pruned per (shape, M) to
configs that give every multiprocessor a program and ranked by a latency model (bytes in flight per
multiprocessor, dependent loop steps); gemv times the first --max-configs (24, --quick 8), each fused
variant --fused-configs (6, --quick 3) of gemv's fastest for the same shape and M. Each config is
first checked against a float32 reference; one that fails or raises is recorded with its error and
not timed. After --budget-s seconds the remaining (shape, variant, M) time one config each.
--smoke runs only the checks, at small shapes (on a CPU under TRITON_INTERPRET=1, or a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from itertools import product
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

EPS = 1e-5
MB = 1 << 20
L2_FLUSH_BYTES = 200 * MB  # the weight copies a graph cycles through: four times the H200's L2
REPLAYS = 20

PLAIN, RMSNORM, ADD_RMSNORM, SILU = 0, 1, 2, 3  # the kernel's PROLOGUE
PROLOGUES = {"gemv": PLAIN, "rmsnorm_gemv": RMSNORM, "add_rmsnorm_gemv": ADD_RMSNORM, "silu_gemv": SILU}
_PLAIN, _RMSNORM, _ADD_RMSNORM, _SILU = (tl.constexpr(v) for v in (PLAIN, RMSNORM, ADD_RMSNORM, SILU))

# the variants of each layer's GEMV: fused ones where a Llama layer has that op right before it
LAYER_VARIANTS = {
    "qkv": ("gemv", "rmsnorm_gemv", "add_rmsnorm_gemv"),
    "o": ("gemv",),
    "gate_up": ("gemv", "rmsnorm_gemv", "add_rmsnorm_gemv"),
    "down": ("gemv", "silu_gemv"),
    "lm_head": ("gemv",),
}
SHAPES = [  # (model, layer, K, N)
    ("llama-3.2-1b", "qkv", 2048, 3072), ("llama-3.2-1b", "o", 2048, 2048),
    ("llama-3.2-1b", "down", 8192, 2048), ("llama-3.2-1b", "gate_up", 2048, 16384),
    ("llama-3.2-1b", "lm_head", 2048, 128256),
    ("llama-3.1-8b", "qkv", 4096, 6144), ("llama-3.1-8b", "o", 4096, 4096),
    ("llama-3.1-8b", "down", 14336, 4096), ("llama-3.1-8b", "gate_up", 4096, 28672),
]
SMOKE_SHAPES = [("smoke", "even", 256, 96), ("smoke", "ragged", 320, 100)]  # ragged: masked tails

# The sweep's grid. num_stages made no measurable difference on the H200 (1 against 2 and 3 over
# ~150 configs; these loads feed no tl.dot, which is what Triton's pipeliner is built for), so the
# grid holds 1 and --stages adds others.
BLOCK_NS, BLOCK_KS, SPLIT_KS, WARPS = (2, 4, 8, 16, 32), (256, 512, 1024, 2048), (1, 2, 4), (2, 4, 8)
PREFETCHES = (False, True)
IN_FLIGHT_TARGET = 56 * 1024  # bytes a multiprocessor keeps requested (fitted; ~32 B/ns x ~1.7 us)


# ---------------------------------------------------------------------------------------------
# Triton kernels


@triton.jit
def _squares(x_ptr, r_ptr, sum_ptr, row, cols, ok, stride_x, K, store_sum, PROLOGUE: tl.constexpr):
    """x * x (float32) of row ``row`` at ``cols``. ADD_RMSNORM: x = a + r rounded to bf16, which the
    ``store_sum`` program also writes to residual_out."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if PROLOGUE == _ADD_RMSNORM:
        r = tl.load(r_ptr + row * stride_x + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * K + cols, x, mask=ok & store_sum)
    xf = x.to(tl.float32)
    return xf * xf


@triton.jit
def _rstd(squares, K, eps):
    return 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)


@triton.jit
def _input_chunk(x_ptr, r_ptr, g_ptr, row, rstd, cols, ok, stride_x, K, PROLOGUE: tl.constexpr):
    """Row ``row``'s GEMV input at ``cols`` [BLOCK_K], float32 of bf16 values: rounded wherever the
    separate elementwise kernel (podium_cuda.fused_ops) rounds its output."""
    base = x_ptr + row * stride_x
    if PROLOGUE == _SILU:  # x [M, 2K] = [gate | up]
        gate = tl.load(base + cols, mask=ok, other=0.0)
        up = tl.load(base + K + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        h = (silu * up.to(tl.float32)).to(gate.dtype)
    else:
        x = tl.load(base + cols, mask=ok, other=0.0)
        if PROLOGUE == _ADD_RMSNORM:
            r = tl.load(r_ptr + row * stride_x + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if PROLOGUE == _PLAIN:
            h = x
        else:
            normed = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
            gw = tl.load(g_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            h = (normed * gw).to(x.dtype)
    return h.to(tl.float32)


@triton.jit
def _store_row(out_ptr, part_ptr, acc, row, pid_k, M, N, n, n_ok, SPLIT_K: tl.constexpr):
    ok = n_ok & (row < M)
    if SPLIT_K == 1:
        tl.store(out_ptr + row * N + n, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + (pid_k * M + row) * N + n, acc, mask=ok)


@triton.jit
def _weight_tile(w_rows, k0, k_end, n_ok, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PREFETCHED: tl.constexpr):
    """W[n, k0:k0 + BLOCK_K] [BLOCK_N, BLOCK_K]; a PREFETCHED tile may lie past k_end (zeros)."""
    k = k0 + tl.arange(0, BLOCK_K)
    if EVEN and PREFETCHED:  # one predicate a tile keeps the loads 16 bytes wide
        return tl.load(w_rows + k[None, :], mask=k0 < k_end, other=0.0)
    if EVEN:
        return tl.load(w_rows + k[None, :])
    return tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < k_end)[None, :], other=0.0)


@triton.jit
def gemv_kernel(
    out_ptr, part_ptr, w_ptr, x_ptr, r_ptr, g_ptr, sum_ptr,
    M, N, K, stride_x, stride_w, k_per_split, eps,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PROLOGUE: tl.constexpr, NORM_BLOCK: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr,
):
    """out [M, N] = prologue(x) [M, K] @ W^T; W [N, K]. Grid (N / BLOCK_N, SPLIT_K); ROWS >= M is
    1, 2 or 4, one named accumulator a row (rows past M are masked). A step issues all its loads
    (weights, every row's input) before its first reduction: a load after a reduction's barrier
    starts only once the barrier is passed. PREFETCH: the next weight tile is requested before this
    one's reductions (two tiles in flight), the first before the norm prologue."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    k_start = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K: no tile straddles splits
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH:  # the first tile is requested before the norm prologue, whose reductions wait on barriers
        w_next = _weight_tile(w_rows, k_start, k_end, n_ok, BLOCK_K, EVEN, True)
    rstd0 = 1.0
    rstd1 = 1.0
    rstd2 = 1.0
    rstd3 = 1.0
    if PROLOGUE == _RMSNORM or PROLOGUE == _ADD_RMSNORM:
        first = (pid_n == 0) & (pid_k == 0)  # the one program that writes residual_out
        sq0 = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        sq1 = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        sq2 = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        sq3 = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        for c0 in range(0, K, NORM_BLOCK):
            cols = c0 + tl.arange(0, NORM_BLOCK)
            ok = cols < K
            sq0 += _squares(x_ptr, r_ptr, sum_ptr, 0, cols, ok, stride_x, K, first, PROLOGUE)
            if ROWS > 1:
                sq1 += _squares(x_ptr, r_ptr, sum_ptr, 1, cols, ok & (1 < M), stride_x, K, first, PROLOGUE)
            if ROWS > 2:
                sq2 += _squares(x_ptr, r_ptr, sum_ptr, 2, cols, ok & (2 < M), stride_x, K, first, PROLOGUE)
                sq3 += _squares(x_ptr, r_ptr, sum_ptr, 3, cols, ok & (3 < M), stride_x, K, first, PROLOGUE)
        rstd0 = _rstd(sq0, K, eps)
        if ROWS > 1:
            rstd1 = _rstd(sq1, K, eps)
        if ROWS > 2:
            rstd2 = _rstd(sq2, K, eps)
            rstd3 = _rstd(sq3, K, eps)
    acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        if PREFETCH:  # the next tile is in flight during this one's reductions
            w = w_next.to(tl.float32)  # [BLOCK_N, BLOCK_K]
            w_next = _weight_tile(w_rows, k0 + BLOCK_K, k_end, n_ok, BLOCK_K, EVEN, True)
        else:
            w = _weight_tile(w_rows, k0, k_end, n_ok, BLOCK_K, EVEN, False).to(tl.float32)
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        h0 = _input_chunk(x_ptr, r_ptr, g_ptr, 0, rstd0, k, k_ok, stride_x, K, PROLOGUE)
        h1 = h0
        h2 = h0
        h3 = h0
        if ROWS > 1:
            h1 = _input_chunk(x_ptr, r_ptr, g_ptr, 1, rstd1, k, k_ok & (1 < M), stride_x, K, PROLOGUE)
        if ROWS > 2:
            h2 = _input_chunk(x_ptr, r_ptr, g_ptr, 2, rstd2, k, k_ok & (2 < M), stride_x, K, PROLOGUE)
            h3 = _input_chunk(x_ptr, r_ptr, g_ptr, 3, rstd3, k, k_ok & (3 < M), stride_x, K, PROLOGUE)
        acc0 += tl.sum(w * h0[None, :], 1)
        if ROWS > 1:
            acc1 += tl.sum(w * h1[None, :], 1)
        if ROWS > 2:
            acc2 += tl.sum(w * h2[None, :], 1)
            acc3 += tl.sum(w * h3[None, :], 1)
    _store_row(out_ptr, part_ptr, acc0, 0, pid_k, M, N, n, n_ok, SPLIT_K)
    if ROWS > 1:
        _store_row(out_ptr, part_ptr, acc1, 1, pid_k, M, N, n, n_ok, SPLIT_K)
    if ROWS > 2:
        _store_row(out_ptr, part_ptr, acc2, 2, pid_k, M, N, n, n_ok, SPLIT_K)
        _store_row(out_ptr, part_ptr, acc3, 3, pid_k, M, N, n, n_ok, SPLIT_K)


@triton.jit
def splitk_sum_kernel(out_ptr, part_ptr, total, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out [M * N] (bf16) = the sum over SPLIT_K of the partials [SPLIT_K, M * N] (fp32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Problems, launches, references


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    prefetch: bool

    @property
    def label(self) -> str:
        pf = " pf" if self.prefetch else ""
        return f"{self.block_n}x{self.block_k} sk{self.split_k} w{self.num_warps} st{self.num_stages}{pf}"


@dataclass
class Problem:
    """One (shape, variant, M): activations shared by every weight copy."""

    model: str
    layer: str
    variant: str
    K: int
    N: int
    x: torch.Tensor  # [M, K] (a for add_rmsnorm); silu: [M, 2K] = [gate | up]
    residual: torch.Tensor | None  # [M, K], add_rmsnorm only
    norm_weight: torch.Tensor | None  # [K], the rmsnorm variants
    weights: list[torch.Tensor]  # copies of W [N, K]

    @property
    def rows(self) -> int:
        return self.x.shape[0]


def make_problem(model, layer, variant, rows, K, N, weights, device) -> Problem:
    gen = torch.Generator(device=device).manual_seed(rows * 7919 + K + N)
    width = 2 * K if variant == "silu_gemv" else K
    x = torch.randn(rows, width, generator=gen, device=device).to(torch.bfloat16)
    residual = norm_weight = None
    if variant == "add_rmsnorm_gemv":
        residual = torch.randn(rows, K, generator=gen, device=device).to(torch.bfloat16)
    if variant in ("rmsnorm_gemv", "add_rmsnorm_gemv"):
        norm_weight = (1.0 + 0.1 * torch.randn(K, generator=gen, device=device)).to(torch.bfloat16)
    return Problem(model, layer, variant, K, N, x, residual, norm_weight, weights)


def make_weights(N, K, copies, device) -> list[torch.Tensor]:
    """``copies`` separate allocations of one random W [N, K] (addresses, not values, decide L2 hits)."""
    w = (torch.randn(N, K, device=device) / math.sqrt(K)).to(torch.bfloat16)
    return [w] + [w.clone() for _ in range(copies - 1)]


def launch_fused(p: Problem, w: torch.Tensor, cfg: Config, out, partials, summed):
    """out [M, N] = prologue(p) @ w^T with ``cfg``; partials [SPLIT_K, M, N] fp32 when split.
    Returns the compiled GEMV kernel (None under the interpreter)."""
    M, K, N = p.rows, p.K, p.N
    if M > 4:
        raise ValueError(f"gemv_kernel takes at most 4 rows, got {M}")
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    even = K % (cfg.block_k * cfg.split_k) == 0 and N % cfg.block_n == 0
    r = p.residual if p.residual is not None else p.x
    g = p.norm_weight if p.norm_weight is not None else p.x
    kernel = gemv_kernel[(triton.cdiv(N, cfg.block_n), cfg.split_k)](
        out, partials if partials is not None else out, w, p.x, r, g, summed if summed is not None else out,
        M, N, K, p.x.stride(0), w.stride(0), k_per_split, EPS,
        ROWS=1 << (M - 1).bit_length(), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        PROLOGUE=PROLOGUES[p.variant], NORM_BLOCK=min(2048, triton.next_power_of_2(K)), EVEN=even,
        PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        total = M * N
        splitk_sum_kernel[(triton.cdiv(total, 1024),)](out, partials, total, SPLIT_K=cfg.split_k, BLOCK=1024,
                                                       num_warps=4)
    return kernel


def fused_call(p: Problem, cfg: Config, w: torch.Tensor):
    """A no-argument call of the fused kernel on ``w``, and its (out, residual_out) buffers."""
    out = torch.empty(p.rows, p.N, dtype=torch.bfloat16, device=w.device)
    partials = None
    if cfg.split_k > 1:
        partials = torch.empty(cfg.split_k, p.rows, p.N, dtype=torch.float32, device=w.device)
    summed = torch.empty_like(p.x) if p.variant == "add_rmsnorm_gemv" else None
    return (lambda: launch_fused(p, w, cfg, out, partials, summed)), out, summed


def torch_rms_norm(x, weight, eps):
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def torch_fused_add_rms_norm(x, residual, weight, eps):
    summed = (x.float() + residual.float()).to(x.dtype)
    return torch_rms_norm(summed, weight, eps), summed


def torch_silu_and_mul(x):
    gate, up = x.float().chunk(2, dim=-1)
    return ((gate / (1.0 + torch.exp(-gate))).to(x.dtype).float() * up).to(x.dtype)


TORCH_OPS = {"rms_norm": torch_rms_norm, "fused_add_rms_norm": torch_fused_add_rms_norm,
             "silu_and_mul": torch_silu_and_mul}


def separate_ops() -> tuple[dict, str]:
    """podium_cuda's elementwise kernels (installed, or this repo's source), else the torch ones."""
    repo = Path(__file__).resolve().parents[1]
    for extra in ([], [repo / "platforms" / "cuda" / "src", repo / "plugin_api" / "src"]):
        sys.path[:0] = [str(p) for p in extra]
        try:
            from podium_cuda import fused_ops
        except Exception as exc:  # any import failure: the torch versions still give a baseline
            error = f"{type(exc).__name__}: {exc}"
            continue
        ops = {name: getattr(fused_ops, name) for name in TORCH_OPS}
        return ops, f"podium_cuda.fused_ops ({Path(fused_ops.__file__).parent})"
    return dict(TORCH_OPS), f"torch fallback (podium_cuda did not import: {error})"


def elementwise(p: Problem, ops: dict):
    """The separate path's GEMV input h [M, K] (bf16), and residual_out for add_rmsnorm."""
    if p.variant == "rmsnorm_gemv":
        return ops["rms_norm"](p.x, p.norm_weight, EPS), None
    if p.variant == "add_rmsnorm_gemv":
        return ops["fused_add_rms_norm"](p.x, p.residual, p.norm_weight, EPS)
    if p.variant == "silu_gemv":
        return ops["silu_and_mul"](p.x), None
    return p.x, None


def reference(p: Problem):
    """float32 y [M, N] from the torch elementwise ops, and the exact residual_out (or None)."""
    h, summed = elementwise(p, TORCH_OPS)
    return h.float() @ p.weights[0].float().t(), summed


def check(out, summed, ref, ref_summed) -> str | None:
    """None when out is within bf16 rounding of the reference, else what is wrong."""
    err = (out.float() - ref).abs().max().item()
    bound = 2e-2 * ref.abs().max().item() + 1e-3
    if not err <= bound:  # also catches NaN
        return f"max abs err {err:.3g} > {bound:.3g}"
    # a + r: exact on a GPU; one bf16 unit apart allowed for the Triton interpreter, which truncates
    if ref_summed is not None and not bool(((summed.float() - ref_summed.float()).abs()
                                           <= ref_summed.float().abs() * 2**-7).all()):
        return "residual_out differs from a + r"
    return None


# ---------------------------------------------------------------------------------------------
# Configs and timing


def ranked_configs(K: int, N: int, rows: int, sms: int, stages: tuple[int, ...]) -> list[Config]:
    """Grid configs that give every multiprocessor a program, best first by a latency model: a GEMV
    this small is bound by memory latency, so what counts is the weight bytes a multiprocessor has
    requested at once (IN_FLIGHT_TARGET, or its whole share of W if smaller) and how many dependent
    round trips (loop steps) a program makes; a split costs a second launch. (Fitted to H200
    timings of these shapes: the first 24 held every measured best, the first 8 came within ~2%.)"""
    target = min(IN_FLIGHT_TARGET, 2 * N * K / sms)
    scored = []
    for bn, bk, sk, warps, st, prefetch in product(BLOCK_NS, BLOCK_KS, SPLIT_KS, WARPS, stages, PREFETCHES):
        threads = 32 * warps
        per_thread = bn * bk // threads  # weight values a thread holds per tile
        tiles = triton.cdiv(N, bn)
        if not 8 <= per_thread <= 64:  # 16-byte loads, and registers to spare
            continue
        if sk > 1 and (tiles >= 2 * sms or K < sk * bk):  # split K only where programs are few
            continue
        if tiles * sk < sms:
            continue
        steps = triton.cdiv(triton.cdiv(K, sk), bk)
        # registers a thread: the tile (bf16, twice if prefetched), its fp32 products, each row's input
        regs = 16 + per_thread * (1.0 if prefetch else 0.5) + per_thread * (1 + rows / bn)
        resident = max(1, min(triton.cdiv(tiles * sk, sms), 64 // warps, int(65536 / (regs * threads))))
        in_flight = resident * bn * bk * 2 * (2 if prefetch and steps > 1 else 1)
        score = abs(math.log2(in_flight / target)) + 0.3 * math.log2(steps) + (0.5 if sk > 1 else 0.0)
        scored.append((score, (bn, bk, sk, warps, st, prefetch)))
    return [Config(*c) for _, c in sorted(scored)]


def fused_configs(gemv_record: dict | None, ranked: list[Config], count: int) -> list[Config]:
    """``count`` of the gemv configs timed for the same shape and M: the fastest for each BLOCK_N
    first (every program repeats the norm prologue, so fewer, wider programs may win once fused),
    then the next fastest; the ranking's first if gemv timed none."""
    timed = sorted((c for c in (gemv_record or {}).get("configs", []) if "us" in c), key=lambda c: c["us"])
    configs = [Config(c["block_n"], c["block_k"], c["split_k"], c["num_warps"], c["num_stages"], c["prefetch"])
               for c in timed]
    widths = {}
    for cfg in configs:
        widths.setdefault(cfg.block_n, cfg)
    picked = list(widths.values()) + [c for c in configs if c not in widths.values()]
    return picked[:count] if picked else ranked[:count]


def graph_us(calls) -> float:
    """Median µs per call over REPLAYS replays of one CUDA graph that runs ``calls`` in order."""
    for call in calls:  # compiles, cuBLAS heuristics and allocations happen outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
    for start, end in events:  # enqueued back to back, so the GPU does not wait on the host
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = statistics.median(start.elapsed_time(end) for start, end in events)
    del graph
    return ms * 1e3 / len(calls)


def timed(calls, weight_bytes: int) -> dict:
    us = graph_us(calls)
    return {"us": round(us, 3), "gbps": round(weight_bytes / us / 1e3, 1)}


def guarded(fn) -> dict:
    """fn()'s dict, or the error it raised: one failing config must not end the run."""
    try:
        return fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


# ---------------------------------------------------------------------------------------------
# The sweep


def time_config(p: Problem, cfg: Config, ref, ref_summed, weight_bytes: int) -> dict:
    """Check ``cfg`` on the first weight copy, then time it over all of them."""
    call, out, summed = fused_call(p, cfg, p.weights[0])
    t0 = time.monotonic()
    kernel = call()  # compiles
    torch.cuda.synchronize()
    first_call_s = time.monotonic() - t0
    error = check(out, summed, ref, ref_summed)
    if error:
        return {"error": f"wrong result: {error}"}
    compiled = {"first_call_s": round(first_call_s, 3), "regs": getattr(kernel, "n_regs", None),
                "spills": getattr(kernel, "n_spills", None)}
    return {**timed([fused_call(p, cfg, w)[0] for w in p.weights], weight_bytes), **compiled}


def sweep_problem(p: Problem, configs: list[Config], ops: dict, deadline: float) -> dict:
    weight_bytes = p.weights[0].numel() * p.weights[0].element_size()
    rec = {"model": p.model, "layer": p.layer, "K": p.K, "N": p.N, "variant": p.variant, "M": p.rows,
           "copies": len(p.weights), "weight_mb": round(weight_bytes / MB, 2)}
    # separate path: the elementwise kernel then cuBLAS, per weight copy (for gemv: cuBLAS alone)
    rec["baseline"] = guarded(lambda: timed([lambda w=w: F.linear(elementwise(p, ops)[0], w) for w in p.weights],
                                            weight_bytes))
    if p.variant != "gemv":  # cuBLAS alone on the precomputed input: what the prologue must hide
        h = elementwise(p, ops)[0]
        rec["cublas"] = guarded(lambda: timed([lambda w=w: F.linear(h, w) for w in p.weights], weight_bytes))
    ref, ref_summed = reference(p)
    rec["configs"] = []
    for i, cfg in enumerate(configs):
        if i and time.monotonic() > deadline:
            rec["truncated"] = f"time budget spent: {len(configs) - i} configs not run"
            break
        result = guarded(lambda cfg=cfg: time_config(p, cfg, ref, ref_summed, weight_bytes))
        rec["configs"].append({"config": cfg.label, **asdict(cfg), **result})
    fastest = sorted((c for c in rec["configs"] if "us" in c), key=lambda c: c["us"])
    rec["best"] = fastest[0] if fastest else None
    base = rec["baseline"].get("us")
    rec["ratio"] = round(fastest[0]["us"] / base, 3) if fastest and base else None
    return rec


def run_sweep(args, sms: int, ops: dict) -> list[dict]:
    deadline = time.monotonic() + args.budget_s
    records = []
    for model, layer, K, N in SHAPES:
        if args.shapes and f"{model}.{layer}" not in args.shapes:
            continue
        copies = max(2, math.ceil(L2_FLUSH_BYTES / (2 * N * K)))
        try:
            weights = make_weights(N, K, copies, "cuda")
        except Exception as exc:  # out of memory, say: record it, go on with the next shape
            records.append({"model": model, "layer": layer, "error": f"{type(exc).__name__}: {exc}"[:400]})
            continue
        gemv_records = {}
        for variant in LAYER_VARIANTS[layer]:
            if args.variants and variant not in args.variants:
                continue
            for rows in args.rows:
                ranked = ranked_configs(K, N, rows, sms, tuple(args.stages))[: args.max_configs]
                configs = ranked if variant == "gemv" else fused_configs(gemv_records.get(rows), ranked,
                                                                         args.fused_configs)
                try:
                    p = make_problem(model, layer, variant, rows, K, N, weights, "cuda")
                    rec = sweep_problem(p, configs, ops, deadline)
                except Exception as exc:  # the reference or a buffer failed: record it, go on
                    rec = {"model": model, "layer": layer, "variant": variant, "M": rows,
                           "error": f"{type(exc).__name__}: {exc}"[:400]}
                if variant == "gemv":
                    gemv_records[rows] = rec
                records.append(rec)
                print(row_text(rec), flush=True)
        del weights, gemv_records
        torch.cuda.empty_cache()
    return records


# ---------------------------------------------------------------------------------------------
# Smoke: correctness only, small shapes, CPU under TRITON_INTERPRET=1 or a GPU

SMOKE_CONFIGS = [
    Config(16, 128, 1, 4, 1, False),
    Config(8, 64, 2, 2, 2, True),
    Config(32, 128, 4, 4, 3, True),  # K=256: the last two splits are empty and must still write zeros
    Config(4, 512, 1, 2, 1, False),  # BLOCK_K > K: one masked tile
]


def check_separate(p: Problem, ops: dict, ref, ref_summed) -> dict:
    h, summed = elementwise(p, ops)
    return {"error": check(F.linear(h, p.weights[0]), summed, ref, ref_summed)}


def check_fused(p: Problem, cfg: Config, ref, ref_summed) -> dict:
    call, out, summed = fused_call(p, cfg, p.weights[0])
    call()
    return {"error": check(out, summed, ref, ref_summed)}


def run_smoke(ops: dict, device: str) -> list[dict]:
    records = []
    for model, layer, K, N in SMOKE_SHAPES:
        weights = make_weights(N, K, 1, device)
        for variant, rows in product(PROLOGUES, (1, 2, 3)):  # 3: ROWS=4 with a masked row
            p = make_problem(model, layer, variant, rows, K, N, weights, device)
            ref, ref_summed = reference(p)
            checks = {"separate": guarded(partial(check_separate, p, ops, ref, ref_summed))}
            for cfg in SMOKE_CONFIGS:
                checks[cfg.label] = guarded(partial(check_fused, p, cfg, ref, ref_summed))
            for label, result in checks.items():
                status = "ok" if result["error"] is None else f"FAIL {result['error']}"
                print(f"smoke K={K} N={N} {variant:17s} M={rows} {label:22s} {status}", flush=True)
                records.append({"K": K, "N": N, "variant": variant, "M": rows, "config": label, **result})
    return records


# ---------------------------------------------------------------------------------------------
# Output


def row_text(rec: dict) -> str:
    if "error" in rec:  # the whole (shape, variant, M) failed
        where = f"{rec['model']:13s} {rec['layer']:8s} {rec.get('variant', ''):17s} {rec.get('M', '')}"
        return f"{where} ERROR {rec['error']}"
    best, base, cublas = rec["best"], rec["baseline"], rec.get("cublas", {})
    shown = (f"{best['config']:22s} {best['us']:8.2f} {best['gbps']:7.0f}" if best
             else f"{'(none passed)':22s} {'-':>8s} {'-':>7s}")
    base_us = f"{base['us']:8.2f}" if "us" in base else f"{'error':>8s}"
    ratio = f"{rec['ratio']:6.3f}" if rec["ratio"] else f"{'-':>6s}"
    cublas_us = f"{cublas['us']:8.2f}" if "us" in cublas else f"{'':8s}"
    failed = sum("error" in c for c in rec["configs"])
    notes = (f" {failed} failed" if failed else "") + (" truncated" if "truncated" in rec else "")
    return (f"{rec['model']:13s} {rec['layer']:8s} {rec['variant']:17s} {rec['M']:2d} {shown} {base_us} "
            f"{ratio} {cublas_us} {len(rec['configs']):3d}{notes}")


HEADER = (f"{'model':13s} {'layer':8s} {'variant':17s} {'M':>2s} {'best config':22s} {'us':>8s} {'GB/s':>7s} "
          f"{'base us':>8s} {'ratio':>6s} {'cublas':>8s} {'cfg':>3s}")


def print_table(records: list[dict]) -> None:
    print("\nbest config per (shape, variant, M); us per op in a CUDA graph over L2-cold weight copies")
    print("base us: F.linear (gemv) or the separate elementwise kernel + F.linear; ratio = us / base us"
          " (< 1: the Triton kernel wins); cublas: F.linear alone on the precomputed input")
    print(HEADER)
    for rec in records:
        print(row_text(rec))
    failures = [(rec, c) for rec in records for c in rec.get("configs", []) if "error" in c]
    for rec, c in failures[:20]:
        print(f"failed: {rec['model']} {rec['layer']} {rec['variant']} M={rec['M']} {c['config']}: {c['error']}")
    if len(failures) > 20:
        print(f"... {len(failures) - 20} more failed configs in the JSON")
    for rows in sorted({rec["M"] for rec in records if rec.get("ratio")}):
        ratios = [rec["ratio"] for rec in records if rec.get("M") == rows and rec.get("ratio")]
        print(f"M={rows}: the Triton kernel beats the baseline in {sum(r < 1 for r in ratios)} of {len(ratios)};"
              f" ratio median {statistics.median(ratios):.3f}, {min(ratios):.3f} to {max(ratios):.3f}")


def default_out() -> str:
    return os.path.join(os.environ.get("OUT") or ".", "gemv_fused_sweep.json")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 gemv and 3 fused configs a shape and M")
    parser.add_argument("--smoke", action="store_true", help="correctness only, small shapes (CPU ok)")
    parser.add_argument("--out", default=default_out(), help="JSON results (default %(default)s)")
    parser.add_argument("--max-configs", type=int, help="gemv configs a shape and M (default 24, --quick 8)")
    parser.add_argument("--fused-configs", type=int, help="fused configs a shape and M (default 6, --quick 3)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="M values (1 to 4)")
    parser.add_argument("--shapes", nargs="+", help="e.g. llama-3.2-1b.qkv (default: all)")
    parser.add_argument("--variants", nargs="+", choices=list(PROLOGUES), help="default: all")
    parser.add_argument("--stages", type=int, nargs="+", default=[1], help="num_stages values (default 1)")
    parser.add_argument("--budget-s", type=float, default=140.0,
                        help="after this many seconds each remaining (shape, variant, M) times one config")
    args = parser.parse_args()
    if args.max_configs is None:
        args.max_configs = 8 if args.quick else 24
    if args.fused_configs is None:
        args.fused_configs = 3 if args.quick else 6
    if any(not 1 <= m <= 4 for m in args.rows):
        parser.error(f"--rows takes values 1 to 4 (the kernel's accumulators), got {args.rows}")
    return args


def main() -> None:
    args = parse_args()
    start = time.monotonic()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    cuda = torch.cuda.is_available() and not interpreted
    device_name = torch.cuda.get_device_name() if cuda else ("cpu (Triton interpreter)" if interpreted else "cpu")
    print(f"device {device_name}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    ops, ops_source = separate_ops()
    print(f"separate elementwise kernels: {ops_source}", flush=True)
    result = {"device": device_name, "torch": torch.__version__, "triton": triton.__version__,
              "separate_ops": ops_source, "args": vars(args)}
    if args.smoke:
        result["smoke"] = run_smoke(ops, "cuda" if cuda else "cpu")
        failed = [r for r in result["smoke"] if r["error"] is not None]
        print(f"smoke: {len(result['smoke']) - len(failed)}/{len(result['smoke'])} checks passed", flush=True)
    elif not cuda:
        sys.exit("the sweep needs a CUDA GPU (and TRITON_INTERPRET unset); --smoke runs the checks on a CPU")
    else:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"{sms} multiprocessors; {args.max_configs} gemv / {args.fused_configs} fused configs a shape\n"
              + HEADER, flush=True)
        result["multiprocessors"] = sms
        result["records"] = run_sweep(args, sms, ops)
        print_table(result["records"])
    result["elapsed_s"] = round(time.monotonic() - start, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{result['elapsed_s']} s; results in {args.out}")
    if args.smoke and failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
