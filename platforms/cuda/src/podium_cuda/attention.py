"""TritonAttentionBackend: the CUDA platform's attention (imported only when the backend is asked for).

Cache layout: the contract's default, one tensor per layer ``[2, num_blocks, block_size, Hkv, D]``
(keys, values), so ``split_cache``/``read_kv`` are inherited and the reference reads it as is.

CUDA-graph assumptions (decode capture): every per-step quantity the kernels use is read from the
metadata's device tensors (query_start_loc, seq_lens, block_tables, slot_mapping), so replaying a
graph after the runner copies new contents into those same tensors is correct. The host values
used are ``max_query_len`` (1 selects the decode launch; it must stay 1 for a captured decode
graph) and ``max_seq_len``, which only sets the decode split count: for a graph that will replay
longer contexts, capture with ``max_seq_len`` set to the longest length replays may see (e.g.
max_model_len) so long contexts get their splits; a smaller value stays correct, only slower.
Mixed steps whose batch starts with ``KernelTuning.mixed_decode_min`` or more decodes (running
sequences come first) launch the decode kernel for those rows and the prefill kernel for the
rest (``decode_prefix``), instead of one prefill launch in which each decode holds a 16-128-row
tile for its one token. The fallbacks (head sizes over ``KernelTuning.max_head_size``, dtypes
other than fp16/bf16/fp32) use the pure-torch reference, which syncs with the host and cannot be
captured.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from podium_plugin_api import AttentionBackend, AttentionLayerSpec, AttentionMetadata

try:
    from podium_plugin_api import fp8_dtypes
except ImportError:  # plugin API < 1.4 (podium-cuda runs on any 1.x): no fp8 caches
    def fp8_dtypes(flavour):
        return {}

from .fused_ops import rotary_embedding
from .kv_write import rotary_write_kv, write_kv
from .paged_attention import NewTokens, paged_attention
from .tuning import CUDA_TUNING, KernelTuning, plan_splits

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIXED_SPLIT = "triton_mixed_split"  # meta.extras key of a mixed step's DecodePrefix


class DecodePrefix(NamedTuple):
    """A mixed step whose first sequences decode: those rows take the decode launch (one program
    per sequence and KV head), the rest the prefill launch, each over its own metadata."""

    num_decodes: int  # sequences (= tokens) at the front of the batch with one new token each
    decodes: AttentionMetadata
    rest: AttentionMetadata


def decode_prefix(meta: AttentionMetadata, min_decodes: int) -> DecodePrefix | None:
    """The split of a mixed step with at least ``min_decodes`` one-token sequences at its front (the
    scheduler puts running sequences first; ``query_lens_host`` tells which decode), else None."""
    lens = meta.query_lens_host
    if min_decodes < 1 or meta.is_pure_decode or len(lens) != meta.num_seqs:
        return None
    count = next((i for i, q in enumerate(lens) if q != 1), len(lens))
    if count < min_decodes:
        return None
    seq_lens_host = meta.seq_lens_host if len(meta.seq_lens_host) == len(lens) else meta.seq_lens.tolist()
    decodes = AttentionMetadata(
        query_start_loc=meta.query_start_loc[:count + 1], seq_lens=meta.seq_lens[:count],
        block_tables=meta.block_tables[:count], slot_mapping=meta.slot_mapping[:count],
        max_query_len=1, max_seq_len=max(seq_lens_host[:count]),
        query_lens_host=lens[:count], seq_lens_host=seq_lens_host[:count])
    # the rest's tensors are copies: a view starting ``count`` rows in may lose the 16-byte alignment
    # Triton specializes pointers on, which would build new kernel variants in the middle of serving
    rest = AttentionMetadata(
        query_start_loc=meta.query_start_loc[count:] - count, seq_lens=meta.seq_lens[count:].clone(),
        block_tables=meta.block_tables[count:].clone(), slot_mapping=meta.slot_mapping[count:].clone(),
        max_query_len=max(lens[count:]), max_seq_len=max(seq_lens_host[count:]),
        query_lens_host=lens[count:], seq_lens_host=seq_lens_host[count:])
    return DecodePrefix(count, decodes, rest)


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels for the KV write and the ragged paged attention; see module docstring."""

    name = "triton"

    def __init__(self, tuning: KernelTuning = CUDA_TUNING, fp8_flavour: str | None = None) -> None:
        self.tuning = tuning
        self.fp8_flavour = fp8_flavour  # fp8 caches the kernels may hold (Capabilities.fp8); None: none

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The model's dtype, and the fp8 formats of ``fp8_flavour``: the kernels
        cast on store (round to nearest, saturating) and upcast on load, unit scale."""
        if model_dtype not in KERNEL_DTYPES:
            return (model_dtype,)
        return (model_dtype, *fp8_dtypes(self.fp8_flavour).values())

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """key/value [T, Hkv, D] into the cache at ``slot_mapping`` [T] (-1: skip)."""
        key_cache, value_cache = self.split_cache(kv_cache)
        write_kv(key, value, key_cache, value_cache, slot_mapping, self.tuning)

    def prepare_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Mixed steps that start with enough decodes: their split (``DecodePrefix``), once a step."""
        prefix = decode_prefix(meta, self.tuning.mixed_decode_min)
        if prefix is not None:
            meta.extras[MIXED_SPLIT] = prefix
        return meta

    def num_splits(self, meta: AttentionMetadata, num_kv_heads: int) -> int:
        """KV splits for this step: >1 only for pure-decode steps with few sequences and long contexts."""
        if not meta.is_pure_decode:
            return 1
        return plan_splits(meta.num_seqs, num_kv_heads, meta.max_seq_len, self.tuning.split)

    def supports(self, layer: AttentionLayerSpec, query: torch.Tensor) -> bool:
        """Whether the Triton kernel handles this layer (else the reference does)."""
        return layer.head_size <= self.tuning.max_head_size and query.dtype in KERNEL_DTYPES

    def forward_rotary(self, layer, query, key, value, kv_cache, meta, rotary):
        """Rotary, the KV write and attention. Pure-decode steps: one kernel
        (``paged_attention`` with ``NewTokens``, unless ``tuning.decode_rotary_in_attention`` is off);
        otherwise two: one pass rotates q and k, writing k and v straight into the cache
        (``rotary_write_kv``), then the paged attention.

        Fused only when the model's rotary op is this platform's own (same code, same bits) and the
        cache holds a dtype the kernels store (``kv_cache_dtypes``); otherwise the default: the
        rotary op, then ``forward``."""
        key_cache, value_cache = self.split_cache(kv_cache)
        head_size = query.shape[-1]
        own_rotary = getattr(rotary.rotate, "func", rotary.rotate) is rotary_embedding
        fusable = own_rotary and self.supports(layer, query)
        fusable = fusable and key.dtype == value.dtype == query.dtype
        fusable = fusable and key_cache.dtype in self.kv_cache_dtypes(query.dtype)
        fusable = fusable and head_size % 2 == 0 and rotary.cos_sin_cache.shape[-1] == head_size
        if not fusable:
            return super().forward_rotary(layer, query, key, value, kv_cache, meta, rotary)
        if meta.is_pure_decode and self.tuning.decode_rotary_in_attention:
            # one kernel: rotary, the new tokens' cache write and attention
            query = query if query.stride(2) == 1 else query.contiguous()
            new = NewTokens(rotary.positions, key, value, rotary.cos_sin_cache, meta.slot_mapping)
            return self._paged_attention(layer, query, key_cache, value_cache, meta, new)
        query = rotary_write_kv(rotary.positions, query, key, value, rotary.cos_sin_cache, key_cache, value_cache,
                                meta.slot_mapping, self.tuning)
        return self.attend(layer, query, kv_cache, meta)

    def attend(
        self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """query [T, H, D] -> output [T, H, D] over the paged cache (which holds the new tokens)."""
        if not self.supports(layer, query):
            return super().attend(layer, query, kv_cache, meta)
        key_cache, value_cache = self.split_cache(kv_cache)
        query = query if query.stride(2) == 1 else query.contiguous()
        return self._paged_attention(layer, query, key_cache, value_cache, meta)

    def _paged_attention(self, layer, query, key_cache, value_cache, meta, new_tokens=None) -> torch.Tensor:
        prefix = meta.extras.get(MIXED_SPLIT) if new_tokens is None else None
        if prefix is None:
            return self._launch(layer, query, key_cache, value_cache, meta, new_tokens)
        out = torch.empty_like(query)
        count = prefix.num_decodes
        # unsplit: the prefill launch beside it fills the device, and one variant (built by the startup
        # profile step, whose batch starts with decodes) serves every mixed step
        self._launch(layer, query[:count], key_cache, value_cache, prefix.decodes, out=out[:count], num_splits=1)
        self._launch(layer, query[count:], key_cache, value_cache, prefix.rest, out=out[count:])
        return out

    def _launch(self, layer, query, key_cache, value_cache, meta, new_tokens=None, out=None,
                num_splits=None) -> torch.Tensor:
        return paged_attention(
            query,
            key_cache,
            value_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale=layer.scale,
            max_query_len=meta.max_query_len,
            sliding_window=layer.sliding_window,
            soft_cap=layer.soft_cap,
            num_splits=num_splits or self.num_splits(meta, layer.num_kv_heads),
            new_tokens=new_tokens,
            out=out,
            tuning=self.tuning,
        )
