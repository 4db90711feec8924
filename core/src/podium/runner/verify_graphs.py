"""Captured verify steps (speculative decoding): every row computes its last token and up to k drafts.

A verify step whose sequences all decode (one token plus d <= k drafts each, all sampling) has the
same shape whatever its drafts once each row is padded to q = k + 1 query tokens::

    row i:  [ last, draft 1 .. draft d | pad .. pad ]   positions start_i .. start_i + k
            slots of the real tokens     | -1 (written nowhere)
    seq_lens[i] = start_i + q            (so query j of the row sits at position start_i + j)

So one graph per batch size S (bucketed as the decode graphs are, S * q tokens) replays it: the
static buffers take the step's ids, positions, slots, lengths and block-table rows, and the logits
of row i's first d + 1 query tokens are the step's, in the eager step's order. A padding query
attends to keys past its row's real tokens (stale slots of valid blocks; its output is dropped);
padded rows (S past the step's sequences) have length q, positions 0 .. k and write nowhere. The
block-table buffer has enough extra columns for a row's padding past ``max_model_len``. The graph
reads every per-step quantity from device tensors, so the platform's attention must take ragged
queries from its metadata tensors alone (the CUDA Triton kernels do; a platform whose graphs cover
only one-token rows raises ``GraphCaptureUnsupported`` while capturing, and verify steps stay eager).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from podium_plugin_api import AttentionMetadata, ForwardContext, GraphCaptureUnsupported, GraphRunner, HostBatch

from .graphs import GRAPH_BATCH_SIZES
from .plan import StepPlan

logger = logging.getLogger("podium.runner")
MAX_VERIFY_BATCH = 64  # above this the verify step's own compute dwarfs the launches a replay saves


class VerifyGraphs:
    def __init__(self, decode_graphs) -> None:
        self.base = decode_graphs  # the model, backend, caches, table and shaping it shares
        self.q = 0  # query tokens per row (k + 1); 0: nothing captured
        self.captured: dict[int, tuple[Callable, dict]] = {}
        self.capture_seconds = 0.0

    def size_for(self, plan: StepPlan) -> int | None:
        """The captured size that replays ``plan`` (None: run it eagerly)."""
        if not self.captured or not plan.sample_drafts or plan.fill is not None:
            return None
        n = plan.num_seqs
        if len(plan.samples) != n or any(q != d + 1 or q > self.q for q, d in zip(plan.query_lens, plan.sample_drafts)):
            return None  # a prefill chunk or a row with more drafts than were captured
        return next((size for size in sorted(self.captured) if size >= n), None)

    def capture(self, runner: GraphRunner, k: int, max_batch: int, no_grad) -> float:
        begin = time.perf_counter()
        self.q = k + 1
        if runner.max_batch_size is not None:
            max_batch = min(max_batch, runner.max_batch_size)
        max_batch = min(max_batch, MAX_VERIFY_BATCH)
        sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_batch] or [max_batch]
        try:
            for size in sorted(self.base.shaping.graph_batch_sizes(sizes), reverse=True):
                with no_grad():
                    self.captured[size] = self._capture_one(runner, size)
        except GraphCaptureUnsupported as exc:
            self.captured.clear()
            logger.info("verify steps run eagerly: the platform cannot capture them (%s)", exc)
        self.capture_seconds = time.perf_counter() - begin
        if self.captured:
            logger.info("verify steps of up to %d sequences x %d tokens replay captured graphs (batch sizes %s, "
                        "%.2f s)", max(self.captured), self.q, sorted(self.captured), self.capture_seconds)
        return self.capture_seconds

    def _capture_one(self, runner: GraphRunner, size: int) -> tuple[Callable, dict]:
        base, q = self.base, self.q
        dev, bs = base.device, base.block_size
        width = base.table.max_blocks + -(-q // bs)  # a row's padding may run past max_model_len
        tokens = size * q
        buf = {"input_ids": torch.zeros(tokens, dtype=torch.long, device=dev),
               "positions": (torch.arange(tokens, device=dev) % q),
               "slot_mapping": torch.full((tokens,), -1, dtype=torch.long, device=dev),
               "seq_lens": torch.full((size,), q, dtype=torch.int32, device=dev),
               "query_start_loc": torch.arange(size + 1, dtype=torch.int32, device=dev) * q,
               "block_tables": torch.zeros(size, width, dtype=torch.int32, device=dev)}
        meta = AttentionMetadata(query_start_loc=buf["query_start_loc"], seq_lens=buf["seq_lens"],
                                 block_tables=buf["block_tables"], slot_mapping=buf["slot_mapping"],
                                 max_query_len=q, max_seq_len=width * bs)
        ctx = ForwardContext(base.backend.prepare_metadata(meta), base.kv_caches, base.backend)
        keep, model = base.keep, base.model

        def step() -> tuple[torch.Tensor, torch.Tensor | None]:
            hidden = model(buf["input_ids"], buf["positions"], ctx)  # [size * q, hidden]
            return model.compute_logits(hidden), keep(hidden) if keep is not None else None  # [size * q, V]

        return runner.capture(step), buf

    def replay(self, size: int, batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [sum(d + 1), V] in the eager step's row order, the kept hidden states [T, ...] or None)."""
        replay, buf = self.captured[size]
        base, q, n = self.base, self.q, batch.num_seqs
        lens = batch.query_lens  # [n] = d + 1
        starts = batch.seq_lens - lens
        real = np.arange(q)[None, :] < lens[:, None]  # [n, q]: a row's real tokens come first
        ids = np.zeros((size, q), dtype=np.int64)
        positions = np.tile(np.arange(q, dtype=np.int64), (size, 1))
        positions[:n] += starts[:, None]
        slots = np.full((size, q), -1, dtype=np.int64)
        ids[:n][real], slots[:n][real] = batch.token_ids, batch.slot_mapping
        seq_lens = np.full(size, q, dtype=np.int32)
        seq_lens[:n] = starts + q
        needed = -(-int(seq_lens.max()) // base.block_size)
        width = min(needed, base.table.max_blocks)
        for name, host in (("input_ids", ids), ("positions", positions), ("slot_mapping", slots),
                           ("seq_lens", seq_lens)):
            buf[name].copy_(torch.from_numpy(host.reshape(-1)))
        buf["block_tables"][:n, :width].copy_(torch.from_numpy(base.table.rows(batch.table_rows, width)))
        logits, kept = replay()
        rows = torch.from_numpy(np.flatnonzero(np.concatenate([real, np.zeros((size - n, q), bool)]))).to(
            logits.device, non_blocking=True)  # the real tokens' rows, in order
        logits = logits.index_select(0, rows)
        kept = kept.index_select(0, rows) if kept is not None else None
        return (logits.cpu() if base.shaping.sample_on_host else logits), kept
