"""Turns a scheduler plan into one flat batch, runs the model, samples.

Per step the runner builds, for the T new tokens of the S scheduled sequences::

    input_ids [T], positions [T], slot_mapping [T]          (flat, sequences end to end)
    query_start_loc [S+1], seq_lens [S], block_tables [S, W] (per sequence)

Block tables live in a persistent host array with one row per running sequence; a row is
updated only when its sequence gains blocks, so a decode step copies no whole tables. Positions
and slots are computed with vectorised numpy, not per-token Python. Logits are computed only for
the rows that sample (the last token of each sequence that has caught up with its tokens).

Pure-decode steps whose batch fits a captured size replay a captured graph (when the platform
can capture): inputs arrive in its static buffers by one host -> device copy (``step_staging``),
padded rows write nowhere (slot -1).

Async scheduling: ``execute(plan, feed=previous, defer=True)`` returns a ``LaunchedStep`` whose
tokens are still being computed; a token the previous step sampled but the host has not read yet
(a -1 placeholder in ``token_ids``) is taken on the device from ``feed.tokens``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from podium_plugin_api import AttentionMetadata, GraphCaptureUnsupported, Platform

from .models.context import ForwardContext
from .request import Sequence
from .scheduler import SchedulerOutput
from .step_staging import StagingRing, StepLayout, fill_host

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

logger = logging.getLogger("podium.runner")


@dataclass
class StepResult:
    sampled: list[tuple[Sequence, int]]  # (sequence, new token id)
    logprobs: list  # per sampled row: PositionLogprobs | None
    prompt_logprobs: dict[int, list]  # seq_id -> prompt logprob entries computed this step
    num_tokens: int
    used_graph: bool


@dataclass
class LaunchedStep:
    """A step whose sampled tokens [N] are on the device; ``result()`` waits for them."""

    seqs: list[Sequence]  # the sequences that sampled, in row order
    tokens: torch.Tensor  # [N] long, on the device: the next step's inputs read it there
    host: torch.Tensor  # [N] long on the host, filled by a non-blocking copy
    ready: Any  # an event recorded after that copy (None: ``host`` is already valid)
    num_tokens: int
    used_graph: bool
    rows: dict[int, int] = field(default_factory=dict)  # seq_id -> row of ``tokens``
    indices: list[int] = field(default_factory=list)  # where each token goes in its seq's token_ids

    def result(self) -> StepResult:
        if self.ready is not None:
            self.ready.synchronize()
        ids = self.host.tolist()
        return StepResult(list(zip(self.seqs, ids)), [None] * len(ids), {}, self.num_tokens, self.used_graph)


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


def pad_to_buckets(tokens, positions, slots, cu, seq_lens, rows, query_lens):
    """Pad a step to bucketed shapes for static-shape platforms (XLA).

    Tokens pad to a power of two (>= 16) with token 0, position 0, slot -1 (no write), owned by no
    sequence; sequences pad to a power of two (>= 8) with query_len 0 and seq_len 0.
    """
    n_tok, n_seq = len(tokens), len(seq_lens)
    t_pad, s_pad = bucket(n_tok, 16) - n_tok, bucket(n_seq, 8) - n_seq
    tokens = list(tokens) + [0] * t_pad
    positions = np.concatenate([positions, np.zeros(t_pad, dtype=positions.dtype)])
    slots = np.concatenate([slots, np.full(t_pad, -1, dtype=slots.dtype)])
    cu = np.concatenate([cu, np.full(s_pad, cu[-1], dtype=cu.dtype)])
    seq_lens = np.concatenate([seq_lens, np.zeros(s_pad, dtype=seq_lens.dtype)])
    rows = np.concatenate([rows, np.zeros(s_pad, dtype=rows.dtype)])
    query_lens = np.concatenate([query_lens, np.zeros(s_pad, dtype=query_lens.dtype)])
    return tokens, positions, slots, cu, seq_lens, rows, query_lens


def grad_off(platform: Platform):
    """torch.inference_mode where the platform supports it, torch.no_grad where not (torch_xla)."""
    return torch.inference_mode() if platform.capabilities().inference_mode else torch.no_grad()


class BlockTableRows:
    """A persistent [rows, max_blocks] int32 host array holding each running sequence's block table."""

    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.table = np.zeros((num_rows, max_blocks), dtype=np.int32)
        self._row: dict[int, int] = {}  # seq_id -> row
        self._synced: dict[int, int] = {}  # seq_id -> how many entries of its table are written
        self._free = list(range(num_rows - 1, -1, -1))

    def row_for(self, seq: Sequence) -> int:
        row = self._row.get(seq.seq_id)
        if row is None:
            if not self._free:
                raise RuntimeError("more running sequences than block-table rows; max_num_seqs is too small")
            row = self._row[seq.seq_id] = self._free.pop()
            self._synced[seq.seq_id] = 0
        synced, table = self._synced[seq.seq_id], seq.block_table
        if synced != len(table):
            if synced > len(table):  # the table was rebuilt (preemption): rewrite it
                synced = 0
            self.table[row, synced:len(table)] = table[synced:]
            self._synced[seq.seq_id] = len(table)
        return row

    def release(self, seq_id: int) -> None:
        row = self._row.pop(seq_id, None)
        if row is not None:
            self._synced.pop(seq_id, None)
            self._free.append(row)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        platform: Platform,
        kv_caches: list[torch.Tensor],
        sampler,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model, self.platform, self.kv_caches, self.sampler = model, platform, kv_caches, sampler
        self.backend = platform.attention_backend()
        self.block_size, self.device = block_size, device
        self.max_blocks = -(-max_model_len // block_size)
        self.rows = BlockTableRows(max_num_seqs, self.max_blocks)
        self.graphs: dict[int, tuple] = {}  # batch size -> (replay, static buffers)
        self.static_shapes = platform.capabilities().static_shapes
        self.capture_seconds = 0.0
        self.last_used_graph = False
        self.staging = StagingRing(device, platform.capabilities().pinned_memory)  # replayed steps' input copies

    def release(self, seq: Sequence) -> None:
        """Forget a finished or preempted sequence's row."""
        self.rows.release(seq.seq_id)

    # -- batch building ------------------------------------------------------------------------
    def _host_batch(self, plan: SchedulerOutput):
        scheduled = plan.scheduled
        n = len(scheduled)
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=n)
        starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=n)
        rows = np.fromiter((self.rows.row_for(s.seq) for s in scheduled), dtype=np.int64, count=n)
        if int(query_lens.max()) == 1:
            tokens = [s.seq.token_ids[s.start] for s in scheduled]
        else:
            tokens = []
            for s in scheduled:
                tokens.extend(s.seq.token_ids[s.start:s.start + s.num_new_tokens])
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        # positions [T]: each sequence's new tokens continue from its computed ones
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - cu[:-1], query_lens)
        token_rows = np.repeat(rows, query_lens)
        slots = self.rows.table[token_rows, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size
        seq_lens = starts + query_lens
        return tokens, positions, slots, cu, seq_lens, rows, query_lens

    def _metadata(self, cu, seq_lens, rows, slots, query_lens) -> AttentionMetadata:
        width = -(-int(seq_lens.max()) // self.block_size)
        if self.static_shapes:
            width = min(bucket(width, 1), self.max_blocks)
        dev = self.device
        return AttentionMetadata(
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(self.rows.table[rows, :width]).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_lens_host=query_lens.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )

    # -- execution -----------------------------------------------------------------------------
    def execute(self, plan: SchedulerOutput, feed: LaunchedStep | None = None,
                defer: bool = False) -> StepResult | LaunchedStep:
        """Run ``plan``. ``feed``: the previous step, if its tokens are not read yet (placeholders
        in this plan take them on the device). ``defer``: return a ``LaunchedStep`` without waiting
        for this step's tokens (the sampler must ``can_defer`` them; no prompt logprobs)."""
        with grad_off(self.platform):
            return self._execute(plan, feed, defer)

    def _placeholder_fill(self, plan: SchedulerOutput, tokens: list[int], query_lens: np.ndarray,
                          feed: LaunchedStep | None) -> tuple[list[int], list[int]] | None:
        """(destination rows of input_ids, source rows of feed.tokens) for placeholder tokens."""
        if feed is None:
            return None
        dst = [i for i, t in enumerate(tokens) if t < 0]
        if not dst:
            return None
        if len(tokens) == len(plan.scheduled):  # one token per sequence
            owners = dst
        else:
            owners = np.repeat(np.arange(len(plan.scheduled)), query_lens)[dst].tolist()
        return dst, [feed.rows[plan.scheduled[i].seq.seq_id] for i in owners]

    def _fill_on_device(self, input_ids: torch.Tensor, fill, feed: LaunchedStep) -> None:
        """input_ids[dst] = feed.tokens[src], on the device (the previous step's tokens stay there);
        ``fill``: (dst, src) as host lists, or as index tensors already on the device."""
        dst, src = (x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.long).to(
            self.device, non_blocking=True) for x in fill)
        input_ids.index_copy_(0, dst, feed.tokens.index_select(0, src))

    def _execute(self, plan: SchedulerOutput, feed: LaunchedStep | None, defer: bool) -> StepResult | LaunchedStep:
        tokens, positions, slots, cu, seq_lens, rows, query_lens = self._host_batch(plan)
        fill = self._placeholder_fill(plan, tokens, query_lens, feed)
        if fill is None and feed is None and tokens and min(tokens) < 0:
            raise RuntimeError("a placeholder token without the step that produces it")
        if self.static_shapes:
            tokens, positions, slots, cu, seq_lens, rows, query_lens = pad_to_buckets(
                tokens, positions, slots, cu, seq_lens, rows, query_lens)
        sample_idx = [i for i, s in enumerate(plan.scheduled) if s.samples]
        graph_size = self._graph_size(len(tokens)) if int(query_lens.max()) == 1 else None
        if graph_size is not None:
            logits = self._replay(graph_size, tokens, positions, slots, seq_lens, rows, fill, feed)
            logits = logits.cpu() if self.static_shapes else logits
            if len(sample_idx) != len(plan.scheduled):
                logits = logits[torch.tensor(sample_idx).to(logits.device, non_blocking=True)]
        else:
            meta = self.backend.prepare_metadata(self._metadata(cu, seq_lens, rows, slots, query_lens))
            ctx = ForwardContext(meta, self.kv_caches, self.backend)
            input_ids = torch.tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True)
            if fill is not None:
                self._fill_on_device(input_ids, fill, feed)
            pos = torch.from_numpy(positions).to(self.device, non_blocking=True)
            hidden = self.model(input_ids, pos, ctx)
            if self.static_shapes:  # one graph per bucket: cut here, then logits at the padded row count
                self.platform.synchronize()
                last = np.zeros(len(seq_lens), dtype=np.int64)  # [S_pad]
                last[:len(sample_idx)] = cu[1:][sample_idx] - 1
                last_rows = torch.from_numpy(last).to(self.device)
                logits = self.model.compute_logits(hidden[last_rows]).cpu()[:len(sample_idx)] if sample_idx else None
            else:
                last = torch.from_numpy(cu[1:][sample_idx] - 1).to(self.device, non_blocking=True)
                logits = self.model.compute_logits(hidden[last]) if sample_idx else None
            prompt_lp = self._prompt_logprobs(plan, hidden, cu)
        self.last_used_graph = graph_size is not None
        seqs = [plan.scheduled[i].seq for i in sample_idx]
        if defer:
            return self._launched(logits, seqs, len(tokens), graph_size is not None)
        if seqs:
            out = self.sampler.sample(logits, seqs)
            sampled, logprobs = list(zip(seqs, out.token_ids)), out.logprobs
        else:
            sampled, logprobs = [], []
        return StepResult(sampled, logprobs, {} if graph_size is not None else prompt_lp, len(tokens),
                          graph_size is not None)

    def _launched(self, logits, seqs: list[Sequence], num_tokens: int, used_graph: bool) -> LaunchedStep:
        if seqs:
            tokens = self.sampler.sample_device(logits, seqs)  # [N] long, on the device
        else:
            tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        if tokens.device.type == "cpu":
            host, ready = tokens, None
        else:  # start the copy now; the host waits for it only when it reads the tokens
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.Event(device=tokens.device)
            ready.record()
        return LaunchedStep(seqs, tokens, host, ready, num_tokens, used_graph,
                            rows={seq.seq_id: i for i, seq in enumerate(seqs)})

    def _prompt_logprobs(self, plan: SchedulerOutput, hidden: torch.Tensor, cu: np.ndarray) -> dict[int, list]:
        """Logprobs of prompt tokens computed this step, for sequences that asked for them."""
        result: dict[int, list] = {}
        for i, s in enumerate(plan.scheduled):
            k = s.seq.params.prompt_logprobs
            if k is None:
                continue
            seq, start = s.seq, s.start
            if start >= seq.num_prompt_tokens or seq.sample_index != 0 or seq.num_output_tokens:
                continue  # (after a preemption the prompt's logprobs are already known)
            end = min(start + s.num_new_tokens, seq.num_prompt_tokens)
            # hidden at position p predicts token p + 1
            lo, hi = int(cu[i]), int(cu[i]) + (end - start)
            logits = self.model.compute_logits(hidden[lo:hi])
            targets = seq.prompt_token_ids[start + 1:end + 1]
            entries = self.sampler.prompt_logprobs(logits[: len(targets)], targets, k)
            result[seq.seq_id] = ([None] if start == 0 else []) + entries
        return result

    # -- graphs --------------------------------------------------------------------------------
    def _graph_size(self, batch: int) -> int | None:
        for size in sorted(self.graphs):
            if size >= batch:
                return size
        return None

    def capture_graphs(self, max_batch: int) -> float:
        """Capture pure-decode steps for bucketed batch sizes up to ``max_batch`` (and the runner's
        ``max_batch_size``); returns seconds. A platform that cannot capture this model's step says so
        (``GraphCaptureUnsupported``): every step then runs eagerly."""
        runner = self.platform.graph_runner()
        if runner is None:
            return 0.0
        begin = time.perf_counter()
        if runner.max_batch_size is not None:
            max_batch = min(max_batch, runner.max_batch_size)
        sizes = [b for b in GRAPH_BATCH_SIZES if b <= max_batch]
        if max_batch not in sizes and max_batch <= GRAPH_BATCH_SIZES[-1]:
            sizes.append(max_batch)
        if self.static_shapes:  # padded decode steps only come in token buckets
            sizes = sorted({bucket(b, 16) for b in sizes})
        try:
            for size in sorted(sizes, reverse=True):  # largest first: later captures reuse its pool
                self.graphs[size] = self._capture_one(runner, size)
        except GraphCaptureUnsupported as exc:
            self.graphs.clear()
            logger.info("decode steps run eagerly: the platform cannot capture this model's step (%s)", exc)
        self.platform.synchronize()
        self.capture_seconds = time.perf_counter() - begin
        if self.graphs:
            logger.info("decode steps of up to %d sequences replay captured graphs (batch sizes %s, captured in "
                        "%.2f s)", max(self.graphs), sorted(self.graphs), self.capture_seconds)
        return self.capture_seconds

    def _capture_one(self, runner, size: int):
        with grad_off(self.platform):
            return self._capture_one_inner(runner, size)

    def _capture_one_inner(self, runner, size: int):
        dev = self.device
        if self.static_shapes:
            buf = {
                "input_ids": torch.zeros(size, dtype=torch.long, device=dev),
                "positions": torch.zeros(size, dtype=torch.long, device=dev),
                "slot_mapping": torch.full((size,), -1, dtype=torch.long, device=dev),
                "seq_lens": torch.ones(size, dtype=torch.int32, device=dev),
            }
        else:  # the static inputs are slices of one region a single copy fills (step_staging)
            layout = StepLayout(size, self.max_blocks)
            region = torch.zeros(layout.numel, dtype=torch.long, device=dev)
            buf = {"layout": layout, "region": region, **layout.views(region)}
            buf["slot_mapping"].fill_(-1)
            buf["seq_lens"].fill_(1)
        buf["query_start_loc"] = torch.arange(size + 1, dtype=torch.int32, device=dev)
        buf["block_tables"] = torch.zeros(size, self.max_blocks, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            query_start_loc=buf["query_start_loc"], seq_lens=buf["seq_lens"], block_tables=buf["block_tables"],
            slot_mapping=buf["slot_mapping"], max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
        )
        meta = self.backend.prepare_metadata(meta)
        ctx = ForwardContext(meta, self.kv_caches, self.backend)

        def step():
            hidden = self.model(buf["input_ids"], buf["positions"], ctx)
            return self.model.compute_logits(hidden)

        return runner.capture(step), buf

    def _replay(self, size, tokens, positions, slots, seq_lens, rows, fill=None, feed=None) -> torch.Tensor:
        replay, buf = self.graphs[size]
        if self.static_shapes:
            self._stage_padded(buf, size, tokens, positions, slots, seq_lens, rows, fill, feed)
            return replay()[:len(tokens)]
        n, layout = len(tokens), buf["layout"]
        # only the columns this step reads; stale entries beyond them are never read, and padded
        # rows (seq_len 1, slot -1) read a stale but valid block id and write nothing
        width = -(-int(seq_lens.max()) // self.block_size)
        used = layout.used(n, width)
        slot, host = self.staging.take(used)
        fill_host(layout, host, tokens, positions, slots, seq_lens, self.rows.table[rows, :width], fill)
        self.staging.copy(slot, buf["region"], used)
        buf["block_tables"][:n, :width].copy_(buf["table"][:n * width].view(n, width))
        if fill is not None:  # placeholders: the previous step's tokens, still on the device
            k = len(fill[0])
            self._fill_on_device(buf["input_ids"], (buf["fill_dst"][:k], buf["fill_src"][:k]), feed)
        return replay()[:n]

    def _stage_padded(self, buf, size, tokens, positions, slots, seq_lens, rows, fill, feed) -> None:
        """Static-shape platforms (XLA): every copy has the bucket's shape, so nothing recompiles."""
        n = len(tokens)
        host = np.zeros((4, size), dtype=np.int64)
        host[0, :n], host[1, :n] = tokens, positions
        host[2, :], host[2, :n] = -1, slots
        host[3, :], host[3, :n] = 1, seq_lens
        staged = torch.from_numpy(host).to(self.device, non_blocking=True)
        buf["input_ids"].copy_(staged[0])
        if fill is not None:
            self._fill_on_device(buf["input_ids"], fill, feed)
        buf["positions"].copy_(staged[1])
        buf["slot_mapping"].copy_(staged[2])
        buf["seq_lens"].copy_(staged[3])
        table = torch.from_numpy(self.rows.table[rows, :self.max_blocks]).to(self.device, non_blocking=True)
        buf["block_tables"].copy_(torch.nn.functional.pad(table, (0, 0, 0, size - n)))
