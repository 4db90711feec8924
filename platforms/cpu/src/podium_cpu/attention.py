"""CPU paged attention: each sequence's context gathered from its blocks, then one fused SDPA call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from podium_plugin_api import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from podium_plugin_api.reference import attend_one, attention_mask, gather_context


class CpuAttentionBackend(AttentionBackend):
    name = "cpu-sdpa"

    def attend(
        self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        key_cache, value_cache = self.split_cache(kv_cache)
        out = torch.empty_like(query)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_host or meta.seq_lens.tolist()
        group = layer.num_heads // layer.num_kv_heads
        for i, seq_len in enumerate(seq_lens):
            lo, hi = starts[i], starts[i + 1]
            if hi == lo:
                continue
            k = gather_context(key_cache, meta.block_tables[i], seq_len)
            v = gather_context(value_cache, meta.block_tables[i], seq_len)
            mask = attention_mask(hi - lo, seq_len, layer.sliding_window, query.device)
            q = query[lo:hi]
            if layer.soft_cap is not None:
                out[lo:hi] = attend_one(q.float(), k.float(), v.float(), mask, layer.scale, layer.soft_cap).to(q.dtype)
                continue
            # [Q, H, D] -> [H, Q, D]; SDPA broadcasts nothing over heads, so expand K/V for GQA
            k = k.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
            v = v.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=layer.scale)
            out[lo:hi] = o.transpose(0, 1)
        return out
