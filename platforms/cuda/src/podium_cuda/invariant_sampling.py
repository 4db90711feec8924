"""Top-k / top-p for the batch-invariant mode: each row's nucleus measured by an exact prefix sum.

The contract's reference (``podium_plugin_api.ops.top_k_top_p``) finds a row's nucleus with a float
``cumsum`` of its sorted probabilities, and on a GPU torch orders that sum by the tensor's shape: a
one-row tensor goes through CUB's device-wide scan (partial sums combined in an order set by
timing), more rows through a block scan whose width shrinks as rows are added (past 256 rows of a
128k vocabulary). A token at the nucleus's edge can then fall in or out with the batch. Here each
probability is first a whole number of 2^-40 units (a power-of-two scale, then truncation: exact,
element by element) and the prefix sums are int64, the same in any order. The sort is stable, so
ties rank by token id in every batch; the softmax is torch's, one block per row sized by the
vocabulary alone. Tokens under 2^-40 add nothing to the nucleus's mass.
"""

from __future__ import annotations

import torch

UNIT_BITS = 40  # as the core's exact draw: probabilities <= 1 in units of 2^-40


def invariant_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``top_k_top_p`` (same contract: logits [B, V], top_k int [B] (<= 0: off), top_p float [B]
    (>= 1: off) -> logits with the excluded entries -inf; each row's best token always kept)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]  # [B, 1]
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.float().masked_fill(drop, float("-inf")), dim=-1)
    units = (probs * 2.0**UNIT_BITS).to(torch.int64)
    before = units.cumsum(dim=-1) - units  # units strictly above each entry, exact
    nucleus = top_p.double()[:, None]
    drop |= (before.double() >= nucleus * 2.0**UNIT_BITS) & (nucleus < 1.0)
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked)
