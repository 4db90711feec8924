"""The step plan: what every rank's runner executes, as plain ints (picklable, no sequence objects).

The scheduler's output (``SchedulerOutput``) holds the engine's ``Sequence`` objects; the runner
needs only numbers. ``plan_step`` turns one into a ``StepPlan`` in a single pass over the scheduled
sequences: for each its block-table row, computed tokens and new tokens; the new tokens themselves;
which sequences sample; the block-table entries gained since the last plan; where placeholders
take the previous step's tokens; which hidden rows prompt logprobs need. With tensor parallelism
rank 0 builds it and sends it to the other ranks as it is (see ``model_runner``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..scheduler import SchedulerOutput


@dataclass(slots=True)
class StepPlan:
    """One step for the runner (S scheduled sequences, T new tokens)."""

    rows: list[int]  # [S] each sequence's block-table row
    starts: list[int]  # [S] its tokens already computed: its new tokens start at this position
    query_lens: list[int]  # [S] its new tokens this step
    token_ids: list[int]  # [T] the new tokens, sequences end to end (-1: a placeholder, see ``fill``)
    samples: list[int]  # indices into S of the sequences that sample a token after this step
    new_blocks: list[tuple[int, int, list[int]]]  # (row, first column, block ids) the tables gained
    # placeholders: (index into token_ids, row of the previous step's sampled tokens) lists, or None
    fill: tuple[list[int], list[int]] | None = None
    # (sequence index, first hidden row, end row): rows whose logits prompt logprobs need
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # speculative decoding: per entry of ``samples``, its draft tokens at the end of its new tokens;
    # each needs the logits of its last len + 1 rows (empty: no sequence verifies drafts)
    sample_drafts: list[int] = field(default_factory=list)
    # LoRA (podium.lora): each sequence's adapter slot (-1: none; None: no sequence has an adapter),
    # and the (slot, AdapterRef) pairs to write into the device's slots before this step
    lora_slots: list[int] | None = None
    lora_loads: list = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence computes one token."""
        return len(self.token_ids) == len(self.rows)


def plan_step(output: SchedulerOutput, feed_rows: dict[int, int] | None = None) -> StepPlan:
    """The runner's plan of ``output``. ``feed_rows``: seq id -> row of the previous (in-flight)
    step's sampled tokens, where this step's placeholders take them; None when no step is in flight."""
    rows, starts, lens, tokens, samples, new_blocks = [], [], [], [], [], []
    fill_dst: list[int] = []
    fill_src: list[int] = []
    prompt_spans: list[tuple[int, int, int]] = []
    drafted = False
    for i, s in enumerate(output.scheduled):
        seq, start, n = s.seq, s.start, s.num_new_tokens
        rows.append(s.row)
        starts.append(start)
        lens.append(n)
        first = len(tokens)
        if n == 1:
            tokens.append(seq.token_ids[start])
        elif s.drafts:  # the sequence's last token, then its drafts (not in token_ids)
            tokens.append(seq.token_ids[start])
            tokens.extend(s.drafts)
            drafted = True
        else:
            tokens.extend(seq.token_ids[start:start + n])
        if tokens[-1] < 0:  # placeholders only ever end a sequence's tokens
            _placeholders(tokens, first, seq.seq_id, feed_rows, fill_dst, fill_src)
        if s.samples:
            samples.append(i)
        if s.new_blocks:
            new_blocks.append((s.row, s.first_new_block, s.new_blocks))
        if seq.params.prompt_logprobs is not None:
            _prompt_span(i, s, first, prompt_spans)
    fill = (fill_dst, fill_src) if fill_dst else None
    drafts = [len(output.scheduled[i].drafts) for i in samples] if drafted else []
    return StepPlan(rows, starts, lens, tokens, samples, new_blocks, fill, prompt_spans, drafts,
                    _lora_slots(output), output.lora_loads)


def _lora_slots(output: SchedulerOutput) -> list[int] | None:
    """Each scheduled sequence's adapter slot, or None when none of them has one."""
    if not output.lora_active:
        return None
    slots = [s.seq.lora_slot for s in output.scheduled]
    return slots if max(slots) >= 0 else None


def _placeholders(tokens: list[int], first: int, seq_id: int, feed_rows: dict[int, int] | None,
                  dst: list[int], src: list[int]) -> None:
    if feed_rows is None or seq_id not in feed_rows:
        raise RuntimeError(f"sequence {seq_id} has a placeholder token without the step that produces it")
    row = feed_rows[seq_id]
    for index in range(first, len(tokens)):
        if tokens[index] < 0:
            dst.append(index)
            src.append(row)


def _prompt_span(index: int, s, first: int, spans: list[tuple[int, int, int]]) -> None:
    """The hidden rows of the prompt tokens ``s`` computes, if its prompt logprobs are still owed."""
    seq, start = s.seq, s.start
    if start >= seq.num_prompt_tokens or seq.sample_index != 0 or seq.num_output_tokens:
        return  # (after a preemption the prompt's logprobs are already known)
    end = min(start + s.num_new_tokens, seq.num_prompt_tokens)
    spans.append((index, first, first + end - start))
