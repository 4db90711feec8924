"""Triton kernel storing new tokens' keys and values into the paged cache by slot mapping.

One program per new token copies its [Hkv, D] key and value to ``slot = block * block_size +
offset`` of the caches ([num_blocks, block_size, Hkv, D] views); slot -1 (padding) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import CUDA_TUNING, KernelTuning, next_power_of_2


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
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)  # [BLOCK_H, BLOCK_D]
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kb + offset * stride_ks + h * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vb + offset * stride_vs + h * stride_vch + d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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
