"""The distributed piece of the contract: the collectives tensor parallelism runs on.

The core starts one process per rank, binds each to a device (``Platform.rank_device``), joins them
with ``torch.distributed.init_process_group(backend=capabilities().distributed_backend)`` and asks the
platform for a ``Communicator`` (``Platform.communicator``). The model's sharded layers call only the
three collectives below; the default runs them through torch.distributed on the default group, so
a platform whose backend torch.distributed knows (gloo, nccl, RCCL as nccl, xla once registered)
needs nothing more. A platform may return its own subclass (a custom all-reduce over peer memory,
say) and keep the default for the others.

Every rank calls every collective in the same order with tensors of the same shape and dtype.
"""

from __future__ import annotations

import torch


class Communicator:
    """Collectives over the ranks of one tensor-parallel group (torch.distributed by default).

    ``rank`` and ``world_size`` are this process's place in the group; ``group`` is a
    torch.distributed process group (None: the default group)."""

    def __init__(self, rank: int, world_size: int, group=None) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Communicator: rank {rank} is not in a group of {world_size}")
        self.rank, self.world_size, self.group = rank, world_size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x`` (every rank holds the sum)."""
        if self.world_size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (a new tensor on every rank)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` into every rank's ``x``, in place; returns ``x``."""
        if self.world_size > 1:
            torch.distributed.broadcast(x, src=src, group=self.group)
        return x
