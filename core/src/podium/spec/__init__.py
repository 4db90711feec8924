"""Speculative decoding: a proposer drafts tokens, one target forward verifies them (see ``verify``)."""

from .config import SpeculativeConfig, speculative_config
from .metrics import SpecDecodingStats
from .ngram import NgramProposer
from .proposer import Proposer, build_proposer

__all__ = ["NgramProposer", "Proposer", "SpecDecodingStats", "SpeculativeConfig", "build_proposer",
           "speculative_config"]
