"""A step run eagerly: the host batch (as the platform shapes it) to the device, the model, the logits."""

from __future__ import annotations

import numpy as np
import torch

from podium_plugin_api import AttentionBackend, ForwardContext, HostBatch, StepShaping

from .batch import blocks_needed, device_metadata
from .block_table import BlockTable
from .deferred import fill_placeholders
from .plan import StepPlan


class EagerStep:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 table: BlockTable, shaping: StepShaping, block_size: int, device: torch.device) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.table, self.shaping = table, shaping
        self.block_size, self.device = block_size, device
        self.keep = None  # ModelRunner.keep_hidden's function, or None

    def run(self, plan: StepPlan, batch: HostBatch,
            feed_tokens: torch.Tensor | None) -> tuple[torch.Tensor | None, list[torch.Tensor], torch.Tensor | None]:
        """(logits [N, V] of the sampling sequences in ``plan.samples`` order or None, prompt logits
        [rows, V] per ``plan.prompt_spans`` entry, the kept hidden states [T, ...] or None); the
        logits on the host where the shaping samples there."""
        hidden, shaped = self.forward(plan, batch, feed_tokens)
        kept = self.keep(hidden)[:plan.num_tokens] if self.keep is not None else None
        logits = self._sampling_logits(hidden, plan, batch, shaped)
        prompt = [self._to_sampler(self.model.compute_logits(hidden[lo:hi])) for _, lo, hi in plan.prompt_spans]
        return logits, prompt, kept

    def forward(self, plan: StepPlan, batch: HostBatch,
                feed_tokens: torch.Tensor | None) -> tuple[torch.Tensor, HostBatch]:
        """(the model's hidden states [T', hidden], the batch as shaped): the plan's T tokens come
        first, then any padding the platform's shaping added."""
        shaped = self.shaping.pad(batch)  # the real sequences and tokens stay first
        width = self.shaping.table_width(blocks_needed(shaped, self.block_size), self.table.max_blocks)
        meta = device_metadata(shaped, self.table.rows(shaped.table_rows, width), self.device)
        ctx = ForwardContext(self.backend.prepare_metadata(meta), self.kv_caches, self.backend)
        input_ids = torch.from_numpy(shaped.token_ids).to(self.device, non_blocking=True)  # [T]
        if plan.fill is not None:
            fill_placeholders(input_ids, plan.fill, feed_tokens)
        positions = torch.from_numpy(shaped.positions).to(self.device, non_blocking=True)  # [T]
        hidden = self.model(input_ids, positions, ctx)  # [T, hidden]
        self.shaping.end_forward()
        return hidden, shaped

    def _sampling_logits(self, hidden: torch.Tensor, plan: StepPlan, batch: HostBatch,
                         shaped: HostBatch) -> torch.Tensor | None:
        if not plan.samples:
            return None
        last = batch.query_start_loc[1:][plan.samples] - 1  # [N] each sampling sequence's last token
        if plan.sample_drafts:  # [sum(d + 1)]: a verifying sequence's last d + 1 rows, in order
            last = draft_rows(last, np.asarray(plan.sample_drafts, dtype=np.int64))
        rows = self.shaping.logits_rows(last, shaped)  # [>= N]
        index = torch.from_numpy(np.ascontiguousarray(rows)).to(self.device, non_blocking=True)
        logits = self._to_sampler(self.model.compute_logits(hidden[index]))  # [>= N, V]
        return logits if len(rows) == len(last) else logits[:len(last)]

    def _to_sampler(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.cpu() if self.shaping.sample_on_host else logits


def draft_rows(last: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """[N] last rows, [N] draft counts d -> [sum(d + 1)]: rows last - d .. last of each, in order."""
    counts = drafts + 1
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(last - drafts, counts) + within
