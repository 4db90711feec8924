"""Sampling a step's logits now, on rank 0: tokens and logprobs for the engine to book."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import Sequence
from ..scheduler import SchedulerOutput
from .plan import StepPlan


@dataclass
class StepResult:
    sampled: list[tuple[Sequence, int]]  # (sequence, new token id)
    logprobs: list  # per sampled row: PositionLogprobs | None
    prompt_logprobs: dict[int, list]  # seq_id -> prompt logprob entries computed this step
    num_tokens: int
    used_graph: bool


def sample_now(sampler, logits: torch.Tensor | None, seqs: list[Sequence], prompt_logprobs: dict[int, list],
               num_tokens: int, used_graph: bool, pending=None) -> StepResult:
    """Sample ``logits`` [N, V] of ``seqs`` and wait for the tokens (``pending``: the in-flight
    step's ``tokens_by_seq``, for grammars)."""
    if not seqs:
        return StepResult([], [], prompt_logprobs, num_tokens, used_graph)
    out = sampler.sample(logits, seqs, pending)
    return StepResult(list(zip(seqs, out.token_ids)), out.logprobs, prompt_logprobs, num_tokens, used_graph)


def prompt_logprobs(sampler, output: SchedulerOutput, plan: StepPlan,
                    logits: list[torch.Tensor]) -> dict[int, list]:
    """seq_id -> the logprob entries of the prompt tokens this step computed, for sequences that
    asked for them; ``logits``: one [rows, V] tensor per ``plan.prompt_spans`` entry."""
    result: dict[int, list] = {}
    for (index, lo, hi), rows in zip(plan.prompt_spans, logits):
        s = output.scheduled[index]
        seq, start = s.seq, s.start
        # hidden at position p predicts token p + 1
        targets = seq.prompt_token_ids[start + 1:start + (hi - lo) + 1]
        entries = sampler.prompt_logprobs(rows[:len(targets)], targets, seq.params.prompt_logprobs)
        result[seq.seq_id] = ([None] if start == 0 else []) + entries
    return result
