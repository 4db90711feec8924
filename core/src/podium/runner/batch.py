"""A plan's flat batch on the host (positions and slots by vectorised numpy, no per-token Python),
and its attention metadata on the device."""

from __future__ import annotations

import numpy as np
import torch

from podium_plugin_api import AttentionMetadata, HostBatch

from .block_table import BlockTable
from .plan import StepPlan


def host_batch(plan: StepPlan, table: BlockTable, block_size: int) -> HostBatch:
    """The plan's tokens, positions, slots and per-sequence lengths (see ``HostBatch``)."""
    query_lens = np.array(plan.query_lens, dtype=np.int64)  # [S]
    starts = np.array(plan.starts, dtype=np.int64)  # [S]
    rows = np.array(plan.rows, dtype=np.int64)  # [S]
    cu = np.zeros(len(query_lens) + 1, dtype=np.int64)  # [S + 1]
    np.cumsum(query_lens, out=cu[1:])
    # positions [T]: each sequence's new tokens continue from its computed ones
    positions = np.arange(int(cu[-1]), dtype=np.int64) + np.repeat(starts - cu[:-1], query_lens)
    token_rows = np.repeat(rows, query_lens)  # [T]
    slots = table.array[token_rows, positions // block_size].astype(np.int64) * block_size  # [T]
    slots += positions % block_size
    token_ids = np.array(plan.token_ids, dtype=np.int64)  # [T]
    return HostBatch(token_ids, positions, slots, cu, starts + query_lens, query_lens, rows)


def blocks_needed(batch: HostBatch, block_size: int) -> int:
    """Block-table columns the batch's longest sequence reaches."""
    return -(-int(batch.seq_lens.max()) // block_size)


def device_metadata(batch: HostBatch, tables: np.ndarray, device: torch.device) -> AttentionMetadata:
    """The batch's attention metadata on ``device``; ``tables`` [S, W] int32: its block-table rows."""
    return AttentionMetadata(
        query_start_loc=torch.from_numpy(batch.query_start_loc.astype(np.int32)).to(device, non_blocking=True),
        seq_lens=torch.from_numpy(batch.seq_lens.astype(np.int32)).to(device, non_blocking=True),
        block_tables=torch.from_numpy(tables).to(device, non_blocking=True),
        slot_mapping=torch.from_numpy(batch.slot_mapping).to(device, non_blocking=True),
        max_query_len=int(batch.query_lens.max()),
        max_seq_len=int(batch.seq_lens.max()),
        query_lens_host=batch.query_lens.tolist(),
        seq_lens_host=batch.seq_lens.tolist(),
    )
