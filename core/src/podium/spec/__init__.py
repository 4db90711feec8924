"""Speculative decoding: a proposer drafts tokens, one target forward verifies them (see ``verify``).

``speculator`` is the engine's side; ``ngram`` (host lookup), ``draft_model`` and ``eagle`` (drafters
on the device, ``draft_device``) the proposers. Only the light modules are imported here: the
engine's config imports this package.
"""

from .config import SpeculativeConfig, speculative_config
from .metrics import SpecDecodingStats
from .ngram import NgramProposer
from .proposer import Drafter, Proposer

__all__ = ["Drafter", "NgramProposer", "Proposer", "SpecDecodingStats", "SpeculativeConfig", "speculative_config"]
