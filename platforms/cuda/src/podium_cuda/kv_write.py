"""Triton kernel storing new tokens' keys and values into the paged cache by slot mapping.

One program per new token copies its [Hkv, D] key and value to ``slot = block * block_size +
offset`` of the caches ([num_blocks, block_size, Hkv, D] views); slot -1 (padding) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_ops import _cos_sin, _rotate_heads, _store_cast
from .tuning import CUDA_TUNING, KernelTuning, next_power_of_2


@triton.jit
def _copy_heads(src_ptr, dst_ptr, stride_h, dst_stride_h,
                NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's [NUM_HEADS, HEAD_SIZE] rows from src (heads ``stride_h`` apart) to dst, cast to dst's dtype."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_SIZE)  # [BLOCK_H, BLOCK_D]
    x = tl.load(src_ptr + h * stride_h + d, mask=mask)
    tl.store(dst_ptr + h * dst_stride_h + d, _store_cast(x, dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,  # key/value [T, Hkv, D]; slots int64 [T]
    kv_block_size, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // kv_block_size
    offset = slot % kv_block_size
    _copy_heads(key_ptr + t * stride_kt, k_cache_ptr + block * stride_kb + offset * stride_ks, stride_kh, stride_kch,
                NUM_KV_HEADS, HEAD_SIZE, BLOCK_H, BLOCK_D)
    _copy_heads(value_ptr + t * stride_vt, v_cache_ptr + block * stride_vb + offset * stride_vs, stride_vh, stride_vch,
                NUM_KV_HEADS, HEAD_SIZE, BLOCK_H, BLOCK_D)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tuning: KernelTuning = CUDA_TUNING,
) -> None:
    """key/value [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at ``slot_mapping`` [T]."""
    num_tokens, num_kv_heads, head_size = key.shape
    if value.shape != key.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"write_kv: key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} disagree"
        )
    if key_cache.shape[2:] != (num_kv_heads, head_size):
        raise ValueError(f"write_kv: cache {tuple(key_cache.shape)} does not hold [*, *, {num_kv_heads}, {head_size}]")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("write_kv: caches must be contiguous in their last (head_size) dim")
    if num_tokens == 0:
        return
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key_cache.shape[1], key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_size),
        num_warps=tuning.kv_write_num_warps,
    )


@triton.jit
def rotary_write_kv_kernel(
    q_out_ptr, q_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, pos_ptr, cos_sin_ptr,
    num_heads, kv_block_size, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
    stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One token: rotated query -> q_out [T, H, D]; rotated key and the value -> the caches at its slot."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_ptr, pos, stride_c, HALF, BLOCK_HALF)
    _rotate_heads(q_ptr, q_out_ptr + t * num_heads * (2 * HALF), t, stride_qt, stride_qh, 2 * HALF,
                  num_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // kv_block_size
        offset = slot % kv_block_size
        _rotate_heads(key_ptr, k_cache_ptr + block * stride_kb + offset * stride_ks, t, stride_kt, stride_kh,
                      stride_kch, NUM_KV_HEADS, cos, sin, HALF, BLOCK_HKV, BLOCK_HALF)
        _copy_heads(value_ptr + t * stride_vt, v_cache_ptr + block * stride_vb + offset * stride_vs, stride_vh,
                    stride_vch, NUM_KV_HEADS, 2 * HALF, BLOCK_HKV, BLOCK_D)


def rotary_write_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    tuning: KernelTuning = CUDA_TUNING,
) -> torch.Tensor:
    """``rotary_embedding`` then ``write_kv`` in one pass: returns the rotated query [T, H, D]; the
    rotated key and the value go straight to the caches ([num_blocks, block_size, Hkv, D]) at
    ``slot_mapping`` (-1: skipped). Same roundings as the two ops, so the same bits."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    if key.shape != (num_tokens, num_kv_heads, head_size) or value.shape != key.shape:
        raise ValueError(f"rotary_write_kv: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} disagree")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"rotary_write_kv: positions {tuple(positions.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} must be [{num_tokens}]")
    if head_size % 2 or cos_sin_cache.shape[-1] != head_size:
        raise ValueError(f"rotary_write_kv: cos_sin_cache {tuple(cos_sin_cache.shape)} needs head_size {head_size} (even)")
    if key_cache.shape[2:] != (num_kv_heads, head_size) or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError(f"rotary_write_kv: caches {tuple(key_cache.shape)} must be [*, *, {num_kv_heads}, "
                         f"{head_size}], contiguous in the last dim")
    query = query if query.stride(2) == 1 else query.contiguous()
    key = key if key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(2) == 1 else value.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens:
        rotary_write_kv_kernel[(num_tokens,)](
            q_out, query, key, value, key_cache, value_cache, slot_mapping, positions, cache,
            num_heads, key_cache.shape[1], query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), cache.stride(0),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, HALF=head_size // 2, BLOCK_H=next_power_of_2(num_heads),
            BLOCK_HKV=next_power_of_2(num_kv_heads), BLOCK_HALF=next_power_of_2(head_size // 2),
            BLOCK_D=next_power_of_2(head_size), num_warps=tuning.elementwise_num_warps,
        )
    return q_out
