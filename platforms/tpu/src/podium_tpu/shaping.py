"""Steps padded to bucketed shapes: XLA compiles one program per shape, so shapes must repeat.

Tokens pad to a power of two (at least 16) with token 0, position 0 and slot -1 (no write), owned
by no sequence; sequences pad to a power of two (at least 8) with no new tokens and no context;
block tables to a power of two of columns. So a run compiles at most one step per (tokens,
sequences, columns) bucket. The forward's graph is cut before the logits, which are computed at
the padded sequence count and moved to the host, where sampling runs (a sampler of data-dependent
shapes would compile anew for every batch). Decode graphs are captured at token buckets, and a
replay copies its whole static inputs, so every copy has its bucket's shape too.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from podium_plugin_api import HostBatch, StepShaping

MIN_TOKENS, MIN_SEQS = 16, 8


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


def _padded(values: np.ndarray, extra: int, fill: int) -> np.ndarray:
    return np.concatenate([values, np.full(extra, fill, dtype=values.dtype)]) if extra > 0 else values


class BucketShaping(StepShaping):
    sample_on_host = True

    def __init__(self, cut_graph: Callable[[], None]) -> None:
        self._cut_graph = cut_graph  # the platform's synchronize: compile and run what is pending

    def pad(self, batch: HostBatch) -> HostBatch:
        t_pad = bucket(batch.num_tokens, MIN_TOKENS) - batch.num_tokens
        s_pad = bucket(batch.num_seqs, MIN_SEQS) - batch.num_seqs
        cu = batch.query_start_loc
        return HostBatch(
            token_ids=_padded(batch.token_ids, t_pad, 0),
            positions=_padded(batch.positions, t_pad, 0),
            slot_mapping=_padded(batch.slot_mapping, t_pad, -1),
            query_start_loc=_padded(cu, s_pad, int(cu[-1])),
            seq_lens=_padded(batch.seq_lens, s_pad, 0),
            query_lens=_padded(batch.query_lens, s_pad, 0),
            table_rows=_padded(batch.table_rows, s_pad, 0),
        )

    def table_width(self, needed: int, max_blocks: int) -> int:
        return min(bucket(needed, 1), max_blocks)

    def graph_batch_sizes(self, sizes: list[int]) -> list[int]:
        return sorted({bucket(size, MIN_TOKENS) for size in sizes})

    def replay_extent(self, rows: int, width: int, size: int, max_blocks: int) -> tuple[int, int]:
        return size, max_blocks

    def logits_rows(self, rows: np.ndarray, batch: HostBatch) -> np.ndarray:
        """The sampling rows, then row 0 up to the padded sequence count: one logits shape per bucket."""
        return _padded(rows, batch.num_seqs - len(rows), 0)

    def end_forward(self) -> None:
        self._cut_graph()
