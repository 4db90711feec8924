"""Plain data passed between the core and a platform's attention backend.

The flat ragged batch
---------------------
One model step processes ``T`` new tokens belonging to ``S`` sequences, laid end to end::

    tokens:      [ seq0 chunk (q0 tokens) | seq1 decode (1) | seq2 chunk (q2) | ... ]   T in all
    query_start_loc = [0, q0, q0+1, q0+1+q2, ...]                                      S + 1 entries

Sequence ``i`` has ``seq_lens[i]`` tokens of context *including* its new ones, so its new tokens
sit at positions ``seq_lens[i] - q_i ... seq_lens[i] - 1`` and each attends causally to every
earlier position (a prefill chunk continuing cached context, a prefix-cache hit and a decode are
the same thing). Its KV lives in the blocks ``block_tables[i, :ceil(seq_lens[i] / block_size)]``;
the new tokens' K/V go to ``slot_mapping`` (``block_id * block_size + offset``; -1 = padding, skip).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def fp8_dtypes(flavour: str | None) -> dict[str, torch.dtype]:
    """The fp8 dtypes of a ``Capabilities.fp8`` flavour, by format: ``{"e4m3": ..., "e5m2": ...}``.

    "e4m3fn" (OCP, NVIDIA and CDNA4) gives float8_e4m3fn / float8_e5m2; "e4m3fnuz" (CDNA3) gives
    the fnuz pair; None (no fp8) gives {}. Raises ValueError on an unknown flavour."""
    if flavour is None:
        return {}
    if flavour == "e4m3fn":
        return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    if flavour == "e4m3fnuz":
        return {"e4m3": torch.float8_e4m3fnuz, "e5m2": torch.float8_e5m2fnuz}
    raise ValueError(f"unknown fp8 flavour {flavour!r}; expected 'e4m3fn', 'e4m3fnuz' or None")


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the model's KV cache: what a platform needs to allocate it."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, keys and values."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * element


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Per-layer attention parameters (what varies between models and layers)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None  # a query at p sees keys at k with p - window < k <= p
    soft_cap: float | None = None  # scores -> soft_cap * tanh(scores / soft_cap)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )


@dataclass
class AttentionMetadata:
    """One step's flat ragged batch, as device tensors plus a few host-side facts.

    Shapes (S sequences, T new tokens):
      query_start_loc  int32 [S + 1]   cumulative new-token counts
      seq_lens         int32 [S]       context length of each sequence including its new tokens
      block_tables     int32 [S, W]    block ids of each sequence (W >= max blocks used; pad 0)
      slot_mapping     int64 [T]       cache slot of each new token (-1: don't write)
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    extras: dict = field(default_factory=dict)  # a backend's own per-step data (prepare_metadata)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def from_lengths(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from host lists (tests, tools, simple runners)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        starts = [0]
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables):
            if not 0 < q <= s:
                raise ValueError(f"need 0 < query_len <= seq_len, got query_len={q}, seq_len={s}")
            if len(table) * block_size < s:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {s} tokens")
            starts.append(starts[-1] + q)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s - q, s))
        width = max((len(t) for t in block_tables), default=1)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
        )


@dataclass(frozen=True)
class RotaryInputs:
    """One step's rotary embedding, for ``AttentionBackend.forward_rotary``.

    ``rotate(positions, query, key, cos_sin_cache)`` is the model's rotary op (the op table's
    ``rotary_embedding``: neox rotate-half, cos in the cache's first D/2 columns, sin in the last).
    """

    positions: torch.Tensor  # int [T]: each new token's position
    cos_sin_cache: torch.Tensor  # float32 [max_positions, head_size]
    rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]]

