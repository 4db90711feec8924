"""TPU v4+ attention through torch_xla's Pallas ragged paged attention kernel.

The kernel (torch_xla 2.9: ``torch_xla.experimental.custom_kernel.ragged_paged_attention``)
wants keys and values interleaved along the head axis of one page tensor, so this backend's
layout is, per layer::

    kv_cache [num_blocks + 1, block_size, 2 * num_kv_heads, head_size]
              combined head 2h = key head h, 2h + 1 = value head h; block num_blocks is scratch

and its inputs are the core's metadata as they are: ``kv_lens`` = seq_lens, ``page_indices`` =
block_tables, ``cu_q_lens`` = query_start_loc (all int32), plus ``num_seqs`` [1] int32 counted on
the device (padded sequences, seq_len 0, sit at the end). Layers whose head layout the kernel
cannot tile (see ``selection.pallas_layout_supported``) use the pure-XLA math on the same cache.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from podium_plugin_api import AttentionBackend, AttentionLayerSpec, AttentionMetadata, KVCacheSpec

from .graph import StepBoundary
from .selection import pallas_layout_supported
from .xla_attention import scratch_slots, xla_paged_attention


def load_kernel() -> Callable:
    """torch_xla's ragged paged attention (imports torch_xla and, when called, JAX)."""
    return importlib.import_module("torch_xla.experimental.custom_kernel").ragged_paged_attention


def kernel_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """(kv_lens [S], page_indices [S, W], cu_q_lens [S+1], num_seqs [1]), all int32, from device tensors."""
    num_seqs = (meta.seq_lens > 0).sum().to(torch.int32).reshape(1)
    return (meta.seq_lens.to(torch.int32), meta.block_tables.to(torch.int32),
            meta.query_start_loc.to(torch.int32), num_seqs)


class PallasAttentionBackend(StepBoundary, AttentionBackend):
    name = "tpu-pallas-ragged"

    def __init__(self, kernel: Callable | None = None, sync: Callable[[], None] | None = None) -> None:
        super().__init__(sync)
        self._kernel = kernel  # injectable for tests; loaded lazily on first use otherwise

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks + 1, spec.block_size, 2 * spec.num_kv_heads, spec.head_size)

    def split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[:, :, 0::2], kv_cache[:, :, 1::2]  # [N+1, bs, Hkv, D] strided views

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store key/value [T, Hkv, D] interleaved at their slots; slot -1 lands in the scratch block."""
        blocks, block_size, combined, d = kv_cache.shape
        flat = kv_cache.view(blocks * block_size, combined, d)
        slots = scratch_slots(slot_mapping, (blocks - 1) * block_size)  # [T]
        interleaved = torch.stack((key, value), dim=2).reshape(key.shape[0], combined, d)  # [T, 2*Hkv, D]
        flat.index_copy_(0, slots, interleaved.to(flat.dtype))

    def read_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key/value [T, Hkv, D] stored at ``slot_mapping`` (real slots only)."""
        blocks, block_size, combined, d = kv_cache.shape
        rows = kv_cache.reshape(blocks * block_size, combined, d)[slot_mapping.long()]  # [T, 2*Hkv, D]
        return rows[:, 0::2], rows[:, 1::2]

    def uses_kernel(self, layer: AttentionLayerSpec, kv_cache: torch.Tensor) -> bool:
        return pallas_layout_supported(layer.num_kv_heads, layer.head_size, kv_cache.dtype)

    def attend(
        self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if not self.uses_kernel(layer, kv_cache):
            key_cache, value_cache = self.split_cache(kv_cache)
            return xla_paged_attention(query, key_cache, value_cache, meta, scale=layer.scale,
                                       sliding_window=layer.sliding_window, soft_cap=layer.soft_cap)
        if self._kernel is None:
            self._kernel = load_kernel()
        return self._kernel(query, kv_cache, *kernel_inputs(meta), sm_scale=layer.scale,
                            sliding_window=layer.sliding_window, soft_cap=layer.soft_cap)
