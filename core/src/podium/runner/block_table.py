"""The runner's host copy of the running sequences' block tables, kept from the plans alone.

One int32 row per scheduler row (``max_num_seqs`` of them), ``max_blocks`` columns. A plan's
``new_blocks`` entries are written as they come; nothing is ever released: a row's next sequence
is planned from column 0, and a step reads only the columns its sequences' lengths reach (padded
graph rows read a stale but valid block id and write nowhere). A decode step therefore copies no
whole tables, and every rank applying the same plans holds the same array.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, num_rows: int, max_blocks: int) -> None:
        self.array = np.zeros((num_rows, max_blocks), dtype=np.int32)  # [rows, max_blocks]

    @property
    def max_blocks(self) -> int:
        return self.array.shape[1]

    def apply(self, new_blocks: list[tuple[int, int, list[int]]]) -> None:
        """Write a plan's (row, first column, block ids) entries."""
        array = self.array
        for row, first, blocks in new_blocks:
            array[row, first:first + len(blocks)] = blocks

    def rows(self, table_rows: np.ndarray, width: int) -> np.ndarray:
        """[len(table_rows), width] int32: the first ``width`` columns of those rows (a copy)."""
        return self.array[table_rows, :width]
