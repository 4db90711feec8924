"""``gguf_linear`` and ``gguf_embedding`` as Triton kernels over GGUF blocks kept quantized.

Layouts: ``podium_plugin_api.gguf_blocks`` (a weight is uint8 [N, row_bytes], each row its own run of
blocks). A program owns a [BLOCK_M, BLOCK_N] output tile and walks K 32 weights at a time: one
legacy block (Q8_0, Q4_0, Q4_1), or one 32-weight sub-block of a K-quant (Q4_K, Q5_K, Q6_K), whose
scale and min it decodes from the block header per output row. The [BLOCK_N, 32] tile is dequantized
in registers to float32 (the reference's arithmetic) and multiplied with ``tl.dot`` into float32
sums (float32 rows: exact float32 products; bf16/fp16 rows: the tile rounded to their dtype, on the
tensor cores); the weights are read once per M tile and never written dequantized. The embedding dequantizes
the rows its ids pick with the same tile code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from podium_plugin_api.gguf_blocks import BLOCKS, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0

from .tuning import CUDA_TUNING, KernelTuning

SUB = 32  # weights a step of K dequantizes: a legacy block or a K-quant sub-block
_Q4_0, _Q4_1, _Q8_0, _Q4_K, _Q5_K, _Q6_K = (tl.constexpr(v) for v in (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K))


@triton.jit
def _half(ptrs, ok):
    """fp16 stored little-endian at byte pointers ``ptrs`` -> float32."""
    lo = tl.load(ptrs, mask=ok, other=0).to(tl.uint16)
    hi = tl.load(ptrs + 1, mask=ok, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptrs, ok):
    return tl.load(ptrs, mask=ok, other=0).to(tl.int32)


@triton.jit
def _k_scale_min(head, j, ok):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block ``j`` (a scalar) from the 12 bytes at ``head`` [BN]."""
    if j < 4:
        sc = _byte(head + j, ok) & 63
        mn = _byte(head + j + 4, ok) & 63
    else:
        sc = (_byte(head + j + 4, ok) & 15) | ((_byte(head + j - 4, ok) >> 6) << 4)
        mn = (_byte(head + j + 4, ok) >> 4) | ((_byte(head + j, ok) >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant_tile(rows, k0, n_ok, TYPE: tl.constexpr, QK: tl.constexpr, NBYTES: tl.constexpr):
    """Weights [BN, 32] at columns k0 .. k0 + 31 of the rows starting at byte pointers ``rows`` [BN]."""
    j = tl.arange(0, 32)
    block = rows + (k0 // QK) * NBYTES  # [BN] pointers to each row's block holding k0
    ok = n_ok[:, None]
    if TYPE == _Q8_0:
        d = _half(block, n_ok)
        q = tl.load(block[:, None] + 2 + j[None, :], mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = d[:, None] * q
    elif TYPE == _Q4_0 or TYPE == _Q4_1:
        start = 2 if TYPE == _Q4_0 else 4
        byte = _byte(block[:, None] + start + (j[None, :] % 16), ok)
        q = ((byte >> ((j[None, :] // 16) * 4)) & 15).to(tl.float32)
        d = _half(block, n_ok)
        if TYPE == _Q4_0:
            w = d[:, None] * (q - 8.0)
        else:
            w = d[:, None] * q + _half(block + 2, n_ok)[:, None]
    elif TYPE == _Q4_K or TYPE == _Q5_K:
        s = (k0 % QK) // 32  # the sub-block: chunk s // 2, low nibbles for even s
        sc, mn = _k_scale_min(block + 4, s, n_ok)
        d = _half(block, n_ok) * sc
        m = _half(block + 2, n_ok) * mn
        qs = 16 if TYPE == _Q4_K else 48
        byte = _byte(block[:, None] + qs + 32 * (s // 2) + j[None, :], ok)
        q = (byte >> (4 * (s % 2))) & 15
        if TYPE == _Q5_K:
            q = q | (((_byte(block[:, None] + 16 + j[None, :], ok) >> s) & 1) << 4)
        w = d[:, None] * q.to(tl.float32) - m[:, None]
    else:  # Q6_K: weight t of the block: half t // 128, quarter (t % 128) // 32, lane t % 32
        t = (k0 % QK) + j
        h = t // 128
        quarter = (t % 128) // 32
        lane = t % 32
        low = _byte(block[:, None] + (64 * h + lane + 32 * (quarter % 2))[None, :], ok)
        low = (low >> (4 * (quarter // 2))[None, :]) & 15
        high = (_byte(block[:, None] + (128 + 32 * h + lane)[None, :], ok) >> (2 * quarter)[None, :]) & 3
        q = (low | (high << 4)) - 32
        scale = tl.load(block[:, None] + (192 + t // 16)[None, :], mask=ok, other=0).to(tl.int8, bitcast=True)
        d = _half(block + 208, n_ok)
        w = d[:, None] * scale.to(tl.float32) * q.to(tl.float32)
    return w


@triton.jit
def _gguf_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, x_stride, out_stride, row_bytes,
                        TYPE: tl.constexpr, QK: tl.constexpr, NBYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
                        FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    rows = w_ptr + n.to(tl.int64) * row_bytes  # [BN] byte pointers
    j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32):
        w = _dequant_tile(rows, k0, n_ok, TYPE, QK, NBYTES)  # [BN, 32] float32
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * x_stride + k0 + j[None, :], mask=m_ok[:, None], other=0.0)
        if FP32:  # float32 rows: exact float32 products (the reference's)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:  # bf16/fp16 rows: the tile rounded to their dtype, tensor-core products, float32 sums
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None].to(tl.int64) * out_stride + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gguf_embed_kernel(ids_ptr, w_ptr, out_ptr, K, row_bytes,
                       TYPE: tl.constexpr, QK: tl.constexpr, NBYTES: tl.constexpr):
    """One program per id: its row dequantized, 32 columns at a time."""
    row = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
    rows = w_ptr + row * row_bytes + tl.zeros((16,), dtype=tl.int64)  # the row 16 times: tl.dot-free tile
    first = tl.arange(0, 16) == 0
    j = tl.arange(0, 32)
    for k0 in range(0, K, 32):
        w = _dequant_tile(rows, k0, first, TYPE, QK, NBYTES)  # [16, 32], row 0 real
        values = tl.sum(tl.where(first[:, None], w, 0.0), axis=0)
        tl.store(out_ptr + tl.program_id(0).to(tl.int64) * K + k0 + j, values.to(out_ptr.dtype.element_ty))


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None,
                tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """x [M, K] . dequantize(weight [N, row_bytes])^T (+ bias) -> [M, N] in x's dtype. (``tuning``: the
    platform passes its table to every op; these launches take none of it.)"""
    qk, nbytes = BLOCKS[ggml_type]
    rows, columns = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m = 16 if rows <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _gguf_linear_kernel[grid](x, weight, bias if bias is not None else out, out, rows, n, columns, x.stride(0),
                              out.stride(0), weight.shape[1], TYPE=ggml_type, QK=qk, NBYTES=nbytes,
                              HAS_BIAS=bias is not None, FP32=x.dtype == torch.float32, BLOCK_M=block_m,
                              BLOCK_N=block_n)
    return out


def gguf_embedding(ids: torch.Tensor, weight: torch.Tensor, ggml_type: int, dtype: torch.dtype,
                   tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """ids int [T] -> rows of ``weight`` dequantized, [T, columns] in ``dtype``."""
    qk, nbytes = BLOCKS[ggml_type]
    flat = ids.reshape(-1).contiguous()
    columns = weight.shape[1] // nbytes * qk
    out = torch.empty((flat.shape[0], columns), dtype=dtype, device=weight.device)
    if flat.numel():
        _gguf_embed_kernel[(flat.shape[0],)](flat, weight, out, columns, weight.shape[1], TYPE=ggml_type, QK=qk,
                                             NBYTES=nbytes)
    return out.reshape(*ids.shape, columns)


GGUF_OPS = {"gguf_linear": gguf_linear, "gguf_embedding": gguf_embedding}
