"""Checks of a request's sampling parameters against the model, made before it enters a step.

``SamplingParams`` already bounds every integer to int64 (what the sampler's tensors hold). What
depends on the model is checked here, when the engine takes the request: a step never meets a
value it cannot put in a tensor, so one request's parameters can never fail a batch.
"""

from __future__ import annotations

import math

from .errors import InvalidParameter
from .sampling_params import SamplingParams


def bound_to_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Clamp ``top_k`` to the vocabulary (a larger k keeps every token: the same distribution) and
    refuse what has no meaning for this vocabulary (InvalidParameter naming the field)."""
    if params.top_k > vocab_size:
        params.top_k = vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > vocab_size:
            raise InvalidParameter(f"{name}={k} asks for more tokens than the vocabulary has ({vocab_size})",
                                   param=name)
    bias = params.logit_bias or {}
    outside = [t for t in bias if not 0 <= t < vocab_size]
    if outside:
        raise InvalidParameter(f"logit_bias: token id(s) {outside[:5]} outside the vocabulary [0, {vocab_size})",
                               param="logit_bias")
    if any(not math.isfinite(v) and v != -math.inf for v in bias.values()):
        raise InvalidParameter("logit_bias values must be finite numbers (or -inf to ban a token)",
                               param="logit_bias")
