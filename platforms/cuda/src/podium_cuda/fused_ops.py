"""Fused Triton versions of the contract's named ops (``podium_plugin_api.ops``).

Each kernel is one pass over its tensors, rounding where the reference rounds (results in the
input dtype between stages), so they match the pure-torch reference to within one rounding.
Which of them the platform installs is decided by measurement: ``KernelTuning.fused_ops``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import CUDA_TUNING, KernelTuning, next_power_of_2


def _row_warps(block: int, tuning: KernelTuning) -> int:
    """Warps for a one-row-per-program kernel: more for wide rows (about 8 values a thread)."""
    return max(tuning.elementwise_num_warps, min(block // 256, 16))


@triton.jit
def rms_norm_kernel(
    out_ptr, sum_ptr, x_ptr, residual_ptr, weight_ptr, eps, hidden,
    stride_o, stride_s, stride_x, stride_r,
    BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like torch's x + residual
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _rms_norm(x, residual, weight, eps, tuning):
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {hidden}")
    x2 = x.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
        summed = torch.empty_like(x2)
    rows = x2.shape[0]
    if rows:
        block = next_power_of_2(hidden)
        rms_norm_kernel[(rows,)](
            out, summed if summed is not None else out, x2, r2 if r2 is not None else x2, weight, float(eps), hidden,
            out.stride(0), summed.stride(0) if summed is not None else 0, x2.stride(0), r2.stride(0) if r2 is not None else 0,
            BLOCK=block, ADD_RESIDUAL=residual is not None, num_warps=_row_warps(block, tuning),
        )
    out = out.reshape(x.shape)
    return out if summed is None else (out, summed.reshape(x.shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """x [T, hidden] -> weight * x / rms(x) (see podium_plugin_api.ops.rms_norm)."""
    return _rms_norm(x, None, weight, eps, tuning)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, tuning: KernelTuning = CUDA_TUNING
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"fused_add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x")
    return _rms_norm(x, residual, weight, eps, tuning)


@triton.jit
def _store_cast(x, dtype: tl.constexpr):
    """``x`` cast to ``dtype`` for a store. fp8: saturated to the format's largest finite value
    first (what the torch definition, ``podium_plugin_api.to_cache_dtype``, stores); others: a cast."""
    if dtype == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    elif dtype == tl.float8e4b8:
        x = tl.clamp(x.to(tl.float32), -240.0, 240.0)
    elif dtype == tl.float8e5:
        x = tl.clamp(x.to(tl.float32), -57344.0, 57344.0)
    elif dtype == tl.float8e5b16:
        x = tl.clamp(x.to(tl.float32), -57344.0, 57344.0)
    return x.to(dtype)


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, stride_t, stride_h, dst_stride_h, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate-halves rotary for the [num_heads, 2 * HALF] rows of one token; ``dst_ptr`` points at
    the token's first head, heads ``dst_stride_h`` apart."""
    h = tl.arange(0, BLOCK_H)[:, None]
    c = tl.arange(0, BLOCK_HALF)[None, :]
    ok = (h < num_heads) & (c < HALF)
    src = src_ptr + token * stride_t + h * stride_h + c
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + HALF, mask=ok, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    dst = dst_ptr + h * dst_stride_h + c
    # explicit FMAs: the same bits in every kernel that rotates (paged_attention._rotate_row), where
    # the compiler's own contraction of a * cos - b * sin may differ from kernel to kernel
    # rounded to the source's dtype first, so an fp8 cache holds what the rotary op's output, cast, would be
    tl.store(dst, _store_cast(tl.fma(a, cos, -(b * sin)).to(x1.dtype), dst_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, _store_cast(tl.fma(b, cos, a * sin).to(x1.dtype), dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _cos_sin(cache_ptr, pos, stride_c, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """cos and sin [1, BLOCK_HALF] (float32) of one position from a [max_pos, 2 * HALF] cache."""
    c = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_c + c, mask=c < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rotary_kernel(
    q_out_ptr, k_out_ptr, q_ptr, k_ptr, pos_ptr, cache_ptr,
    num_heads, num_kv_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos, sin = _cos_sin(cache_ptr, pos, stride_c, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr, q_out_ptr + token * num_heads * (2 * HALF), token, stride_qt, stride_qh, 2 * HALF,
                  num_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr + token * num_kv_heads * (2 * HALF), token, stride_kt, stride_kh, 2 * HALF,
                  num_kv_heads, cos, sin, HALF, BLOCK_HKV, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    tuning: KernelTuning = CUDA_TUNING,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary: positions [T], query [T, H, D], key [T, Hkv, D], cos_sin_cache [max_pos, D]."""
    num_tokens, num_heads, head_size = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_size or positions.shape != (num_tokens,):
        raise ValueError(
            f"rotary_embedding: positions {tuple(positions.shape)}, query {tuple(query.shape)} and key "
            f"{tuple(key.shape)} disagree"
        )
    if head_size % 2 or cos_sin_cache.shape[-1] != head_size:
        raise ValueError(f"rotary_embedding: cos_sin_cache {tuple(cos_sin_cache.shape)} needs head_size {head_size} (even)")
    query = query if query.stride(2) == 1 else query.contiguous()
    key = key if key.stride(2) == 1 else key.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens:
        rotary_kernel[(num_tokens,)](
            q_out, k_out, query, key, positions, cache,
            num_heads, key.shape[1], query.stride(0), query.stride(1), key.stride(0), key.stride(1), cache.stride(0),
            HALF=head_size // 2, BLOCK_H=next_power_of_2(num_heads), BLOCK_HKV=next_power_of_2(key.shape[1]),
            BLOCK_HALF=next_power_of_2(head_size // 2), num_warps=tuning.elementwise_num_warps,
        )
    return q_out, k_out


@triton.jit
def silu_and_mul_kernel(out_ptr, x_ptr, inter, stride_o, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded like torch's silu(gate)
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_and_mul(x: torch.Tensor, tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even (gate | up), got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(next_power_of_2(inter), 1024)
    if x2.shape[0]:
        silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            out, x2, inter, out.stride(0), x2.stride(0), BLOCK=block, num_warps=tuning.elementwise_num_warps,
        )
    return out.reshape(*x.shape[:-1], inter)


NO_INDEX = 2**31 - 1  # larger than any column: "no such entry" in the argmax's min-reductions
_NO_INDEX = tl.constexpr(NO_INDEX)


@triton.jit
def _first_max(values, index, ok):
    """(value, index) of the first maximum among the ``ok`` entries, NaN counting as the maximum
    (torch.argmax's rule): the first NaN wins over every number. ``values`` float32 [BLOCK]."""
    nan = (values != values) & ok
    first_nan = tl.min(tl.where(nan, index, _NO_INDEX), 0)
    numbers = tl.where(nan | ~ok, float("-inf"), values)
    best = tl.max(numbers, 0)
    first_best = tl.min(tl.where((numbers == best) & ok, index, _NO_INDEX), 0)
    has_nan = first_nan < _NO_INDEX
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit
def argmax_chunks_kernel(val_ptr, idx_ptr, x_ptr, vocab, stride_x, num_chunks, CHUNK: tl.constexpr):
    """Pass 1: program (row, chunk) -> the first maximum of logits[row, chunk * CHUNK:][:CHUNK]."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < vocab
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    value, index = _first_max(x, cols, ok)
    tl.store(val_ptr + row * num_chunks + chunk, value)
    tl.store(idx_ptr + row * num_chunks + chunk, index)


@triton.jit
def argmax_merge_kernel(out_ptr, val_ptr, idx_ptr, num_chunks, BLOCK_C: tl.constexpr):
    """Pass 2: one program a row merges its chunks' maxima (chunks are in column order, so the
    smallest index among the tied chunk maxima is the row's first maximum)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    values = tl.load(val_ptr + row * num_chunks + c, mask=ok, other=0.0)
    index = tl.load(idx_ptr + row * num_chunks + c, mask=ok, other=_NO_INDEX)
    _, best = _first_max(values, index, ok)
    tl.store(out_ptr + row, best.to(tl.int64))


ARGMAX_CHUNK = 4096  # columns a program (8 KB of bf16): 32 programs a row for a 128k vocabulary


def argmax(logits: torch.Tensor, tuning: KernelTuning = CUDA_TUNING) -> torch.Tensor:
    """logits [B, V] -> int64 [B], the first index of each row's maximum (NaN counts as the maximum).

    torch's argmax reduces a row in one block (for a 128k row, the whole of a batch-1 step's
    sampling time); here a row is split over V / 4096 programs, then merged.
    """
    if logits.dim() != 2:
        raise ValueError(f"argmax: logits must be [rows, vocab], got {list(logits.shape)}")
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0 or vocab >= NO_INDEX:
        return logits.argmax(dim=-1)
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    chunk = min(ARGMAX_CHUNK, next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    values = torch.empty((rows, num_chunks), dtype=torch.float32, device=x.device)  # [B, C]
    index = torch.empty((rows, num_chunks), dtype=torch.int32, device=x.device)  # [B, C]
    out = torch.empty(rows, dtype=torch.int64, device=x.device)  # [B]
    argmax_chunks_kernel[(rows, num_chunks)](values, index, x, vocab, x.stride(0), num_chunks, CHUNK=chunk,
                                             num_warps=tuning.elementwise_num_warps)
    argmax_merge_kernel[(rows,)](out, values, index, num_chunks, BLOCK_C=next_power_of_2(num_chunks), num_warps=1)
    return out


FUSED_OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "argmax": argmax,
}
