"""The random draw of the batch-invariant mode: the inverse CDF over whole units of probability.

``Sampler._draw`` takes the first token whose running probability sum exceeds ``u * total``. With
float running sums the token can depend on the order the sums are formed in, and on a GPU torch's
cumsum picks that order from the tensor's shape: a one-row tensor goes through CUB's device-wide
scan, whose partial sums combine in an order set by timing, and a block scan's width shrinks as
rows are added (past 256 rows of a 128k vocabulary). So here each probability first becomes a
whole number of 2^-40 units (a power-of-two scale, then truncation: exact, element by element), the
running sums are int64 (the same in any order), and the target is ``floor(u * total)`` in float64
(exact: totals stay below 2^53). A token of probability under 2^-40 is never drawn; a row loses at
most V * 2^-40 of its mass that way (1e-7 for a 128k vocabulary).
"""

from __future__ import annotations

import torch

UNIT_BITS = 40  # probabilities (<= 1) in units of 2^-40: row totals ~2^40, far inside int64 and float64


def exact_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs [N, V] (>= 0, at most 1 each, unnormalised allowed), uniform [N, 1] in [0, 1) -> [N] long:
    per row the first token whose running sum of units exceeds ``floor(u * total units)``."""
    units = (probs * 2.0**UNIT_BITS).to(torch.int64)  # [N, V]
    cdf = units.cumsum(dim=-1)  # [N, V], exact
    total = cdf[:, -1:]  # [N, 1]
    target = torch.minimum((uniform.double() * total.double()).floor().long(), total - 1)  # < total
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [N]
    return tokens.clamp_(max=probs.shape[1] - 1)  # only a row of NaNs could run past the end
