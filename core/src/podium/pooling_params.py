"""``PoolingParams``: what one embedding request asks of a pooling model (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidParameter


@dataclass(frozen=True)
class PoolingParams:
    """``dimensions``: keep the first N dimensions of the embedding (Matryoshka models only; the
    engine refuses it elsewhere), before normalising. ``normalize``: scale to unit length (None:
    the model's own setting, e.g. a sentence-transformers ``Normalize`` module)."""

    dimensions: int | None = None
    normalize: bool | None = None

    # what the scheduler and the step plan read of a sequence's parameters: a pooling request is one
    # sequence, and its prompt's logprobs are never computed
    n = 1
    prompt_logprobs = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise InvalidParameter(f"dimensions must be a positive integer, got {self.dimensions!r}",
                                   param="dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidParameter(f"normalize must be true or false, got {self.normalize!r}", param="normalize")
