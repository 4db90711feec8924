"""Captured decode steps: one graph per batch size, replayed from static inputs.

``capture`` records a pure-decode step (the model and its logits) for bucketed batch sizes up to the
engine's limit, with the platform's ``GraphRunner`` (largest first: later captures may reuse its
memory). A decode step of ``n`` sequences replays the smallest captured size ``>= n``: its inputs
arrive in the graph's static buffers by one host -> device copy (``staging``), the rows past ``n``
are padding (slot -1: they write nowhere; length 1: they read one stale but valid key), and the
first ``n`` rows of the logits are the step's. A platform that cannot capture this model's step
says so (``GraphCaptureUnsupported``); every step then runs eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch

from podium_plugin_api import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    GraphCaptureUnsupported,
    GraphRunner,
    HostBatch,
    StepShaping,
)

from .batch import blocks_needed
from .block_table import BlockTable
from .deferred import fill_placeholders
from .plan import StepPlan
from .staging import StagingRing, StepLayout, fill_host

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

logger = logging.getLogger("podium.runner")


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 table: BlockTable, shaping: StepShaping, block_size: int, device: torch.device,
                 pinned_memory: bool) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.table, self.shaping = table, shaping
        self.block_size, self.device = block_size, device
        self.captured: dict[int, tuple[Callable[[], torch.Tensor], dict]] = {}  # size -> (replay, buffers)
        self.staging = StagingRing(device, pinned_memory)  # replayed steps' input copies
        self.capture_seconds = 0.0
        self.keep = None  # ModelRunner.keep_hidden's function: the graphs also output what it keeps

    def size_for(self, batch: int) -> int | None:
        """The smallest captured size that holds ``batch`` sequences (None: run eagerly)."""
        for size in sorted(self.captured):
            if size >= batch:
                return size
        return None

    def capture(self, runner: GraphRunner, max_batch: int, no_grad: Callable[[], AbstractContextManager]) -> float:
        """Capture decode steps for bucketed sizes up to ``max_batch`` and the runner's
        ``max_batch_size``; returns the seconds it took."""
        begin = time.perf_counter()
        if runner.max_batch_size is not None:
            max_batch = min(max_batch, runner.max_batch_size)
        sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_batch]
        if max_batch not in sizes and max_batch <= GRAPH_BATCH_SIZES[-1]:
            sizes.append(max_batch)
        try:
            for size in sorted(self.shaping.graph_batch_sizes(sizes), reverse=True):
                with no_grad():
                    self.captured[size] = self._capture_one(runner, size)
        except GraphCaptureUnsupported as exc:
            self.captured.clear()
            logger.info("decode steps run eagerly: the platform cannot capture this model's step (%s)", exc)
        self.capture_seconds = time.perf_counter() - begin
        if self.captured:
            logger.info("decode steps of up to %d sequences replay captured graphs (batch sizes %s, captured in "
                        "%.2f s)", max(self.captured), sorted(self.captured), self.capture_seconds)
        return self.capture_seconds

    def _capture_one(self, runner: GraphRunner, size: int) -> tuple[Callable[[], torch.Tensor], dict]:
        dev, max_blocks = self.device, self.table.max_blocks
        layout = StepLayout(size, max_blocks)  # the static inputs are slices of one region a single copy fills
        region = torch.zeros(layout.numel, dtype=torch.long, device=dev)
        buf = {"layout": layout, "region": region, **layout.views(region)}
        buf["slot_mapping"].fill_(-1)
        buf["seq_lens"].fill_(1)
        buf["query_start_loc"] = torch.arange(size + 1, dtype=torch.int32, device=dev)
        buf["block_tables"] = torch.zeros(size, max_blocks, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            query_start_loc=buf["query_start_loc"], seq_lens=buf["seq_lens"], block_tables=buf["block_tables"],
            slot_mapping=buf["slot_mapping"], max_query_len=1, max_seq_len=max_blocks * self.block_size,
        )
        ctx = ForwardContext(self.backend.prepare_metadata(meta), self.kv_caches, self.backend)

        keep = self.keep

        def step() -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden = self.model(buf["input_ids"], buf["positions"], ctx)  # [size, hidden]
            return self.model.compute_logits(hidden), keep(hidden) if keep is not None else None  # [size, V]

        return runner.capture(step), buf

    def replay(self, size: int, plan: StepPlan, batch: HostBatch,
               feed_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All ``size`` rows of logits [size, V] of the decode step (the first ``batch.num_seqs`` are
        its sequences'; on the host where the shaping samples there) and of the kept hidden states
        (None without ``keep``)."""
        replay, buf = self.captured[size]
        n, layout = batch.num_seqs, buf["layout"]
        # only the columns this step reads (unless the shaping wants whole copies): stale entries
        # beyond them are never read
        rows, width = self.shaping.replay_extent(n, blocks_needed(batch, self.block_size), size,
                                                 self.table.max_blocks)
        tables = self.table.rows(batch.table_rows, width)  # [n, width]
        if rows > n:
            tables = np.concatenate([tables, np.zeros((rows - n, width), dtype=tables.dtype)])
        used = layout.used(rows, width)
        slot, host = self.staging.take(used)
        fill_host(layout, host, batch.token_ids, batch.positions, batch.slot_mapping, batch.seq_lens, tables,
                  plan.fill)
        self.staging.copy(slot, buf["region"], used)
        buf["block_tables"][:rows, :width].copy_(buf["table"][:rows * width].view(rows, width))
        if plan.fill is not None:  # placeholders: the previous step's tokens, still on the device
            k = len(plan.fill[0])
            fill_placeholders(buf["input_ids"], (buf["fill_dst"][:k], buf["fill_src"][:k]), feed_tokens)
        logits, kept = replay()
        return (logits.cpu() if self.shaping.sample_on_host else logits), kept
