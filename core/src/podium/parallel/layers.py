"""The collectives around a sharded model's layers (``sharding.connect_model`` puts them there).

Each wraps the plain module it finishes and keeps it as ``inner``: a platform's ``prepare_model``
that swaps plain linears and embeddings for its own kernels still finds them, and the collective
stays outside, where the partial result is complete.
"""

from __future__ import annotations

import torch
from torch import nn


class ReducedOutput(nn.Module):
    """A row-parallel layer: ``inner``'s partial output summed over the ranks."""

    def __init__(self, inner: nn.Module, comm) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))


class ReducedMlp(nn.Module):
    """A decoder layer's MLP (dense or mixture of experts) whose down projections are row-parallel:
    its output summed over the ranks, once per layer."""

    def __init__(self, inner: nn.Module, comm) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))

    def forward_normed(self, norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None):
        out, residual = self.inner.forward_normed(norm, hidden, residual)
        return self.comm.all_reduce(out), residual


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + count)`` of the vocabulary; other tokens read zeros; summed over the ranks."""

    def __init__(self, inner: nn.Embedding, start: int, count: int, comm) -> None:
        super().__init__()
        self.inner, self.start, self.count, self.comm = inner, start, count, comm

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # [T]
        held = (local >= 0) & (local < self.count)
        rows = self.inner(torch.where(held, local, torch.zeros_like(local)))  # [T, hidden]
        rows = torch.where(held.unsqueeze(-1), rows, torch.zeros_like(rows))
        return self.comm.all_reduce(rows)


class GatheredLogits(nn.Module):
    """A vocab-parallel LM head: each rank's [N, Vp] logits gathered to [N, V]."""

    def __init__(self, inner: nn.Module, vocab_size: int, comm) -> None:
        super().__init__()
        self.inner, self.vocab_size, self.comm = inner, vocab_size, comm

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.comm.all_gather(self.inner(x), dim=-1)  # [N, n * Vp]
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size].contiguous()
