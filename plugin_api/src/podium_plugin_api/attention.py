"""The attention backend a platform supplies.

A backend owns the KV-cache layout of its platform: it says what shape one layer's cache has,
writes new keys/values into it by slot mapping, reads them back (for tests and tools), and
computes attention for a flat ragged batch (see ``metadata``). The defaults below use the
default layout and the pure-torch reference, so a new platform is correct before it is fast.

Default layout, one tensor per layer::

    kv_cache[0] = key_cache    [num_blocks, block_size, num_kv_heads, head_size]
    kv_cache[1] = value_cache  [num_blocks, block_size, num_kv_heads, head_size]
"""

from __future__ import annotations

import torch

from .metadata import AttentionLayerSpec, AttentionMetadata, KVCacheSpec, RotaryInputs
from .reference import indexable, reference_paged_attention


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: a cast (round to nearest even); into an 8-bit float
    format, saturated to its largest finite value first (e5m2 would otherwise overflow to infinity,
    which poisons attention). The definition every backend's fp8 store is tested against."""
    if dtype.is_floating_point and torch.finfo(dtype).bits == 8 and x.dtype != dtype:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


class AttentionBackend:
    """Base class; override any method. Methods are called by the core's model runner."""

    name: str = "torch-reference"

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The dtypes this backend's cache may hold for a model running in ``model_dtype``.

        The engine allocates the cache in the one the user asks for (``kv_cache_dtype``; "auto" is
        ``model_dtype``) and refuses any other with an error listing these. A backend that lists a
        dtype other than the model's stores keys and values as ``to_cache_dtype`` casts them (round to
        nearest, fp8 saturating; unit scale) and upcasts what it reads. The default: the model's dtype.
        """
        return (model_dtype,)

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's KV-cache tensor holding ``num_blocks`` blocks."""
        return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)

    def split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) views of one layer's cache in this backend's layout."""
        return kv_cache[0], kv_cache[1]

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store new tokens' key/value [T, num_kv_heads, head_size] at their slots (-1: skip)."""
        key_cache, value_cache = self.split_cache(kv_cache)
        block_size = key_cache.shape[1]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        blocks, offsets = slots // block_size, slots % block_size
        indexable(key_cache)[blocks, offsets] = indexable(to_cache_dtype(key[keep], key_cache.dtype))
        indexable(value_cache)[blocks, offsets] = indexable(to_cache_dtype(value[keep], value_cache.dtype))

    def read_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key/value stored at ``slot_mapping``: two [T, num_kv_heads, head_size] tensors."""
        key_cache, value_cache = self.split_cache(kv_cache)
        block_size = key_cache.shape[1]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        return (indexable(key_cache)[blocks, offsets].view(key_cache.dtype),
                indexable(value_cache)[blocks, offsets].view(value_cache.dtype))

    def prepare_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Called once per step before the layers run; may add backend data to ``meta.extras``."""
        return meta

    def attend(
        self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention output [T, num_heads, head_size] for ``query`` [T, num_heads, head_size]."""
        key_cache, value_cache = self.split_cache(kv_cache)
        return reference_paged_attention(
            query,
            key_cache,
            value_cache,
            meta,
            scale=layer.scale,
            sliding_window=layer.sliding_window,
            soft_cap=layer.soft_cap,
        )

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One attention layer of one step: write the new K/V, then attend. Called by the model."""
        self.write_kv(kv_cache, key, value, meta.slot_mapping)
        return self.attend(layer, query, kv_cache, meta)

    def forward_rotary(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rotary: RotaryInputs,
    ) -> torch.Tensor:
        """``forward`` of query and key rotated by ``rotary``. Called by the model.

        The default rotates through ``rotary.rotate`` and calls ``forward``; a backend may instead
        rotate inside its cache write and attention (one pass, no rotated copies), with the same result.
        """
        query, key = rotary.rotate(rotary.positions, query, key, rotary.cos_sin_cache)
        return self.forward(layer, query, key, value, kv_cache, meta)
