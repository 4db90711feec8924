"""Deferred stepping (async scheduling): a step whose sampled tokens stay on the device a while.

``launch`` samples on the device and starts copying the tokens to the host without waiting; the
engine plans and launches the next step first and reads these tokens (``LaunchedStep.result``)
only then, so the host's work overlaps the device's. The next step's placeholders (-1 tokens)
take these tokens on the device (``fill_placeholders``) without a round trip through the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..request import Sequence
from .sampling import StepResult


@dataclass
class LaunchedStep:
    """A step whose sampled tokens [N] are on the device; ``result()`` waits for them."""

    seqs: list[Sequence]  # the sequences that sampled, in row order
    tokens: torch.Tensor  # [N] long, on the device: the next step's inputs read it there
    host: torch.Tensor  # [N] long on the host, filled by a non-blocking copy
    ready: Any  # an event recorded after that copy (None: ``host`` is already valid)
    num_tokens: int
    used_graph: bool
    rows: dict[int, int] = field(default_factory=dict)  # seq_id -> row of ``tokens``
    indices: list[int] = field(default_factory=list)  # where each token goes in its seq's token_ids

    def result(self) -> StepResult:
        if self.ready is not None:
            self.ready.synchronize()
        ids = self.host.tolist()
        return StepResult(list(zip(self.seqs, ids)), [None] * len(ids), {}, self.num_tokens, self.used_graph)

    def tokens_by_seq(self) -> dict[int, int]:
        """seq_id -> its sampled token, waiting for the copy (a grammar's matcher of the next step)."""
        if self.ready is not None:
            self.ready.synchronize()
        ids = self.host.tolist()
        return {seq_id: ids[row] for seq_id, row in self.rows.items()}


def launch(sampler, logits: torch.Tensor | None, seqs: list[Sequence], num_tokens: int, used_graph: bool,
           device: torch.device, pending=None) -> LaunchedStep:
    """Sample ``logits`` [N, V] of ``seqs`` on the device and start the tokens' copy to the host
    (``pending``: the in-flight step's ``tokens_by_seq``, for grammars)."""
    if seqs:
        tokens = sampler.sample_device(logits, seqs, pending)  # [N] long, on the device
    else:
        tokens = torch.zeros(0, dtype=torch.long, device=device)
    if tokens.device.type == "cpu":
        host, ready = tokens, None
    else:  # start the copy now; the host waits for it only when it reads the tokens
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.Event(device=tokens.device)
        ready.record()
    return LaunchedStep(seqs, tokens, host, ready, num_tokens, used_graph,
                        rows={seq.seq_id: i for i, seq in enumerate(seqs)})


def fill_placeholders(input_ids: torch.Tensor, fill, feed_tokens: torch.Tensor) -> None:
    """input_ids[dst] = feed_tokens[src] on the device (the previous step's tokens never leave it);
    ``fill``: (dst, src) as host lists, or as index tensors already on the device."""
    dst, src = (x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.long).to(
        input_ids.device, non_blocking=True) for x in fill)
    input_ids.index_copy_(0, dst, feed_tokens.index_select(0, src))
