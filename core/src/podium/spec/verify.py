"""Verifying drafts against the target's own sampler, position by position.

One target forward computed the logits of a verifying sequence's last token and of each of its d
drafts: d + 1 rows, where row j is the target's distribution p_j for the token after draft j - 1.
Round j samples row j with the engine's sampler, exactly as a step without speculation would
(temperature, top-k/p, penalties over the tokens so far, the sequence's seeded stream at that output
position, logprobs), and books the token (stop rules, detokenizer). The sequence goes on to round
j + 1 only while the token equals draft j and did not end it.

This is the rejection-sampling rule for a deterministic proposal (all of the draft's mass on one
token d): accept d with probability p(d) = min(1, p(d) / q(d)); on rejection, the token drawn is
distributed as p without d, renormalised = norm(max(0, p - q)); after the last accepted draft the
next row gives the bonus token. So the output follows the target's distribution exactly, greedy
output is the greedy output token for token, and a seeded request gives the same text with or
without speculation. Sequences without drafts take part in round 0 only.

When every sequence is plain greedy (no penalties, bias, min_tokens, logprobs or grammar: nothing
a round's booking changes for the next), each row's token is its argmax whatever was booked
before it, so all rows are chosen in one launch and one copy to the host; the rounds then only
compare and book. (Sampling round by round costs a launch sequence and a host sync per round,
which at batch 1 on a GPU was most of a verify step.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..request import Sequence
from ..sampler import Sampler, SamplerOutput


def verify(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
           book: Callable[[list[Sequence], SamplerOutput, int], None]) -> list[int]:
    """logits [sum(len(d) + 1), V]: each sequence's rows in order -> the drafts accepted per sequence.

    ``book(seqs, sampled, round)`` appends a round's tokens to its sequences (and may finish them)
    before the next round samples, since penalties, min_tokens and seeded streams read them."""
    offsets, row = [], 0
    for d in drafts:
        offsets.append(row)
        row += len(d) + 1
    accepted = [0] * len(seqs)
    active = list(range(len(seqs)))
    position = 0
    greedy = sampler.greedy_tokens(logits, seqs)  # every row's token at once, or None
    while active:
        batch = [seqs[i] for i in active]
        if greedy is not None:
            sampled = SamplerOutput([greedy[offsets[i] + position] for i in active], [None] * len(active))
        else:
            rows = torch.tensor([offsets[i] + position for i in active]).to(logits.device, non_blocking=True)
            sampled = sampler.sample(logits.index_select(0, rows), batch)  # a copy: sample edits it in place
        book(batch, sampled, position)
        still = []
        for i, token in zip(active, sampled.token_ids):
            draft = drafts[i]
            if position < len(draft) and token == draft[position] and not seqs[i].is_finished:
                accepted[i] += 1
                still.append(i)
        active = still
        position += 1
    return accepted
