"""Counts of proposed and accepted draft tokens, per draft position, over an engine's life."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)  # [k]: drafts reaching position i
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_accepted`` of its ``num_proposed`` drafts held."""
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        grow = num_proposed - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_proposed):
            self.proposed_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verifying sequence-step: the bonus (or corrected) token plus the accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.proposed_per_position), list(self.accepted_per_position))
