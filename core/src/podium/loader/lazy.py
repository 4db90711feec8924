"""Checkpoint tensors read on demand, so a tensor-parallel rank reads only its slices.

The weight stream yields ``LazyTensor`` instead of a tensor when asked (``ModelSource.weights(lazy=True)``);
the weight loader calls ``narrow`` for the slice its rank keeps (``parallel.sharding``) or ``load``
for the whole tensor. A safetensors tensor reads just the slice from the file on any dimension; a
GGUF tensor dequantizes just the rows of a slice along its first dimension (quantized blocks run
along rows), and the whole tensor for a slice along another.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LazyTensor:
    """``shape``; ``narrow(dim, start, size)`` -> that slice as a tensor; ``load()`` -> the whole tensor."""

    def __init__(self, shape: tuple[int, ...], load: Callable[[], torch.Tensor],
                 read: Callable[[int, int, int], torch.Tensor | None] | None = None) -> None:
        self.shape = torch.Size(shape)
        self._load, self._read = load, read

    def load(self) -> torch.Tensor:
        return self._load()

    def narrow(self, dim: int, start: int, size: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        if not 0 <= start <= start + size <= self.shape[dim]:
            raise ValueError(f"slice [{start}, {start + size}) of dimension {dim} is outside shape {tuple(self.shape)}")
        part = self._read(dim, start, size) if self._read is not None else None
        return part if part is not None else self._load().narrow(dim, start, size)


def safetensors_lazy(handle, name: str) -> LazyTensor:
    """A tensor of an open ``safe_open`` file: any slice is read from the file alone."""
    view = handle.get_slice(name)

    def read(dim: int, start: int, size: int) -> torch.Tensor:
        return view[(slice(None),) * dim + (slice(start, start + size),)]

    return LazyTensor(tuple(view.get_shape()), lambda: handle.get_tensor(name), read)
