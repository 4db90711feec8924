"""N-gram prompt lookup: propose the tokens that followed the sequence's last n tokens earlier on.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens of the sequence
(prompt and output) are looked for earlier in it; at the latest earlier match, the (up to) k tokens
that followed are the proposal. No second model: it wins where the output repeats its input (edits,
code, retrieval-augmented answers) and proposes nothing otherwise, so those sequences decode as usual.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (default: the configured k) tokens to follow ``token_ids``; [] when no n-gram matches."""
        k = self.k if k is None else k
        length = len(token_ids)
        if k <= 0 or length < self.n_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            # windows [L - n, n] starting at 0 .. L - n - 1 (the suffix itself excluded)
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the latest match; what followed it
                return tokens[start:start + k].tolist()
        return []
