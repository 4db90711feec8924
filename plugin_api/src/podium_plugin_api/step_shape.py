"""How a platform wants each step shaped: its padding, where logits are computed, where sampling runs.

The core builds each step as a flat ragged batch on the host (``HostBatch``) and asks the
platform's ``StepShaping`` (``Platform.step_shaping()``) what to do with it; it never asks which
kind of device it runs on. The default keeps every shape exact, computes logits only for the rows
that sample and samples on the device: right for devices that run whatever shapes they get (CPU,
CUDA, ROCm). A device that compiles one program per shape (XLA) pads steps to a few bucketed
shapes instead, so the number of compilations stays bounded (``podium_tpu.shaping``).

What a shaping decides, in the order the core asks:

- ``pad(batch)``: an eager step's batch as the device will run it. Padding tokens write nowhere
  (slot -1) and belong to no sequence; padding sequences have no new tokens and no context.
- ``table_width(needed, max_blocks)``: how many block-table columns a step's metadata carries.
- ``graph_batch_sizes(sizes)``: which decode batch sizes the core captures (a replayed decode pads
  itself to the captured size: rows that write nowhere and attend to one stale key).
- ``replay_extent(...)``: how much of a captured step's static inputs each replay copies.
- ``logits_rows(rows, batch)``: the hidden rows whose logits are computed (the sampling ones first).
- ``end_forward()``: called between the model's forward and the logits (XLA cuts its graph there).
- ``sample_on_host``: logits go to the host and are sampled there. Such steps are never deferred
  (async scheduling needs the sampled tokens on the device, where the next step reads them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class HostBatch:
    """One step's flat batch on the host, as int64 numpy arrays (S sequences, T new tokens)::

        token_ids        [T]      the new tokens of every sequence, end to end (-1: a placeholder for
                                  the previous step's token, filled on the device)
        positions        [T]      each token's position in its sequence
        slot_mapping     [T]      each token's cache slot (block id * block size + offset; -1: no write)
        query_start_loc  [S + 1]  cumulative new-token counts
        seq_lens         [S]      each sequence's context including its new tokens
        query_lens       [S]      each sequence's new tokens
        table_rows       [S]      each sequence's row in the runner's block-table array
    """

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    query_lens: np.ndarray
    table_rows: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class StepShaping:
    """Exact shapes, logits of the sampling rows only, sampling on the device. Override to pad."""

    sample_on_host: bool = False

    def pad(self, batch: HostBatch) -> HostBatch:
        """The batch an eager step runs (default: unchanged)."""
        return batch

    def table_width(self, needed: int, max_blocks: int) -> int:
        """Block-table columns of a step whose longest sequence needs ``needed`` blocks (of at most ``max_blocks``)."""
        return needed

    def graph_batch_sizes(self, sizes: list[int]) -> list[int]:
        """The decode batch sizes to capture, given the core's buckets up to the engine's limit."""
        return sizes

    def replay_extent(self, rows: int, width: int, size: int, max_blocks: int) -> tuple[int, int]:
        """(rows, columns) of the block table a replay of a ``size``-row capture copies, for a step of
        ``rows`` sequences needing ``width`` columns. Default: only those (copies of varying size)."""
        return rows, width

    def logits_rows(self, rows: np.ndarray, batch: HostBatch) -> np.ndarray:
        """Hidden rows [N] whose logits the step computes: ``rows`` (the sampling sequences' last
        tokens, in order) first; a shaping may append padding rows (their logits are dropped)."""
        return rows

    def end_forward(self) -> None:
        """Called after the model's forward, before the logits (default: nothing)."""
        return None
