"""What a draft model's KV cache holds: per sequence, how far it is the sequence's own; per slot,
whether it matches the target's token there.

The draft shares the target's blocks (``draft_device``). Each step the draft catches up on the
tokens the target computes (prompt chunks, the last sampled token) before it drafts, so its cache
trails the target's by at most the last draft of a step whose drafts were all accepted (the target
computed it, the draft never fed it). That gap closes at the sequence's next step, unless the
sequence leaves first (finished or preempted) while the gap sits in a block the prefix cache keeps:
a later prefix hit on that block would then read one slot the draft never wrote.

``valid`` marks, per slot, whether the draft's K/V there is what the draft computes for the token
the target holds there: every slot the target writes in a step is marked stale, then every slot the
draft writes for a true (or accepted) token valid. A sequence admitted with prefix hits starts its
draft cache at its first stale slot, so the draft recomputes from there (into shared blocks: the
same tokens give the same K/V). Draft outputs never depend on this being right; acceptance does.
"""

from __future__ import annotations

import numpy as np

from ..request import Sequence


def span_slots(table: np.ndarray, rows, starts, lens, block_size: int) -> np.ndarray:
    """Slots [sum(lens)] of positions starts[i] .. starts[i] + lens[i] - 1 of table rows ``rows``."""
    lens = np.asarray(lens, dtype=np.int64)
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    positions = np.arange(int(cu[-1]), dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - cu[:-1], lens)
    token_rows = np.repeat(np.asarray(rows, dtype=np.int64), lens)
    return table[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


class DraftCacheState:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.valid = np.zeros(num_blocks * block_size, dtype=bool)  # [slots]
        # seq id -> the draft's K/V is the sequence's own at positions [0, n), where its tokens there
        # are the ones the draft fed (an accepted draft is; a rejected one is past the target's count)
        self.written: dict[int, int] = {}

    def admit(self, seq: Sequence) -> None:
        """``seq`` was (re)admitted with ``num_computed_tokens`` prefix-cache hits (whole blocks): its
        draft cache is its own up to the first stale slot of those blocks."""
        size = self.block_size
        blocks = np.asarray(seq.block_table[:seq.num_computed_tokens // size], dtype=np.int64)
        fresh = self.valid[(blocks[:, None] * size + np.arange(size)).reshape(-1)]
        stale = np.flatnonzero(~fresh)
        self.written[seq.seq_id] = int(stale[0]) if len(stale) else len(fresh)

    def start(self, seq: Sequence, computed: int) -> int:
        """The first position the draft has to (re)compute; ``computed``: the target's count."""
        return min(self.written.get(seq.seq_id, 0), computed)

    def forget(self, seq: Sequence) -> None:
        self.written.pop(seq.seq_id, None)
