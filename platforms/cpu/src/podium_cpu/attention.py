"""CPU paged attention for the flat ragged batch.

Layout (what the native kernel reads fastest; see native/paged_attention.c)::

    kv_cache   [2, num_blocks, Hkv, block_size, D]
    key_cache   = kv_cache[0] viewed as  [num_blocks, Hkv, D, block_size]        float32: tiles transposed
                                      or [num_blocks, Hkv, D/2, block_size, 2]  2-byte dtypes: transposed,
                                                                                 dims d, d+1 paired
    value_cache = kv_cache[1]            [num_blocks, Hkv, block_size, D]

(``key_transposed = False``, IPEX's layout: the key tile is [block_size, D] like the value's.)
``token_major`` gives both as [num_blocks, block_size, Hkv, ...] views (the default layout's
indexing; paired keys end in [D/2, 2]), which write_kv / read_kv / the torch paths use.

Per layer (the step's bookkeeping is done once, in ``prepare_metadata``; see ``attention_plan``):

- with the native kernel: one call for every sequence, K/V read through the block tables, decodes
  as (token, kv head) work items and every other sequence as flash-style tiles of query tokens;
  ``forward``'s call stores the step's new K/V first (``attention_kernel``: one ctypes call and
  one OpenMP region per layer), and ``forward_rotary``'s also rotates q and k on the way (rotary.h,
  bit-identical to the rotary op).
- without it: pure decodes batched in torch (one gather for all of them, one SDPA call), every
  other sequence one SDPA call (a fresh prefill uses its own new K/V, a chunk over cached context
  gathers that sequence's blocks once).
- soft-capped layers outside the kernel: the reference math (SDPA has no soft cap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from podium_plugin_api import AttentionBackend, AttentionLayerSpec, AttentionMetadata, KVCacheSpec, RotaryInputs
from podium_plugin_api.attention import to_cache_dtype
from podium_plugin_api.reference import attend_one, attention_mask, indexable

from .attention_kernel import (
    call_kernel,
    captured_step,
    check_plan,
    checked_slots,
    kernel_inputs_fit,
    launch,
    rotary_fits,
    token_rows,
)
from .attention_plan import TILE_MIN_QUERY, Chunk, StepPlan, plan_for
from .graphs import capturing
from .native_kernels import NativeKernels


class CpuAttentionBackend(AttentionBackend):
    name = "cpu-paged"
    key_transposed = True  # key tiles stored [D, block_size]

    def __init__(self, kernels: NativeKernels | None = None, tile_min_query: int = TILE_MIN_QUERY,
                 amx: bool = True) -> None:
        self.kernels = kernels
        self.tile_min_query = tile_min_query  # EVERY_TOKEN_ALONE: the batch-invariant mode (attention_plan)
        self.amx = amx  # bf16 prefill tiles on AMX tiles where the process can use them (amx_attention.h)
        self._shapes: dict[tuple, tuple] = {}  # (layer id, strides, block size) -> (layer, the kernel's Shape)
        if kernels is not None:
            self.name = "cpu-paged-native"

    # -- cache ---------------------------------------------------------------------------------
    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        """The model's dtype, or fp8: fp8 caches take the torch paths (cast on
        store, upcast on load), not the native kernel; they halve a bf16 cache's memory."""
        return (model_dtype, torch.float8_e4m3fn, torch.float8_e5m2)

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size)

    def split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
            raise ValueError(
                f"kv_cache must be a contiguous [2, blocks, Hkv, block_size, D] tensor, got {list(kv_cache.shape)}")
        blocks, hkv, block_size, head_size = kv_cache.shape[1:]
        if not self.key_transposed:
            return kv_cache[0], kv_cache[1]
        if kv_cache.element_size() == 2 and head_size % 2 == 0:
            return kv_cache[0].view(blocks, hkv, head_size // 2, block_size, 2), kv_cache[1]
        return kv_cache[0].view(blocks, hkv, head_size, block_size), kv_cache[1]

    def token_major(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both caches as [blocks, block_size, Hkv, D] views ([..., D/2, 2] for paired keys)."""
        if key_cache.dim() == 5:
            key_rows = key_cache.permute(0, 3, 1, 2, 4)
        elif self.key_transposed:
            key_rows = key_cache.permute(0, 3, 1, 2)
        else:
            key_rows = key_cache.permute(0, 2, 1, 3)
        return key_rows, value_cache.permute(0, 2, 1, 3)

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        self._write(*self.split_cache(kv_cache), key, value, slot_mapping, None)

    def _write(self, key_cache, value_cache, key, value, slot_mapping, plan: StepPlan | None) -> None:
        if self._native_write(key_cache, value_cache, key, value, slot_mapping, plan):
            return
        key_cache, value_cache = self.token_major(key_cache, value_cache)
        slots = slot_mapping
        if slots.numel() and int(slots.min()) < 0:  # padding rows write nowhere
            keep = (slots >= 0).nonzero().flatten()
            slots, key, value = slots[keep], key[keep], value[keep]
        block_size, num_slots = key_cache.shape[1], key_cache.shape[0] * key_cache.shape[1]
        if slots.numel() and int(slots.max()) >= num_slots:
            raise ValueError(f"slot_mapping holds slot {int(slots.max())}; the cache has {num_slots} slots")
        blocks, offsets = slots // block_size, slots % block_size
        new_keys = to_cache_dtype(key, key_cache.dtype).reshape(key.shape[0], *key_cache.shape[2:])
        indexable(key_cache)[blocks, offsets] = indexable(new_keys)
        indexable(value_cache)[blocks, offsets] = indexable(to_cache_dtype(value, value_cache.dtype))

    def _native_write(self, key_cache, value_cache, key, value, slot_mapping, plan: StepPlan | None) -> bool:
        """Write through the C kernel when the inputs fit it; False: the caller writes in torch."""
        dtype = key_cache.dtype
        if not self._native_layout(key_cache) or key.dtype != dtype or value.dtype != dtype:
            return False
        blocks, hkv, block_size, head_size = value_cache.shape
        if not all(t.shape[0] == slot_mapping.shape[0] and token_rows(t, hkv, head_size) for t in (key, value)):
            return False
        slots = checked_slots(slot_mapping, blocks * block_size, plan)
        self.kernels.write_kv[dtype](key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                     key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), slots.numel(),
                                     hkv, head_size, block_size)
        return True

    def _native_layout(self, key_cache: torch.Tensor) -> bool:
        """The native kernels handle this cache: float32 transposed keys, bf16 paired keys."""
        if self.kernels is None or not self.key_transposed or key_cache.dtype not in self.kernels.paged_attention:
            return False
        return key_cache.dim() == (5 if key_cache.dtype == torch.bfloat16 else 4)

    def read_kv(self, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key_cache, value_cache = self.token_major(*self.split_cache(kv_cache))
        block_size = key_cache.shape[1]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        values = indexable(value_cache)[blocks, offsets].view(value_cache.dtype)  # [T, Hkv, D]
        return indexable(key_cache)[blocks, offsets].view(key_cache.dtype).reshape(values.shape), values

    # -- attention -----------------------------------------------------------------------------
    def forward(self, layer, query, key, value, kv_cache, meta):
        out = self._native_forward(layer, query, key, value, kv_cache, meta)
        if out is not None:
            return out
        key_cache, value_cache = self.split_cache(kv_cache)
        plan = plan_for(meta, value_cache.shape[2], self.tile_min_query)
        self._write(key_cache, value_cache, key, value, meta.slot_mapping, plan)
        return self._attend(layer, query, key_cache, value_cache, meta, plan, key, value)

    def attend(
        self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        key_cache, value_cache = self.split_cache(kv_cache)
        plan = plan_for(meta, value_cache.shape[2], self.tile_min_query)
        return self._attend(layer, query, key_cache, value_cache, meta, plan, None, None)

    def forward_rotary(self, layer, query, key, value, kv_cache, meta, rotary: RotaryInputs) -> torch.Tensor:
        """Rotation, cache write and attention in one kernel call."""
        out = self._native_forward(layer, query, key, value, kv_cache, meta, rotary)
        if out is not None:
            return out
        return super().forward_rotary(layer, query, key, value, kv_cache, meta, rotary)

    def _native_forward(self, layer, query, key, value, kv_cache, meta, rotary=None) -> torch.Tensor | None:
        """Write and attend in one kernel call; None: it does not fit.

        With ``rotary`` the kernel rotates q and k first (with a table it can read)."""
        dtype = kv_cache.dtype
        if self.kernels is None or not self.key_transposed or dtype not in self.kernels.paged_attention:
            return None
        if query.dtype != dtype or key.dtype != dtype or value.dtype != dtype:
            return None
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
            return None  # split_cache names the problem
        _, blocks, hkv, block_size, head_size = kv_cache.shape
        if dtype == torch.bfloat16 and head_size % 2:  # no (d, d+1) key pairs: the torch paths
            return None
        if not kernel_inputs_fit(layer, query, (key, value), hkv, head_size, meta.slot_mapping.shape[0]):
            return None
        base = kv_cache.data_ptr()
        caches = (base, base + kv_cache.stride(0) * kv_cache.element_size(), blocks, block_size)
        if capturing():  # a graph: the kernel reads the step's tensors in place on every replay
            step = captured_step(meta, query, block_size, True, rotary)
            return launch(self.kernels, self._shapes, layer, query, (key, value), caches, step, self.amx)
        plan = plan_for(meta, block_size, self.tile_min_query)
        if rotary is not None and (query.shape[0] != key.shape[0] or not rotary_fits(rotary, key.shape[0], head_size)):
            return None
        return call_kernel(self.kernels, self._shapes, layer, query, (key, value), caches, meta, plan, rotary,
                           self.amx)

    def _attend(self, layer, query, key_cache, value_cache, meta, plan: StepPlan, new_key, new_value) -> torch.Tensor:
        blocks, hkv, block_size, head_size = value_cache.shape
        if self._native_layout(key_cache) and query.dtype == key_cache.dtype and \
                kernel_inputs_fit(layer, query, None, hkv, head_size, 0):
            caches = (key_cache.data_ptr(), value_cache.data_ptr(), blocks, block_size)
            return call_kernel(self.kernels, self._shapes, layer, query, None, caches, meta, plan,  # checks the plan
                               amx=self.amx)
        check_plan(plan, query, blocks)
        out = torch.empty(query.shape, dtype=query.dtype)  # [T, H, D]
        if plan.decode_seqs:  # decodes
            self._torch_decode(layer, query, key_cache, value_cache, meta, plan, out)
        self._sdpa_chunks(layer, query, key_cache, value_cache, plan.chunks, new_key, new_value, out)
        return out

    def _sdpa_chunks(self, layer, query, key_cache, value_cache, seqs: list[Chunk], new_key, new_value, out) -> None:
        for seq in seqs:
            out[seq.lo:seq.hi] = self._one_sequence(layer, query, key_cache, value_cache, seq, new_key, new_value)

    def _torch_decode(self, layer, query, key_cache, value_cache, meta, plan: StepPlan, out) -> None:
        """All single-token decodes at once: one gather of their blocks, one attention call."""
        hkv, block_size, d = value_cache.shape[1:]
        rows, index, lengths, width = _decode_gather(plan, meta, block_size)
        n, group = rows.numel(), layer.num_heads // hkv
        key_rows, value_rows = self.token_major(key_cache, value_cache)
        keys = _select_blocks(key_rows, index).reshape(n, width * block_size, hkv, d)  # [n, L, Hkv, D]
        values = _select_blocks(value_rows, index).reshape(n, width * block_size, hkv, d)
        k_pos = torch.arange(width * block_size)[None, :]  # [1, L]
        visible = k_pos < lengths[:, None]  # [n, L]
        if layer.sliding_window is not None:
            visible &= k_pos > lengths[:, None] - 1 - layer.sliding_window
        # the G query heads of one kv head act as G query rows over the same keys: no GQA expansion
        q = query.index_select(0, rows).view(n, hkv, group, d)  # [n, Hkv, G, D]
        k, v = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)  # [n, Hkv, L, D]
        if layer.soft_cap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :], scale=layer.scale)
        else:
            scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.scale
            scores = layer.soft_cap * torch.tanh(scores / layer.soft_cap)
            probs = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1)
            o = torch.matmul(probs, v.float()).to(q.dtype)
        out.index_copy_(0, rows, o.reshape(n, layer.num_heads, d))

    def _one_sequence(self, layer, query, key_cache, value_cache, seq: Chunk, new_key, new_value) -> torch.Tensor:
        """[hi - lo, H, D]: one sequence's query rows over its whole context."""
        q = query[seq.lo:seq.hi]  # [Q, H, D]
        if seq.fresh and new_key is not None:
            k, v = new_key[seq.lo:seq.hi], new_value[seq.lo:seq.hi]  # [Q, Hkv, D]
            if value_cache.dtype != v.dtype:  # what the cache holds (an fp8 cache's rounding)
                k, v = to_cache_dtype(k, value_cache.dtype), to_cache_dtype(v, value_cache.dtype)
        else:
            key_rows, value_rows = self.token_major(key_cache, value_cache)
            hkv, d = value_cache.shape[1], value_cache.shape[3]
            k = _select_blocks(key_rows, seq.blocks).reshape(-1, hkv, d)[: seq.seq_len]  # [L, Hkv, D]
            v = _select_blocks(value_rows, seq.blocks).reshape(-1, hkv, d)[: seq.seq_len]
        if layer.soft_cap is not None:
            mask = attention_mask(q.shape[0], seq.seq_len, layer.sliding_window, q.device)
            return attend_one(q.float(), k.float(), v.float(), mask, layer.scale, layer.soft_cap).to(q.dtype)
        # [1, H, Q, D]: with a batch dimension torch runs its fused CPU flash attention (GQA included);
        # 3-D inputs take the unfused math path (4.5x slower for a 128-token bf16 prefill here)
        q_h, k_h, v_h = q.transpose(0, 1)[None], k.to(q.dtype).transpose(0, 1)[None], v.to(q.dtype).transpose(0, 1)[None]
        gqa = layer.num_heads != layer.num_kv_heads
        if seq.fresh and layer.sliding_window is None:
            o = F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=True, scale=layer.scale, enable_gqa=gqa)
        else:
            mask = attention_mask(q.shape[0], seq.seq_len, layer.sliding_window, q.device)
            o = F.scaled_dot_product_attention(q_h, k_h, v_h, attn_mask=mask, scale=layer.scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)


def _select_blocks(cache_rows: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache_rows.index_select(0, blocks)``; fp8 caches as bytes (older torch has no fp8 index kernels)."""
    return indexable(cache_rows).index_select(0, blocks).view(cache_rows.dtype)


def _decode_gather(plan: StepPlan, meta: AttentionMetadata, block_size: int):
    """(token rows [n], flat block index [n * W], seq lengths [n], W) of the step's decodes; cached."""
    if "decode" not in plan.cache:
        seqs = torch.tensor(plan.decode_seqs, dtype=torch.int64)
        lengths = plan.token_positions + 1  # decode: the token is the last position
        width = max(1, -(-int(lengths.max()) // block_size))
        index = meta.block_tables.index_select(0, seqs)[:, :width].long().reshape(-1)
        plan.cache["decode"] = (plan.tokens, index, lengths, width)
    return plan.cache["decode"]
