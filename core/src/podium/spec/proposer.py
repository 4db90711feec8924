"""The proposer interfaces: who drafts the tokens a step verifies.

Two kinds. A **host proposer** (n-gram lookup) reads a running sequence's tokens before the step is
planned and returns up to k drafts, or none: that sequence then decodes one token as usual (per-request
disable when a proposer has nothing). A **drafter** (a draft model or an EAGLE head, on the device)
cannot draft before the step's blocks exist: the engine reserves k drafts for each sequence it is
``ready`` for, the scheduler fits them, and ``draft`` fills the reserved ones after planning, before
the target's forward; ``observe`` sees each step once it is booked (EAGLE mirrors it then).

Drafts are deterministic proposals (one token per position, no draft distribution), so verification
needs only the target's own sampler (see ``verify``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # (podium.config imports this package: no engine modules at import time)
    import torch

    from ..request import Sequence
    from ..scheduler import SchedulerOutput


class Proposer(Protocol):
    k: int

    def propose(self, token_ids: list[int], k: int | None = None, prediction: list[int] | None = None,
                position: int = 0) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (the prompt and the output so far, of which
        ``position`` are output); ``prediction``: the request's expected output tokens, if any."""


class Drafter(Protocol):
    method: str
    k: int

    def ready(self, seq: Sequence) -> bool:
        """Whether ``seq`` (running, one token to compute) can be drafted for this step."""

    def draft(self, output: SchedulerOutput) -> None:
        """Fill each scheduled sequence's reserved ``drafts`` in place (call under no-grad)."""

    def observe(self, output: SchedulerOutput, hidden: torch.Tensor | None) -> None:
        """The step ran and was booked (``Scheduler.advance`` too); ``hidden``: what the target's
        runner kept of its hidden states (``ModelRunner.keep_hidden``), or None."""

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted."""
