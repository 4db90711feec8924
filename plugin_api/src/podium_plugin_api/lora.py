"""Batched LoRA in the contract: the slot weights, the per-step mapping, and the shrink/expand reference.

A LoRA adapter adds ``scale * B (A x)`` to a projection's output (A [r, K], B [N, r], r the
adapter's rank). The core keeps up to L adapters on the device at once, each in a *slot*; every
projection it adapts holds the slots' weights stacked, zero-padded to the engine's largest rank::

    lora_a  [L, S, K]   slot l's A (S = rank x slices: see below)
    lora_b  [L, N, S]   slot l's B, its scale folded in

One step's rows may each use another slot, or none. Per row (token) ``y[t] += lora_b[l] @
(lora_a[l] @ x[t])`` with ``l = token_slots[t]``; -1 adds nothing. The core calls two ops of the
op table for that, which a platform overrides with its kernels (segmented GEMMs, SGMV-style):

    lora_shrink(x [T, K], lora_a, mapping)          -> [T, S] float32  (rows without a slot: any value)
    lora_expand(y [T, N], shrunk, lora_b, mapping)  -> y, with each row's delta added in place

A merged projection (q|k|v, gate|up) adapts each of its slices with its own A and B: their A are
stacked along S (slice i in rows ``[i * R, (i + 1) * R)``) and B is block-diagonal (slice i's output
rows read only its R columns), so the ops never need to know about slices. Ranks below R are zero
rows and columns. Tensor parallelism shards the slot weights like the base weights: a column-
parallel projection keeps its output rows of B (A whole), a row-parallel one its input columns of A
(B whole), whose partial sums then go through the layer's all-reduce with the base output's.

``LoRAMapping`` carries the rows both ways: ``token_slots`` per row, and the rows grouped by slot
(``sorted_rows``, ``slot_starts``), which a kernel that computes a block of same-slot rows together
reads. It is built once per step on the host (``lora_mapping``) and read by every adapted layer;
where the host built it for the step (not a captured graph's fixed memory) it also says how many rows
any one slot has and how many have a slot, so a kernel's grid can cover only those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoRAMapping:
    """Which slot each of a step's T rows uses (module docstring); device tensors, int32."""

    token_slots: torch.Tensor  # [T] the slot of row t, -1: none
    sorted_rows: torch.Tensor  # [T] the rows with a slot, grouped by slot (each group in row order), then the rest
    slot_starts: torch.Tensor  # [L + 1] slot l's rows are sorted_rows[slot_starts[l] : slot_starts[l + 1]]
    # the most rows any one slot has, where the host knows it (None: up to T, as in a captured graph)
    max_slot_rows: int | None = None
    # how many rows have a slot (the first ones of sorted_rows), where the host knows it (None: up to T)
    num_slotted_rows: int | None = None

    @property
    def num_slots(self) -> int:
        return self.slot_starts.shape[0] - 1

    @property
    def num_rows(self) -> int:
        return self.token_slots.shape[0]

    def to(self, device: torch.device | str) -> LoRAMapping:
        return LoRAMapping(self.token_slots.to(device), self.sorted_rows.to(device), self.slot_starts.to(device),
                           self.max_slot_rows, self.num_slotted_rows)

    def __repr__(self) -> str:
        return f"LoRAMapping(rows={self.num_rows}, slots={self.num_slots})"


def mapping_arrays(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(sorted_rows [T], slot_starts [L + 1], most rows of one slot) of ``token_slots`` [T] (int,
    -1: none), on the host. ValueError for a slot outside [-1, L)."""
    slots = np.asarray(token_slots, dtype=np.int64)
    if slots.size and (slots.min() < -1 or slots.max() >= num_slots):
        raise ValueError(f"token slots must be in [-1, {num_slots}), got [{slots.min()}, {slots.max()}]")
    keyed = np.where(slots < 0, num_slots, slots)
    order = np.argsort(keyed, kind="stable").astype(np.int32)
    counts = np.bincount(keyed, minlength=num_slots + 1)[:num_slots]
    starts = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    return order, starts, int(counts.max()) if num_slots else 0


def lora_mapping(token_slots: Sequence[int] | np.ndarray, num_slots: int,
                 device: torch.device | str = "cpu") -> LoRAMapping:
    """The mapping of rows ``token_slots`` (-1: none) over ``num_slots`` slots, on ``device``."""
    slots = np.asarray(token_slots, dtype=np.int32)
    order, starts, most = mapping_arrays(slots, num_slots)
    return LoRAMapping(torch.from_numpy(slots).to(device), torch.from_numpy(order).to(device),
                       torch.from_numpy(starts).to(device), most, int(starts[-1]))


def _slot_rows(mapping: LoRAMapping) -> list[tuple[int, torch.Tensor]]:
    """(slot, its rows) for every slot with rows (reads the starts on the host)."""
    starts = mapping.slot_starts.tolist()
    rows = mapping.sorted_rows.long()
    return [(slot, rows[starts[slot]:starts[slot + 1]]) for slot in range(mapping.num_slots)
            if starts[slot + 1] > starts[slot]]


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """x [T, K], lora_a [L, S, K], mapping (LoRAMapping) -> [T, S] float32: row t is lora_a[l] @ x[t].

    l = the row's slot; a row without one is zeros here (a kernel may leave it undefined: expand
    never reads it). Sums in float32 (float64 for a float64 input).
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=acc, device=x.device)  # [T, S]
    for slot, rows in _slot_rows(mapping):
        out.index_copy_(0, rows, x.index_select(0, rows).to(acc) @ lora_a[slot].to(acc).t())
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """y [T, N], shrunk [T, S] (float32, ``lora_shrink``'s), lora_b [L, N, S] -> y with
    lora_b[l] @ shrunk[t] added to each row t that has a slot l, in place (returns y).

    The delta is summed in float32 and added to y's value before rounding to y's dtype once.
    """
    acc = torch.promote_types(shrunk.dtype, torch.float32)
    for slot, rows in _slot_rows(mapping):
        delta = shrunk.index_select(0, rows).to(acc) @ lora_b[slot].to(acc).t()  # [n, N]
        y.index_copy_(0, rows, (y.index_select(0, rows).to(acc) + delta).to(y.dtype))
    return y
