"""The adapted projection (``LoRALinear``) and the step mapping every one of them reads (``LoRAState``).

``LoRALinear`` wraps whatever the model's projection is by the time adapters are applied (a plain
linear, the platform's packed or GEMV one, a quantized one): ``base(x)`` first, then the rows that
have an adapter slot get their delta through the op table's ``lora_shrink`` / ``lora_expand``
(``podium_plugin_api.lora`` holds the slot-weight layout). Its slot weights are buffers on the
model's device, zero until an adapter is written into a slot.

``LoRAState`` is the one object the runner and every ``LoRALinear`` of a model share: the runner
stages each step's ``LoRAMapping`` into it before the forward (``step.LoRAStep``); the layers ask it
for the mapping of their input's row count. A step in which no row has an adapter has no mapping,
and the layers add nothing (no op runs). Captured decode graphs read their mapping from fixed
device memory, refilled before each replay, so the captured ops read the replayed step's slots.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from podium_plugin_api import GraphCaptureUnsupported
from podium_plugin_api.lora import LoRAMapping, mapping_arrays


class LoRAState:
    """The current step's ``LoRAMapping`` (None: no row has an adapter), and the captured graphs' one.

    Captured graphs of every size read one device region reserved before capture (``reserve_graphs``:
    no allocation or copy may happen inside a capture), laid out as
    ``[token_slots M | sorted_rows M | slot_starts L + 1]`` for the largest size M; a graph of G rows
    reads the first G entries of each part, and a replay's host array fills the whole region in one copy.
    """

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.num_slots, self.device = num_slots, device
        self.current: LoRAMapping | None = None
        self.capturing = False  # graph capture in progress: layers read the graph region's mapping
        self.capture_adapters = True  # False: captured graphs leave the adapters out (base-model steps only)
        self._region: torch.Tensor | None = None  # the graphs' mapping region (int32), once reserved
        self._region_rows = 0
        self._region_clean = True  # the region says "no slot" for every row

    def mapping_for(self, rows: int) -> LoRAMapping | None:
        """The mapping a layer with ``rows`` input rows uses now (None: add no delta)."""
        if self.capturing:
            return self._graph_mapping(rows) if self.capture_adapters else None
        current = self.current
        if current is None or current.num_rows == rows:
            return current
        return _padded(current, rows)  # a platform's shaping padded the step's rows

    def stage(self, token_slots: np.ndarray | None, graph_rows: int | None) -> None:
        """Make the next forward's mapping: ``token_slots`` [T] (None: no row has an adapter), for a
        replayed graph of ``graph_rows`` rows or (None) an eager step."""
        if graph_rows is None:
            self.current = None if token_slots is None else self._eager_mapping(token_slots)
            return
        self.current = None
        if self._region is None or not self.capture_adapters or (token_slots is None and self._region_clean):
            return
        size = self._region_rows
        slots = np.full(size, -1, dtype=np.int32)
        if token_slots is not None:
            slots[:len(token_slots)] = token_slots
        order, starts, _ = mapping_arrays(slots[:graph_rows], self.num_slots)
        host = np.zeros(2 * size + self.num_slots + 1, dtype=np.int32)
        host[:size], host[size:size + graph_rows], host[2 * size:] = slots, order, starts
        self._region.copy_(torch.from_numpy(host), non_blocking=True)
        self._region_clean = token_slots is None

    def reserve_graphs(self, max_rows: int) -> None:
        """Reserve the captured graphs' mapping region for graphs of up to ``max_rows`` rows (before capture)."""
        if self._region is None or self._region_rows < max_rows:
            host = np.zeros(2 * max_rows + self.num_slots + 1, dtype=np.int32)
            host[:max_rows] = -1
            self._region = torch.from_numpy(host).to(self.device)
            self._region_rows, self._region_clean = max_rows, True

    def _eager_mapping(self, token_slots: np.ndarray) -> LoRAMapping:
        rows = len(token_slots)
        packed = torch.from_numpy(_packed(token_slots.astype(np.int32), self.num_slots))
        region = packed.to(self.device, non_blocking=True)
        slotted = token_slots[token_slots >= 0]
        most = int(np.bincount(slotted, minlength=1).max())
        return LoRAMapping(region[:rows], region[rows:2 * rows], region[2 * rows:], most, len(slotted))

    def _graph_mapping(self, rows: int) -> LoRAMapping:
        if self._region is None or rows > self._region_rows:
            raise GraphCaptureUnsupported(f"no LoRA mapping region reserved for {rows}-row graphs")
        region, size = self._region, self._region_rows
        return LoRAMapping(region[:rows], region[size:size + rows], region[2 * size:], None)


def _packed(token_slots: np.ndarray, num_slots: int) -> np.ndarray:
    """[token_slots T | sorted_rows T | slot_starts L + 1] as one int32 array: one copy to the device."""
    order, starts, _ = mapping_arrays(token_slots, num_slots)
    return np.concatenate([token_slots.astype(np.int32), order, starts])


def _padded(mapping: LoRAMapping, rows: int) -> LoRAMapping:
    """``mapping`` for ``rows`` > its rows: the extra rows have no slot."""
    extra = rows - mapping.num_rows
    device = mapping.token_slots.device
    slots = torch.cat([mapping.token_slots, torch.full((extra,), -1, dtype=torch.int32, device=device)])
    order = torch.cat([mapping.sorted_rows,
                       torch.arange(mapping.num_rows, rows, dtype=torch.int32, device=device)])
    return LoRAMapping(slots, order, mapping.slot_starts, mapping.max_slot_rows, mapping.num_slotted_rows)


class LoRALinear(nn.Module):
    """``base(x)`` [T, N] plus, for each row with an adapter slot, that slot's delta.

    ``slices``: the output sizes of the projection's adapted parts, in order (q, k, v of a merged
    q|k|v; one part for a plain projection); slice i's A rows are ``[i R, (i + 1) R)`` of ``lora_a``.
    """

    def __init__(self, base: nn.Module, in_features: int, slices: tuple[int, ...], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, state: LoRAState, ops: dict[str, Callable]) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.slices, self.max_rank = in_features, tuple(slices), max_rank
        self.out_features = sum(self.slices)
        inner = max_rank * len(self.slices)
        self.register_buffer("lora_a", torch.zeros(num_slots, inner, in_features, dtype=dtype, device=device),
                             persistent=False)  # [L, S, K]
        self.register_buffer("lora_b", torch.zeros(num_slots, self.out_features, inner, dtype=dtype, device=device),
                             persistent=False)  # [L, N, S], block-diagonal over the slices
        self.state = state
        self.shrink, self.expand = ops["lora_shrink"], ops["lora_expand"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [T, N]
        mapping = self.state.mapping_for(x.shape[0])
        if mapping is None:
            return y
        shrunk = self.shrink(x, self.lora_a, mapping)  # [T, S] float32
        return self.expand(y, shrunk, self.lora_b, mapping)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def write_slice(self, slot: int, index: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Slice ``index`` of slot ``slot``: A [r, K] and B [n_i, r] (its scale folded in), r <= max_rank."""
        rank, first = lora_a.shape[0], index * self.max_rank
        offset = sum(self.slices[:index])
        self.lora_a[slot, first:first + rank].copy_(lora_a, non_blocking=True)
        self.lora_b[slot, offset:offset + self.slices[index], first:first + rank].copy_(lora_b, non_blocking=True)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, slices={self.slices}, slots={self.lora_a.shape[0]}, max_rank={self.max_rank}"
