"""Random ragged attention batches and their reference results.

A case lists its sequences as ``(query_len, seq_len)``: ``query_len`` new tokens continuing
``seq_len - query_len`` tokens already in the cache. ``(1, n)`` is a decode, ``(n, n)`` a fresh
prefill, ``(q, n)`` with ``1 < q < n`` a prefill chunk over cached context. Block ids are a random
permutation, so no sequence's blocks are contiguous. The cached context is written through the
platform's ``write_kv`` before the step; the reference reads the same values from a cache in the
default layout that the kit fills itself, and computes in float64 on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import AttentionBackend
from ..metadata import AttentionLayerSpec, AttentionMetadata, KVCacheSpec
from ..platform import Platform
from ..reference import reference_paged_attention


@dataclass(frozen=True)
class AttentionCase:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (query_len, seq_len) per sequence
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    sliding_window: int | None = None
    soft_cap: float | None = None

    @property
    def capability(self) -> str | None:
        """The ``Capabilities`` flag this case needs, if any."""
        if self.soft_cap is not None:
            return "soft_cap"
        if self.sliding_window is not None:
            return "sliding_window"
        return None

    def layer(self) -> AttentionLayerSpec:
        return AttentionLayerSpec(
            self.num_heads, self.num_kv_heads, self.head_size, self.head_size**-0.5, self.sliding_window, self.soft_cap
        )

    def describe(self) -> str:
        kind = "MHA" if self.num_heads == self.num_kv_heads else ("MQA" if self.num_kv_heads == 1 else "GQA")
        return (
            f"{self.name}: {kind} {self.num_heads}:{self.num_kv_heads} heads, head_size {self.head_size}, "
            f"block_size {self.block_size}, sliding_window {self.sliding_window}, soft_cap {self.soft_cap}, "
            f"sequences (new tokens, context) {list(self.seqs)}"
        )


ATTENTION_CASES: tuple[AttentionCase, ...] = (
    AttentionCase("mixed-gqa", ((1, 37), (23, 23), (9, 49), (1, 16), (1, 1), (5, 21))),
    AttentionCase("decodes", ((1, 15), (1, 16), (1, 17), (1, 64), (1, 3)), block_size=32),
    AttentionCase("mha", ((17, 17), (1, 70), (12, 45)), num_heads=4, num_kv_heads=4, block_size=32),
    AttentionCase("mqa-head128", ((1, 33), (30, 30), (3, 64)), num_heads=8, num_kv_heads=1, head_size=128),
    AttentionCase("sliding-window-small", ((1, 40), (20, 20), (9, 30)), sliding_window=8),
    AttentionCase("sliding-window-over-blocks", ((1, 70), (25, 60), (1, 20)), num_heads=4, sliding_window=33),
    AttentionCase("soft-cap", ((1, 30), (12, 12), (5, 26)), num_heads=4, soft_cap=2.0),
)


@dataclass
class AttentionBatch:
    """One step of a case on the platform, plus what the reference needs (all CPU copies)."""

    case: AttentionCase
    dtype: torch.dtype
    kv_cache: torch.Tensor  # the platform's cache for one layer, in its backend's layout
    meta: AttentionMetadata  # on the platform's device
    query: torch.Tensor  # [T, H, D] on the device
    key: torch.Tensor  # [T, Hkv, D] new tokens' keys on the device
    value: torch.Tensor  # [T, Hkv, D]
    ref_key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] float64 CPU, context and new tokens
    ref_value_cache: torch.Tensor
    ref_meta: AttentionMetadata  # on the CPU

    def reference_output(self) -> torch.Tensor:
        """[T, H, D] float64: ``reference_paged_attention`` on the same numbers."""
        layer = self.case.layer()
        return reference_paged_attention(
            self.query.detach().cpu().double(),
            self.ref_key_cache,
            self.ref_value_cache,
            self.ref_meta,
            scale=layer.scale,
            sliding_window=layer.sliding_window,
            soft_cap=layer.soft_cap,
            compute_dtype=torch.float64,
        )

    def locate(self, index: tuple[int, ...]) -> str:
        """'token t (sequence i: q new over c cached, position p), head h, dim d' for an output index."""
        token = index[0]
        starts = self.ref_meta.query_start_loc.tolist()
        seq = max(i for i in range(len(starts) - 1) if starts[i] <= token)
        q, s = self.case.seqs[seq]
        position = s - q + token - starts[seq]
        rest = ", ".join(f"{name} {i}" for name, i in zip(("head", "dim"), index[1:]))
        return f"token {token} (sequence {seq}: {q} new over {s - q} cached, position {position}), {rest}"


def random_block_tables(
    seq_capacities: list[int], block_size: int, spare: int, gen: torch.Generator
) -> tuple[list[list[int]], int]:
    """Non-contiguous block tables holding each sequence's capacity; returns (tables, num_blocks)."""
    counts = [-(-n // block_size) for n in seq_capacities]
    num_blocks = sum(counts) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for count in counts:
        tables.append(order[used : used + count])
        used += count
    return tables, num_blocks


def slots_of(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def build_batch(
    platform: Platform, backend: AttentionBackend, case: AttentionCase, dtype: torch.dtype, seed: int
) -> AttentionBatch:
    """Allocate a cache, write every sequence's cached context, and lay out the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    device = platform.torch_device()
    hkv, d, bs = case.num_kv_heads, case.head_size, case.block_size
    tables, num_blocks = random_block_tables([s for _, s in case.seqs], bs, 2, gen)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=hkv, head_size=d, block_size=bs, dtype=dtype)
    kv_cache = platform.allocate_kv_cache(spec, num_blocks)[0]
    ref_k = torch.zeros(num_blocks * bs, hkv, d, dtype=torch.float64)  # flat slots, reshaped below
    ref_v = torch.zeros_like(ref_k)
    ctx_slots, new_slots = [], []
    for (q, s), table in zip(case.seqs, tables):
        ctx_slots += slots_of(table, range(0, s - q), bs)
        new_slots += slots_of(table, range(s - q, s), bs)
    # keys/values of every token, context first then new: [N, Hkv, D], rounded to dtype
    keys = torch.randn(len(ctx_slots) + len(new_slots), hkv, d, generator=gen).to(dtype)
    values = torch.randn(keys.shape, generator=gen).to(dtype)
    all_slots = torch.tensor(ctx_slots + new_slots, dtype=torch.int64)
    ref_k[all_slots], ref_v[all_slots] = keys.double(), values.double()
    n_ctx = len(ctx_slots)
    if n_ctx:
        backend.write_kv(kv_cache, keys[:n_ctx].to(device), values[:n_ctx].to(device), all_slots[:n_ctx].to(device))
    query = torch.randn(len(new_slots), case.num_heads, d, generator=gen).to(dtype)
    lengths = ([q for q, _ in case.seqs], [s for _, s in case.seqs], tables, bs)
    return AttentionBatch(
        case=case,
        dtype=dtype,
        kv_cache=kv_cache,
        meta=backend.prepare_metadata(AttentionMetadata.from_lengths(*lengths, device=device)),
        query=query.to(device),
        key=keys[n_ctx:].to(device),
        value=values[n_ctx:].to(device),
        ref_key_cache=ref_k.reshape(num_blocks, bs, hkv, d),
        ref_value_cache=ref_v.reshape(num_blocks, bs, hkv, d),
        ref_meta=AttentionMetadata.from_lengths(*lengths),
    )
