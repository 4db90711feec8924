"""Structured output after the reasoning: a thinking model's grammar constrains its answer only.

A request whose ``StructuredOutputsParams.reasoning`` names the markers of a reasoning section
(``<think>`` ... ``</think>`` as token ids) is generated in two parts:

    prompt | reasoning (no mask; the matcher waits) | end marker | answer (masked, EOS by the grammar)

The answer starts at the output token after the first end marker in the output. Where the output
starts is read from the prompt's last marker, so a chat template that already opened or closed the
section is followed:

- the prompt's last marker is ``end`` (Qwen3 with ``enable_thinking: false`` renders an empty
  ``<think></think>``): the answer starts at the first output token;
- it is ``start`` (DeepSeek R1's template opens the section): reasoning until ``end``;
- neither: reasoning until ``end``; or, for an ``optional`` section, undecided: the first token may be
  the grammar's or the start marker's first token, and that choice says which part the output is in.

The state is a function of the sequence's tokens alone: a sequence whose output was rewound
(preemption replays from its tokens, a step fault forgets it) gets it back by scanning them again.
"""

from __future__ import annotations

from ..sampling_params import ReasoningMarkers


class ReasoningGate:
    """One sequence's reasoning section: where its answer (the grammar's part of the output) starts."""

    def __init__(self, markers: ReasoningMarkers, prompt_ids: list[int]) -> None:
        self.markers = markers
        last = last_marker(prompt_ids, markers)
        self._answer_first = last == "end"
        self._undecided_first = last is None and markers.optional
        self.reset()

    def reset(self) -> None:
        """Back to the start of the output."""
        self.answer_start: int | None = 0 if self._answer_first else None  # output index; None: not yet
        self.undecided = self._undecided_first  # the first output token decides
        self.scanned = 0  # output tokens searched for the end marker

    @property
    def start_token(self) -> int:
        """The token that, first in an undecided output, opens the reasoning section."""
        return self.markers.start[0]

    def scan(self, token_ids: list[int], prompt_len: int, end: int, in_flight: list[int]) -> None:
        """Look at the output tokens not seen yet: ``token_ids[prompt_len:end]`` then ``in_flight``."""
        num_output = end - prompt_len + len(in_flight)
        if self.answer_start is not None or num_output <= self.scanned:
            return
        if self.undecided:
            self.undecided = False
            first = token_ids[prompt_len] if end > prompt_len else in_flight[0]
            if first != self.start_token:
                self.answer_start = 0
                return
        marker = self.markers.end
        # (from m - 1 tokens back: a marker may straddle what was scanned and what is new)
        lo = max(0, prompt_len + self.scanned - (len(marker) - 1))
        window = token_ids[lo:end] + in_flight
        at = find(window, marker)
        if at is not None:
            self.answer_start = lo + at + len(marker) - prompt_len
        self.scanned = num_output


def find(tokens: list[int], marker: tuple[int, ...]) -> int | None:
    """The index of the first occurrence of ``marker`` in ``tokens``, or None."""
    first, m = marker[0], len(marker)
    i = -1
    while True:
        try:
            i = tokens.index(first, i + 1)
        except ValueError:
            return None
        if tuple(tokens[i:i + m]) == marker:
            return i


def last_marker(tokens: list[int], markers: ReasoningMarkers) -> str | None:
    """Which marker occurs last in ``tokens``: "start", "end", or None (neither occurs)."""
    ends = {markers.start[-1], markers.end[-1]}
    for i in range(len(tokens) - 1, -1, -1):  # (once per sequence; a Python loop over the prompt)
        if tokens[i] in ends:
            for name in ("end", "start"):
                marker = getattr(markers, name)
                if i + 1 >= len(marker) and tuple(tokens[i + 1 - len(marker):i + 1]) == marker:
                    return name
    return None
