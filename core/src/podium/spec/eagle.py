"""``eagle`` / ``eagle3``: a draft head reads the target's hidden states and drafts k tokens.

The head's cache entry at position i holds (token at i + 1, the target's state at i) (``eagle_head``),
so it can only be written once the target has computed position i and the token after it is known:
after the step. Each step, then:

* after the target's forward, its booking and ``Scheduler.advance`` (``observe``): one head forward
  over the positions each running scheduled sequence computed this step (a prompt chunk; the last
  token and its accepted drafts), the hidden input being the target's kept states of those rows
  (``ModelRunner.keep_hidden``: the last layer's for EAGLE-1, three layers' inputs for EAGLE-3). The
  last row of each sequence that sampled gives draft 1 and the head's predicted state, kept per
  block-table row with the (sequence, position) they belong to;
* after the next plan (``draft``): drafts 2..d, one head forward each, feeding back the head's own
  predicted state (a captured decode graph where the platform has one).

A sequence is offered drafts only while its kept state matches its position (``ready``), so a
sequence just admitted or recomputed decodes once plainly first. Finished sequences are skipped (their
last step's blocks are never cached); every block the prefix cache keeps was mirrored when computed,
so prefix hits, n > 1 and preemption read complete head caches. Drafts are greedy (a deterministic
proposal, see ``verify``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..request import Sequence
from ..runner import StepPlan
from ..scheduler import SchedulerOutput
from .draft_device import DraftDevice


class EagleProposer:
    def __init__(self, device: DraftDevice, method: str, k: int, max_num_seqs: int) -> None:
        self.device, self.method, self.k = device, method, k
        self.head = device.model
        hidden = self.head.hidden_out.shape[1]
        # per block-table row: (seq id, computed tokens) the kept draft 1 and state belong to
        self.anchor: list[tuple[int, int] | None] = [None] * max_num_seqs
        self.first: list[int] = [0] * max_num_seqs
        self.state = torch.zeros(max_num_seqs, hidden, dtype=self.head.hidden_out.dtype,
                                 device=self.head.hidden_out.device)  # [rows, H]

    def ready(self, seq: Sequence) -> bool:
        return self.anchor[seq.table_row] == (seq.seq_id, seq.num_computed_tokens)

    def forget(self, seq: Sequence) -> None:
        """Nothing to drop: a row's next occupant has another seq id."""

    def observe(self, output: SchedulerOutput, hidden: torch.Tensor | None) -> None:
        """Mirror this step's computed positions into the head's cache (module docstring)."""
        if hidden is None:
            return
        rows, starts, lens, tokens, index, samples, sampled = [], [], [], [], [], [], []
        offset = 0
        for s in output.scheduled:
            seq, first = s.seq, offset
            offset += s.num_new_tokens
            if seq.is_finished:
                continue
            count = seq.num_computed_tokens - s.start
            if count <= 0:
                continue
            if seq.num_computed_tokens == len(seq.token_ids) - 1:
                samples.append(len(rows))
                sampled.append(seq)
            rows.append(s.row)
            starts.append(s.start)
            lens.append(count)
            tokens.extend(seq.token_ids[s.start + 1:s.start + count + 1])  # entry i reads the token at i + 1
            index.append(np.arange(first, first + count))
        if not rows:
            return
        picked = torch.from_numpy(np.concatenate(index)).to(hidden.device)
        head = self.head
        head.hidden_in[:len(tokens)].copy_(head.combine(hidden.index_select(0, picked)))
        step = self.device.run(StepPlan(rows, starts, lens, tokens, samples, []))
        if not samples:
            return
        ends = np.cumsum(lens)[samples] - 1  # each sampled sequence's last row
        self.state[torch.tensor([rows[i] for i in samples], device=self.state.device)] = \
            head.hidden_out[torch.from_numpy(ends).to(self.state.device)]
        for seq, token in zip(sampled, step.logits.argmax(dim=-1).tolist()):
            self.anchor[seq.table_row] = (seq.seq_id, seq.num_computed_tokens)
            self.first[seq.table_row] = token

    def draft(self, output: SchedulerOutput) -> None:
        """Fill the reserved ``drafts``: draft 1 kept by ``observe``, then one head forward per draft."""
        drafted = [s for s in output.scheduled if s.drafts]
        if not drafted:
            return
        self.device.take_tables(output)  # the drafts' slots are in the blocks planned this step
        out = [[self.first[s.row]] for s in drafted]
        head, live = self.head, list(range(len(drafted)))
        state = self.state[torch.tensor([s.row for s in drafted], device=self.state.device)]  # [N, H]
        for j in range(1, max(len(s.drafts) for s in drafted)):
            keep = [i for i, n in enumerate(live) if len(drafted[n].drafts) > j]
            if len(keep) < len(live):
                state = state[torch.tensor(keep, device=state.device)]
                live = [live[i] for i in keep]
            head.hidden_in[:len(live)].copy_(state)
            # the entry at the last token's position reads draft j and the state predicted before it
            plan = StepPlan([drafted[n].row for n in live], [drafted[n].start + j - 1 for n in live],
                            [1] * len(live), [out[n][-1] for n in live], list(range(len(live))), [])
            logits = self.device.run(plan).logits
            for n, token in zip(live, logits.argmax(dim=-1).tolist()):
                out[n].append(token)
            state = head.hidden_out[:len(live)].clone()
        for s, tokens in zip(drafted, out):
            s.drafts[:] = tokens
