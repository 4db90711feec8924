"""GGUF weights kept in ggml's block formats: linears and the embedding compute on the stored bytes.

``GGUFMethod`` reads which block type the file stores for each checkpoint tensor and swaps every
linear whose weights are all of a kept type (``podium_plugin_api.gguf_blocks.BLOCKS``) for a
``GGUFLinear``: its ``weight`` is uint8 [out_features, row_bytes], the file's bytes row for row,
so merged projections (q|k|v, gate|up) fill row ranges of it exactly as float weights do, and
llama.cpp's Q/K row interleave is undone on byte rows. A merged projection whose pieces use
different types (Q4_K_M files store v in Q6_K) becomes a ``SegmentedGGUFLinear``: one part per
run of rows of one type, the parent's ``merged_shards`` pointed at the parts. The embedding keeps
its blocks too (``GGUFEmbedding``), and a tied LM head shares them. Everything else (norms, F16/F32
tensors, types without a kernel) is dequantized at load as before.

The matmuls are the op table's ``gguf_linear`` / ``gguf_embedding``: the contract's pure-torch
reference by default, a platform's kernel where it overrides them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from podium_plugin_api.gguf_blocks import BLOCKS, NAMES, row_bytes
from podium_plugin_api.quantization import QuantizationMethod

from .replace import LinearSite, linear_sites, tied_head

EMBEDDING = "model.embed_tokens.weight"


class GGUFLinear(nn.Module):
    """x [..., in] -> [..., out] with ``weight`` uint8 [out, row_bytes] in one ggml block type."""

    def __init__(self, in_features: int, out_features: int, ggml_type: int, bias: bool, ops: Mapping[str, Callable],
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.ggml_type = in_features, out_features, ggml_type
        shape = (out_features, row_bytes(ggml_type, in_features))
        self.weight = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.gguf_linear = ops["gguf_linear"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, in]
        out = self.gguf_linear(rows, self.weight, self.ggml_type, self.bias)  # [M, out]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={NAMES[self.ggml_type]}, bias={self.bias is not None}")


class SegmentedGGUFLinear(nn.Module):
    """A merged projection whose row ranges are stored in different block types: one part per range."""

    def __init__(self, parts: list[GGUFLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)  # [..., out]


class GGUFEmbedding(nn.Module):
    """ids -> rows of ``weight`` uint8 [vocab, row_bytes] dequantized to the model's dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ggml_type: int, ops: Mapping[str, Callable],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.ggml_type = num_embeddings, embedding_dim, ggml_type
        shape = (num_embeddings, row_bytes(ggml_type, embedding_dim))
        self.weight = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
        # the dtype the rows come out in (the replaced embedding's), following the model through .to(dtype)
        self.register_buffer("dtype_marker", torch.empty(0, dtype=dtype), persistent=False)
        self.gguf_embedding = ops["gguf_embedding"]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gguf_embedding(ids, self.weight, self.ggml_type, self.dtype_marker.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={NAMES[self.ggml_type]}"


class GGUFMethod(QuantizationMethod):
    """``config["tensor_types"]``: {checkpoint (Hugging Face) name: ggml type id} of the file's tensors."""

    name = "gguf"
    checkpoint_names = ("gguf",)

    def __init__(self, config: Mapping, online: bool = False) -> None:
        super().__init__(config, online)
        self.types: dict[str, int] = dict(self.config.get("tensor_types", {}))
        self.kept: set[str] = set()

    def apply(self, model: nn.Module, ops: Mapping[str, Callable]) -> None:
        head_tied = tied_head(model)
        for site in linear_sites(model):
            names = [EMBEDDING] if head_tied and site.path == "lm_head" else [name for name, _, _ in site.shards]
            types = [self.types.get(name) for name in names]
            if not all(t in BLOCKS for t in types):
                continue
            setattr(site.parent, site.leaf, _quantized_linear(site, types, ops))
            self.kept.update(names)
        for parent in list(model.modules()):
            for leaf, child in list(parent.named_children()):
                if type(child) is nn.Embedding and self._kept_embedding(model, child):
                    setattr(parent, leaf, GGUFEmbedding(child.num_embeddings, child.embedding_dim,
                                                        self.types[EMBEDDING], ops, child.weight.dtype))
                    self.kept.add(EMBEDDING)
        if head_tied and EMBEDDING in self.kept and not isinstance(getattr(model, "lm_head", None), GGUFLinear):
            raise ValueError("the GGUF embedding is kept quantized but the tied LM head could not be")

    def _kept_embedding(self, model: nn.Module, embedding: nn.Embedding) -> bool:
        stack = getattr(model, "model", None)
        return getattr(stack, "embed_tokens", None) is embedding and self.types.get(EMBEDDING) in BLOCKS

    def kept_checkpoint_names(self) -> frozenset[str]:
        return frozenset(self.kept)

    def describe(self) -> str:
        kinds = sorted({NAMES[t] for name, t in self.types.items() if name in self.kept})
        return f"gguf ({', '.join(kinds)} kept in blocks; {len(self.kept)} tensors)"


def _quantized_linear(site: LinearSite, types: list[int], ops: Mapping[str, Callable]) -> nn.Module:
    """A GGUFLinear for ``site``, or a SegmentedGGUFLinear (parent's merged_shards re-pointed) where
    its checkpoint pieces differ in type."""
    linear = site.linear
    bias, dtype = linear.bias is not None, linear.weight.dtype
    if len(set(types)) == 1:
        return GGUFLinear(linear.in_features, linear.out_features, types[0], bias, ops, dtype)
    parts: list[GGUFLinear] = []
    runs: list[tuple[int, int, int]] = []  # (type, first row, rows) of each part
    for (_, start, size), kind in zip(site.shards, types):
        if runs and runs[-1][0] == kind and runs[-1][1] + runs[-1][2] == start:
            runs[-1] = (kind, runs[-1][1], runs[-1][2] + size)
        else:
            runs.append((kind, start, size))
    for kind, _, size in runs:
        parts.append(GGUFLinear(linear.in_features, size, kind, bias, ops, dtype))
    merged = site.parent.merged_shards
    for hf_leaf, (target, start, size) in list(merged.items()):
        if target != site.leaf:
            continue
        index = next(i for i, (_, first, rows) in enumerate(runs) if first <= start < first + rows)
        merged[hf_leaf] = (f"{site.leaf}.parts.{index}", start - runs[index][1], size)
    return SegmentedGGUFLinear(parts)
