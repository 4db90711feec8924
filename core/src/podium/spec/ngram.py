"""N-gram prompt lookup: propose the tokens that followed the sequence's last n tokens earlier on.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens of the sequence
(prompt and output) are looked for earlier in it; at the latest earlier match, the (up to) k tokens
that followed are the proposal. No second model: it wins where the output repeats its input (edits,
code, retrieval-augmented answers) and proposes nothing otherwise, so those sequences decode as usual.

A request's predicted output (``SamplingParams.prediction``, OpenAI's ``prediction`` field) is looked
up first: where the sequence's last n tokens occur in it, the prediction's continuation is proposed,
from the occurrence nearest the output's own position (the prediction is the expected output, so a
phrase it repeats is continued where the answer is, not where the phrase first appeared).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, token_ids: list[int], k: int | None = None, prediction: list[int] | None = None,
                position: int = 0) -> list[int]:
        """Up to ``k`` (default: the configured k) tokens to follow ``token_ids``; [] when no n-gram
        matches. ``prediction``: the expected output, searched first; ``position``: how many output
        tokens ``token_ids`` ends with (where in the prediction the answer is)."""
        k = self.k if k is None else k
        if k <= 0 or len(token_ids) < self.n_min + (0 if prediction else 1):
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        if prediction:
            found = self._lookup(tokens, np.asarray(prediction, dtype=np.int64), k, near=position)
            if found:
                return found
        return self._lookup(tokens, tokens[:-1], k, follow=tokens)

    def _lookup(self, tokens: np.ndarray, source: np.ndarray, k: int, near: int | None = None,
                follow: np.ndarray | None = None) -> list[int]:
        """The k tokens after an occurrence of the longest matching suffix of ``tokens`` in
        ``source``: the latest, or the one whose continuation starts nearest ``near``. Continuations
        are read from ``follow`` (default: ``source``)."""
        length, follow = len(tokens), source if follow is None else follow
        for n in range(min(self.n_max, length, len(source)), self.n_min - 1, -1):
            windows = sliding_window_view(source, n)  # [len(source) - n + 1, n]
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1)) + n  # what followed each match
            hits = hits[hits < len(follow)]
            if len(hits):
                start = int(hits[-1] if near is None else hits[np.abs(hits - near).argmin()])
                return follow[start:start + k].tolist()
        return []
