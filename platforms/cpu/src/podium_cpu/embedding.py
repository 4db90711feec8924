"""The embedding lookup as a native kernel (fused_ops.c ``podium_embed_rows``): rows copied from the
table by token id, ids checked first (an id outside the vocabulary raises IndexError, as
``F.embedding`` does). Its point is graph capture (graphs.py): a decode step whose first op is a
native call can be replayed from C as a whole. A transformation applied to a loaded model
(``native_embeddings``), like the linear packing: same parameter, same results."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .native_kernels import NativeKernels


class NativeEmbedding(nn.Module):
    """Drop-in for an ``nn.Embedding`` without max_norm: the same weight parameter (ties to an
    output head stay), lookups of 1-D int64 ids in the native kernel, anything else in F.embedding."""

    def __init__(self, embedding: nn.Embedding, kernel) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = embedding.weight
        self.kernel = kernel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if ids.dim() != 1 or ids.dtype != torch.int64 or not ids.is_contiguous() or not weight.is_contiguous():
            return F.embedding(ids, weight)
        out = torch.empty((ids.shape[0], self.embedding_dim), dtype=weight.dtype)  # [T, dim]
        if self.kernel(weight.data_ptr(), self.num_embeddings, self.embedding_dim, ids.data_ptr(), ids.shape[0],
                       out.data_ptr(), torch.get_num_threads()) != 0:
            low, high = torch.aminmax(ids)
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got [{int(low)}, {int(high)}]")
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, native"


def native_embeddings(model: nn.Module, kernels: NativeKernels) -> int:
    """Replace the CPU ``nn.Embedding`` modules of ``model`` whose dtype has a kernel; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Embedding or child.max_norm is not None or child.weight.device.type != "cpu":
                continue
            kernel = kernels.embed_rows.get(child.weight.dtype)
            if kernel is not None:
                setattr(parent, name, NativeEmbedding(child, kernel))
                count += 1
    return count
