"""``GrammarMasks``: the sampler's side of structured output.

One matcher per constrained sequence (keyed by ``seq_id``), made from ``Sequence.grammar`` when the
sequence first samples. Before each mask a matcher catches up with its sequence's output tokens
(the tokens appended since it last looked), so a sampled token is accepted exactly once, whichever
way the step went. A preempted sequence keeps its output tokens and so its matcher; if its output
ever shrinks below what the matcher consumed, the matcher is reset and replays the output.

A request constrained after its reasoning (``reasoning_gate``) has no mask while it reasons: its
row stays all ones and its matcher takes nothing until the answer starts, then the answer's tokens.

The mask of a step: each constrained row's matcher writes its allowed tokens into one row of a host
int32 bitmask [R, ceil(V / 32)]; one copy to the device; the platform's ``apply_token_bitmask`` op
sets the forbidden tokens' logits to -inf before any other logit processing. Rows without a
grammar are never touched, and a step without constrained rows (or whose constrained rows are all
reasoning) copies and applies no mask at all.

With async scheduling a sequence's last token may still be on the device (a placeholder, sampled
by the step in flight) when its next step samples. The mask is built after that step's forward
is launched: ``pending`` then waits for the previous step's tokens (already sampled, or nearly, on
the device's queue) and the matcher takes the token a step early, while the forward runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from podium_plugin_api.ops import apply_token_bitmask as reference_apply_token_bitmask

from ..request import Sequence
from .backend import Matcher
from .reasoning_gate import ReasoningGate

logger = logging.getLogger(__name__)

ApplyBitmask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
PendingTokens = Callable[[], dict[int, int]]  # the in-flight step's tokens by seq_id (waits for them)


@dataclass
class _Tracked:
    matcher: Matcher
    gate: ReasoningGate | None = None  # the reasoning before the answer, if the grammar waits for it
    consumed: int = 0  # answer tokens the matcher has accepted
    broken: bool = False  # a token it could not accept (logged); the row is no longer masked


class GrammarMasks:
    def __init__(self, vocab_size: int, apply_bitmask: ApplyBitmask = reference_apply_token_bitmask) -> None:
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self._tracked: dict[int, _Tracked] = {}
        self._apply_bitmask = apply_bitmask  # the platform's apply_token_bitmask op

    def forget(self, seq_id: int) -> None:
        self._tracked.pop(seq_id, None)

    def matcher(self, seq: Sequence, pending: dict[int, int] | None = None) -> Matcher:
        """The sequence's matcher, caught up with its output tokens (and its placeholder's token,
        from ``pending``, when its last token is still in flight)."""
        tracked, tail = self._tail(seq, pending)
        self._accept(seq, tracked, tail)
        return tracked.matcher

    def _tail(self, seq: Sequence, pending: dict[int, int] | None) -> tuple[_Tracked, list[int]]:
        """The sequence's tracked matcher and the output tokens it has yet to accept."""
        tracked = self._tracked.get(seq.seq_id)
        if tracked is None:
            tracked = self._tracked[seq.seq_id] = self._track(seq)
        start, end = seq.num_prompt_tokens, seq.num_tokens - seq.num_pending_tokens  # the output on the host
        in_flight: list[int] = []
        if seq.num_pending_tokens:
            if pending is None or seq.seq_id not in pending or seq.num_pending_tokens > 1:
                raise RuntimeError(f"sequence {seq.request_id}: its grammar needs the token still in flight")
            in_flight = [pending[seq.seq_id]]
        gate = tracked.gate
        num_output = end - start + len(in_flight)
        answer = gate.answer_start if gate is not None else 0
        if (answer or 0) + tracked.consumed > num_output or (gate is not None and gate.scanned > num_output):
            tracked.matcher.reset()  # the output was rewound: replay it from the start
            tracked.consumed, tracked.broken = 0, False
            if gate is not None:
                gate.reset()
        if gate is not None and gate.answer_start is None:
            gate.scan(seq.token_ids, start, end, in_flight)
            if gate.answer_start is None:
                return tracked, []  # still reasoning: nothing for the grammar yet
            answer = gate.answer_start
        first = start + answer + tracked.consumed  # the first token the matcher has yet to take
        tail = seq.token_ids[first:end] + in_flight[max(0, first - end):]
        return tracked, tail if not tracked.broken else []

    @staticmethod
    def _track(seq: Sequence) -> _Tracked:
        markers = seq.params.structured_outputs.reasoning if seq.params.structured_outputs is not None else None
        gate = ReasoningGate(markers, seq.prompt_token_ids) if markers is not None else None
        return _Tracked(seq.grammar.result().matcher(), gate)

    @staticmethod
    def _accept(seq: Sequence, tracked: _Tracked, tail: list[int]) -> None:
        for token in tail:
            if not tracked.matcher.accept(token):
                _broken(seq, tracked, token)
                return
            tracked.consumed += 1

    def _catch_up(self, seqs: list[Sequence], pending: dict[int, int] | None) -> list[_Tracked]:
        """Every sequence's matcher caught up. A decode's single new token (the common case) is
        accepted in one batched call per backend: at batch 256 the per-token calls were a large
        part of the host's work per step."""
        tracked_rows = []
        singles: dict[type, tuple[list[Matcher], list[int], list[int]]] = {}  # matchers, tokens, rows
        for row, seq in enumerate(seqs):
            tracked, tail = self._tail(seq, pending)
            tracked_rows.append(tracked)
            if len(tail) == 1:
                group = singles.setdefault(type(tracked.matcher), ([], [], []))
                group[0].append(tracked.matcher)
                group[1].append(tail[0])
                group[2].append(row)
            elif tail:
                self._accept(seq, tracked, tail)
        for kind, (matchers, tokens, rows) in singles.items():
            for row, token, ok in zip(rows, tokens, kind.accept_tokens(matchers, tokens)):
                if ok:
                    tracked_rows[row].consumed += 1
                else:
                    _broken(seqs[row], tracked_rows[row], token)
        return tracked_rows

    def host_mask(self, seqs: list[Sequence], pin: bool = False,
                  pending: PendingTokens | None = None) -> torch.Tensor | None:
        """The bitmask [R, words] int32 on the host of these constrained sequences, one row each
        (``pin``: in pinned memory, so that its copy to an accelerator does not wait for the device);
        None when no row is masked this step (every one still reasoning, ended or broken)."""
        mask = torch.full((len(seqs), self.words), -1, dtype=torch.int32, pin_memory=pin)
        live: dict[type, tuple[list[Matcher], list[int]]] = {}  # per backend: its matchers and their rows
        in_flight = pending() if pending is not None and any(s.num_pending_tokens for s in seqs) else None
        undecided: list[tuple[int, int]] = []  # (row, the token that may open a reasoning section there)
        for row, tracked in enumerate(self._catch_up(seqs, in_flight)):
            gate = tracked.gate
            if gate is not None and gate.answer_start is None and not gate.undecided:
                continue  # reasoning: the row stays all ones
            if not tracked.broken and not tracked.matcher.is_terminated():
                matchers, rows = live.setdefault(type(tracked.matcher), ([], []))
                matchers.append(tracked.matcher)
                rows.append(row)
                if gate is not None and gate.undecided:
                    undecided.append((row, gate.start_token))
        for kind, (matchers, rows) in live.items():
            if len(rows) == 1:
                matchers[0].fill_bitmask(mask, rows[0])
            else:
                kind.fill_bitmasks(matchers, mask, rows)
        if not live:
            return None
        for row, token in undecided:  # the grammar's first tokens, or the start of the reasoning
            if 0 <= token < self.vocab_size:
                word = mask[row, token // 32].item() | (1 << token % 32)
                mask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word  # (as int32)
        return mask

    def apply(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
              pending: PendingTokens | None = None) -> None:
        """Set logits[rows[i], t] = -inf for every token t the grammar of ``seqs[i]`` forbids now."""
        device = logits.device
        host = self.host_mask(seqs, pin=device.type != "cpu", pending=pending)  # [R, W] int32 (as deferred.py pins)
        if host is None:
            return
        mask = host.to(device, non_blocking=True)
        index = None if len(rows) == logits.shape[0] else torch.tensor(rows).to(device, non_blocking=True)
        self._apply_bitmask(logits, mask, index)


def _broken(seq: Sequence, tracked: _Tracked, token: int) -> None:
    logger.error("sequence %s: the grammar rejects token %d after %d tokens; its output is no longer constrained",
                 seq.request_id, token, tracked.consumed)
    tracked.broken = True
