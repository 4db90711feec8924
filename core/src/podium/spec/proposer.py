"""The proposer interface: given a running sequence's tokens, draft up to k tokens to follow them.

A proposer may return fewer than k tokens, or none: that sequence then decodes one token as usual
this step (per-request disable when a proposer has nothing). Drafts are deterministic proposals
(one token per position, no draft distribution), so verification needs only the target's own
sampler (see ``verify``).
"""

from __future__ import annotations

from typing import Protocol

from .config import SpeculativeConfig
from .ngram import NgramProposer


class Proposer(Protocol):
    k: int

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (the prompt and the output so far)."""


def build_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    raise ValueError(f"no proposer for speculative method {config.method!r}")
