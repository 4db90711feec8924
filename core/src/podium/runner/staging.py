"""One host -> device copy for a replayed decode step's inputs.

A captured decode graph reads static device buffers. Filling them one tensor at a time costs a
step about a dozen small copies and casts between graph replays, each a launch on the device's
critical path at batch 1. Instead each graph size owns one int64 device region whose slices *are*
its static buffers, laid out as::

    [ input_ids | positions | slot_mapping | fill_dst | fill_src | seq_lens (int32 pairs) | block rows (int32 pairs) ]
      size        size        size           size       size       ceil(size / 2)           ceil(rows * width / 2)

The host writes the same layout into a staging buffer and one copy moves the used prefix; then the
step's block-table rows ([rows, width], packed) are copied into the graph's [size, max_blocks]
table and the placeholder tokens are filled from the previous step's tokens (``fill_dst`` rows of
``input_ids`` take ``fill_src`` rows of its tokens).

Host buffers come in pairs used in turn and are pinned (page-locked) where the platform says its
device can copy from such memory (``Capabilities.pinned_memory``), so the copy is asynchronous;
before a buffer is rewritten the host waits for the event recorded after its last copy (two steps
ago), so no pending copy ever reads bytes the host is changing.
"""

from __future__ import annotations

import numpy as np
import torch

FIELDS = ("input_ids", "positions", "slot_mapping", "fill_dst", "fill_src")


def _pairs(n: int) -> int:
    """int64 slots holding n int32 values."""
    return (n + 1) // 2


class StepLayout:
    """Offsets (in int64 elements) of one graph size's inputs inside its region."""

    def __init__(self, size: int, max_blocks: int) -> None:
        self.size, self.max_blocks = size, max_blocks
        self.seq_lens_at = len(FIELDS) * size
        self.table_at = self.seq_lens_at + _pairs(size)
        self.numel = self.table_at + _pairs(size * max_blocks)

    def used(self, rows: int, width: int) -> int:
        return self.table_at + _pairs(rows * width)

    def views(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named slices of ``region`` (int64 [numel], device or host)."""
        size = self.size
        out = {name: region[i * size:(i + 1) * size] for i, name in enumerate(FIELDS)}
        out["seq_lens"] = region[self.seq_lens_at:self.table_at].view(torch.int32)[:size]
        out["table"] = region[self.table_at:].view(torch.int32)
        return out


class StagingRing:
    """Host staging buffers, used in turn; grown (never shrunk) to the largest layout asked for."""

    def __init__(self, device: torch.device, pin: bool, depth: int = 2) -> None:
        self.pin = pin  # the platform's Capabilities.pinned_memory
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._events: list = [None] * depth
        self._turn = 0

    def take(self, numel: int) -> tuple[int, torch.Tensor]:
        """(slot, an int64 host buffer of at least ``numel`` elements) that no pending copy reads."""
        slot = self._turn
        self._turn = (slot + 1) % len(self._buffers)
        if self._events[slot] is not None:
            self._events[slot].synchronize()
            self._events[slot] = None
        buf = self._buffers[slot]
        if buf is None or buf.numel() < numel:
            buf = self._buffers[slot] = torch.empty(max(numel, 1024), dtype=torch.int64, pin_memory=self.pin)
        return slot, buf

    def copy(self, slot: int, region: torch.Tensor, numel: int) -> None:
        """Copy the first ``numel`` elements of host buffer ``slot`` into device ``region``."""
        region[:numel].copy_(self._buffers[slot][:numel], non_blocking=self.pin)
        if self.pin:
            event = torch.Event(device=self.device)
            event.record()
            self._events[slot] = event


def fill_host(layout: StepLayout, host: torch.Tensor, tokens, positions, slots, seq_lens, table_rows: np.ndarray,
              fill=None) -> None:
    """Write one step into ``host`` in ``layout``: n real rows, the rest padding (slot -1, length 1).

    ``table_rows`` [n, width] int32, ``fill`` (dst rows, src rows) or None."""
    n, size = len(tokens), layout.size
    view = host.numpy()
    ids, pos, slot, dst, src = (view[i * size:(i + 1) * size] for i in range(len(FIELDS)))
    ids[:n], ids[n:] = tokens, 0
    pos[:n], pos[n:] = positions, 0
    slot[:n], slot[n:] = slots, -1
    if fill is not None:
        k = len(fill[0])
        dst[:k], src[:k] = fill
    lens = view[layout.seq_lens_at:layout.table_at].view(np.int32)[:size]
    lens[:n], lens[n:] = seq_lens, 1
    rows, width = table_rows.shape
    view[layout.table_at:layout.used(rows, width)].view(np.int32)[:rows * width] = table_rows.reshape(-1)
