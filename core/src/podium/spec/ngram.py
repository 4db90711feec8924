"""N-gram prompt lookup: propose the tokens that followed the sequence's last n tokens earlier on.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens of the sequence
(prompt and output) are looked for earlier in it; at the latest earlier match, the (up to) k tokens
that followed are the proposal. No second model: it wins where the output repeats its input (edits,
code, retrieval-augmented answers) and proposes nothing otherwise, so those sequences decode as usual.

A request's predicted output (``SamplingParams.prediction``, OpenAI's ``prediction`` field) is looked
up first: where the sequence's last n tokens occur in it, the prediction's continuation is proposed.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, token_ids: list[int], k: int | None = None, prediction: list[int] | None = None) -> list[int]:
        """Up to ``k`` (default: the configured k) tokens to follow ``token_ids``; [] when no n-gram
        matches. ``prediction``: tokens the output is expected to contain, searched first."""
        k = self.k if k is None else k
        if k <= 0 or len(token_ids) < self.n_min + (0 if prediction else 1):
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        if prediction:
            found = self._lookup(tokens, np.asarray(prediction, dtype=np.int64), k, latest=False)
            if found:
                return found
        return self._lookup(tokens, tokens[:-1], k, latest=True, source_len=len(tokens))

    def _lookup(self, tokens: np.ndarray, source: np.ndarray, k: int, latest: bool,
                source_len: int | None = None) -> list[int]:
        """The k tokens after the first (or latest) occurrence of the longest matching suffix of
        ``tokens`` in ``source`` (continuations read from ``tokens`` when ``source`` is its prefix)."""
        length = len(tokens)
        follow = tokens if source_len is not None else source
        for n in range(min(self.n_max, length, len(source)), self.n_min - 1, -1):
            windows = sliding_window_view(source, n)  # [len(source) - n + 1, n]
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1] if latest else hits[0]) + n  # what followed the match
                proposal = follow[start:start + k].tolist()
                if proposal:
                    return proposal
        return []
