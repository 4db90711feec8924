"""Paged attention through Intel Extension for PyTorch (optional; see ipex_support).

IPEX's kernels read ``[num_blocks, Hkv, block_size, D]`` key and value caches (both tiles
token-major, so ``key_transposed = False``) and do not check what they are given: a wrong shape,
dtype or stride reads or writes out of bounds. ``_check_inputs`` validates everything they
assume before every call. A step of decodes only goes through ``single_query_cached_kv_attention``
(faster: 468 us against 620 us for 32 bf16 decodes here); any other step through one
``flash_attn_varlen_func`` call for the whole ragged batch (prefill chunks and decodes);
``reshape_and_cache`` writes the new tokens. Dtypes IPEX lacks on
the CPU fall back to the torch paths of ``CpuAttentionBackend``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from podium_plugin_api import AttentionLayerSpec, AttentionMetadata

from .attention import CpuAttentionBackend

IPEX_DTYPES = (torch.float32, torch.bfloat16)
CU_KV_KEY = "podium_cpu.ipex_cu_kv"


class IpexAttentionBackend(CpuAttentionBackend):
    name = "cpu-ipex"
    key_transposed = False

    def __init__(self, ipex: ModuleType) -> None:
        super().__init__(kernels=None)
        self.ipex = ipex
        self.ops = torch.ops.torch_ipex

    def _write(self, key_cache, value_cache, key, value, slot_mapping, plan) -> None:
        """IPEX's ``reshape_and_cache`` where it applies; ``forward`` and ``write_kv`` both come here."""
        dtype = key_cache.dtype
        if dtype not in IPEX_DTYPES or key.dtype != dtype or value.dtype != dtype:
            return super()._write(key_cache, value_cache, key, value, slot_mapping, plan)
        blocks, hkv, block_size, head_size = value_cache.shape
        if key.shape != value.shape or key.shape != (slot_mapping.shape[0], hkv, head_size):
            raise ValueError(f"key/value must be [{slot_mapping.shape[0]}, {hkv}, {head_size}], got "
                             f"{list(key.shape)} / {list(value.shape)}")
        slots = slot_mapping
        if slots.numel() and int(slots.min()) < 0:  # padding rows write nowhere
            keep = (slots >= 0).nonzero().flatten()
            slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() and int(slots.max()) >= blocks * block_size:
            raise ValueError(f"slot_mapping holds slot {int(slots.max())}; the cache has {blocks * block_size} slots")
        if slots.numel():
            self.ops.reshape_and_cache(key.contiguous(), value.contiguous(), key_cache, value_cache,
                                       slots.to(torch.int32).contiguous(), "auto", 1.0, 1.0)

    def _attend(self, layer, query, key_cache, value_cache, meta, plan, new_key, new_value) -> torch.Tensor:
        if query.dtype not in IPEX_DTYPES or key_cache.dtype != query.dtype:
            return super()._attend(layer, query, key_cache, value_cache, meta, plan, new_key, new_value)
        if plan.max_block >= value_cache.shape[0]:
            raise ValueError(f"block_tables use block {plan.max_block}; the cache has {value_cache.shape[0]} blocks")
        query = query.contiguous()
        out = torch.empty_like(query)  # [T, H, D]
        tables = meta.block_tables.to(torch.int32).contiguous()
        cu_q = meta.query_start_loc.to(torch.int32).contiguous()
        cu_kv = _cumulative_kv(meta)
        _check_inputs(layer, query, key_cache, value_cache, out, tables, cu_q, cu_kv)
        window = layer.sliding_window
        soft_cap = float(layer.soft_cap) if layer.soft_cap is not None else -1.0
        max_kv = max(plan.seq_lens, default=0)
        if plan.query_lens and max(plan.query_lens) == 1 and min(plan.query_lens) == 1:
            seq_lens = meta.seq_lens.to(torch.int32).contiguous()  # [S]: one query row per sequence
            self.ops.single_query_cached_kv_attention(
                out, query, key_cache, value_cache, _head_mapping(layer), float(layer.scale), tables, seq_lens,
                value_cache.shape[2], max_kv, None, window if window is not None else -1, 1.0, 1.0, soft_cap,
            )
            return out
        self.ops.flash_attn_varlen_func(
            out, query, key_cache, value_cache, cu_q, cu_kv, max(plan.query_lens, default=0), max_kv,
            float(layer.scale), True, tables, None, window - 1 if window is not None else -1, -1, "auto", 1.0, 1.0,
            soft_cap,
        )
        return out


_HEAD_MAPPINGS: dict[tuple[int, int], torch.Tensor] = {}


def _head_mapping(layer: AttentionLayerSpec) -> torch.Tensor:
    """int32 [H]: the kv head of each query head (GQA groups are consecutive)."""
    key = (layer.num_heads, layer.num_kv_heads)
    if key not in _HEAD_MAPPINGS:
        group = layer.num_heads // layer.num_kv_heads
        _HEAD_MAPPINGS[key] = torch.arange(layer.num_kv_heads, dtype=torch.int32).repeat_interleave(group)
    return _HEAD_MAPPINGS[key]


def _cumulative_kv(meta: AttentionMetadata) -> torch.Tensor:
    """int32 [S + 1]: cumulative context lengths; once per step (kept in ``meta.extras``)."""
    cached = meta.extras.get(CU_KV_KEY)
    if cached is not None and cached[0] is meta.seq_lens and cached[1] == meta.seq_lens_host and cached[1]:
        return cached[2]
    cu = torch.zeros(meta.seq_lens.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(meta.seq_lens.to(torch.int32), dim=0, out=cu[1:])
    meta.extras[CU_KV_KEY] = (meta.seq_lens, list(meta.seq_lens_host), cu)
    return cu


def _check_inputs(layer: AttentionLayerSpec, query, key_cache, value_cache, out, tables, cu_q, cu_kv) -> None:
    """Everything IPEX's kernels assume; they check none of it."""
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    if query.dim() != 3 or query.shape[1:] != (h, d) or not query.is_contiguous():
        raise ValueError(f"query must be a contiguous [T, {h}, {d}] tensor, got {list(query.shape)}")
    blocks, block_size = value_cache.shape[0], value_cache.shape[2]
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.shape != (blocks, hkv, block_size, d) or not cache.is_contiguous() or cache.dtype != query.dtype:
            raise ValueError(f"{name} must be a contiguous [{blocks}, {hkv}, {block_size}, {d}] {query.dtype} "
                             f"tensor, got {list(cache.shape)} {cache.dtype}")
    if out.shape != query.shape or not out.is_contiguous() or out.dtype != query.dtype:
        raise ValueError("out must be a contiguous tensor shaped and typed like query")
    num_seqs = tables.shape[0]
    if tables.dim() != 2 or cu_q.shape != (num_seqs + 1,) or cu_kv.shape != (num_seqs + 1,):
        raise ValueError(f"block_tables [{num_seqs}, W] needs query_start_loc and cumulative lengths of {num_seqs + 1}")
    if int(cu_q[-1]) != query.shape[0]:
        raise ValueError(f"query_start_loc ends at {int(cu_q[-1])}; query has {query.shape[0]} rows")
