"""FP8 W8A8 (``podium_plugin_api.fp8``) as one Triton GEMM with the activations' quantization inside it.

x arrives in bf16/fp16/fp32; a program owning rows m of a [BLOCK_M, BLOCK_N] output tile first walks
those rows' K to find ``s_x = max|x| / 448`` per row (the rows are re-read from L2 by every column
program: no extra launch, which at a few rows costs more than the reads; beyond
``SCALES_INSIDE_MAX_ROWS`` one torch reduction computes them first), then walks K again in
128-wide steps quantizing each x tile to e4m3 and multiplying it with the weight's e4m3 tile on the
fp8 tensor cores into float32. Weight scales: per tensor or per channel applied once at the end
with ``s_x``; per 128 x 128 block (DeepSeek / Qwen3-FP8) applied to each K step's partial product
(BLOCK_N divides 128, so a tile's columns share a block row). The rounding to e4m3 is done in
float32 arithmetic (to nearest even, as the contract's ``.to(float8_e4m3fn)``), so the quantized
values are the reference's whatever the hardware conversion does (Triton's interpreter truncates),
and the cast that follows is exact. Every division on the way is IEEE (``div_rn``, and torch dividing by a
tensor): Triton's ``/`` is ``div.full.f32`` and CUDA torch divides by a Python number as a product with
its float32 reciprocal, either a last bit off, which moves the ``x / s_x`` that sit exactly on an
e4m3 tie (frequent: x is bf16, ``448 / amax`` often a short fraction) to one side: a whole step off,
all toward zero in one row (an H200 run of the test's 37 rows: 1.3-1.5% of the output's max).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from podium_plugin_api.fp8 import FP8_BLOCK, FP8_MAX

BLOCK_K = FP8_BLOCK
SCALES_INSIDE_MAX_ROWS = 16  # calls of more rows get their s_x from one torch reduction first


@triton.jit
def _round_e4m3(v):
    """v float32 in [-448, 448] -> the nearest e4m3 value (ties to even), as float32; a value that
    rounds to zero keeps its sign, as the conversion does (-0 is e4m3's 0x80)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # subnormals: e4m3's 2^-6
    step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    inverse = ((257 - exponent) << 23).to(tl.float32, bitcast=True)  # 1 / step, a power of two: exact products
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |v / step| <= 16 to an integer, ties even
    rounded = ((tl.abs(v) * inverse + magic) - magic) * step
    return tl.where(bits < 0, -rounded, rounded)


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, sx_ptr, b_ptr, out_ptr, M, N, K, x_stride, out_stride, scale_cols,
                     SCALES: tl.constexpr, ROW_SCALES_GIVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                     FP8_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """SCALES: 0 per tensor, 1 per channel, 2 per 128 x 128 block (``scale_cols`` blocks a row).
    ROW_SCALES_GIVEN: the rows' s_x are at sx_ptr (many rows: one reduction beats every column
    program re-reading its rows); else computed here."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_ok = m < M
    x_rows = x_ptr + m[:, None].to(tl.int64) * x_stride
    if ROW_SCALES_GIVEN:
        s_x = tl.load(sx_ptr + m, mask=m_ok, other=1.0)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_rows + k0 + kk[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        s_x = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)  # [BM], the contract's quantize_per_token
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_rows + k0 + kk[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        q = _round_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s_x[:, None]), -448.0), 448.0))
        w = tl.load(w_rows + k0 + kk[None, :])  # [BN, BK] e4m3
        if FP8_DOT:
            part = tl.dot(q.to(tl.float8e4nv), tl.trans(w), out_dtype=tl.float32)
        else:  # the same exact products in float32 (the interpreter; e4m3 values are exact there)
            part = tl.dot(q, tl.trans(w.to(tl.float32)), input_precision="ieee")
        if SCALES == 2:
            acc += part * tl.load(s_ptr + (pid_n * BLOCK_N // 128) * scale_cols + k0 // 128)
        else:
            acc += part
    if SCALES == 0:
        acc = acc * tl.load(s_ptr)
    elif SCALES == 1:
        acc = acc * tl.load(s_ptr + n)[None, :]
    acc = acc * s_x[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None].to(tl.int64) * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None])


def interpreting() -> bool:
    """Triton's CPU interpreter is on (its fp8 dot is not the device's: the kernel multiplies in float32)."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _granularity(weight: torch.Tensor, weight_scale: torch.Tensor) -> int:
    n = weight.shape[0]
    if weight_scale.numel() == 1:
        return 0
    return 1 if tuple(weight_scale.shape) == (n, 1) else 2


def block_n_for(rows: int) -> int:
    """Narrow column tiles at few rows (more programs over a small weight), 128 otherwise."""
    return 32 if rows <= 16 else 128


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel tiles this product: K in whole 128 steps, N in whole column tiles."""
    n, k = weight.shape
    return k % BLOCK_K == 0 and n % block_n_for(x.shape[0]) == 0 and weight.is_contiguous() \
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, fp8_dot: bool = True) -> torch.Tensor:
    """x [M, K] @ (weight e4m3 [N, K] scaled)^T (+ bias) -> [M, N] in x's dtype; ``takes`` must hold.
    ``fp8_dot``: multiply on fp8 tensor cores (sm89+); False multiplies the same values in float32."""
    rows, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m = 16 if rows <= 16 else 64 if rows <= 64 else 128
    block_n = block_n_for(rows)
    scale = weight_scale.float().contiguous()
    row_scales = None
    if rows > SCALES_INSIDE_MAX_ROWS:
        amax = x.abs().amax(dim=-1).float()  # the contract's quantize_per_token: divided by a tensor (IEEE)
        row_scales = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    grid = (triton.cdiv(rows, block_m), n // block_n)
    _fp8_gemm_kernel[grid](x, weight, scale, row_scales if row_scales is not None else scale,
                           bias if bias is not None else out, out, rows, n, k, x.stride(0), out.stride(0),
                           scale.shape[-1], SCALES=_granularity(weight, weight_scale),
                           ROW_SCALES_GIVEN=row_scales is not None, HAS_BIAS=bias is not None, FP8_DOT=fp8_dot,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                           num_warps=4 if block_m * block_n <= 64 * 128 else 8, num_stages=3)
    return out

