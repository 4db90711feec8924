"""The kit's cases for the batched LoRA ops (``podium_plugin_api.lora``): ``lora_shrink`` and
``lora_expand`` at 1, 7 and 33 rows over 3 slots, rows without a slot among them, a slot no row
uses, inner sizes of one slice (16) and of three stacked slices (48, as q|k|v), and a step whose
rows all go without an adapter. The expand's ``y`` is changed in place: the kit hands each side
its own copy."""

from __future__ import annotations

from typing import Any

import torch

from ..lora import lora_mapping

NUM_SLOTS, IN_FEATURES, OUT_FEATURES = 3, 96, 40
ROW_COUNTS, INNER_SIZES = (1, 7, 33), (16, 48)


def _slots(rows: int, gen: torch.Generator) -> list[int]:
    """Random slots in [-1, NUM_SLOTS - 1) (the last slot stays unused); the first row always has one."""
    slots = torch.randint(-1, NUM_SLOTS - 1, (rows,), generator=gen).tolist()
    slots[0] = max(slots[0], 0)
    return slots


def lora_cases(name: str, dtype: torch.dtype, gen: torch.Generator) -> list[tuple[Any, ...]]:
    """Every argument tuple the kit checks ``lora_shrink`` or ``lora_expand`` with (CPU tensors)."""
    cases = []
    for inner in INNER_SIZES:
        for rows in ROW_COUNTS:
            cases.append(_case(name, _slots(rows, gen), inner, dtype, gen))
    cases.append(_case(name, [-1] * 5, INNER_SIZES[0], dtype, gen))
    return cases


def _case(name: str, slots: list[int], inner: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, ...]:
    mapping = lora_mapping(slots, NUM_SLOTS)
    rows = len(slots)
    if name == "lora_shrink":
        x = torch.randn(rows, IN_FEATURES, generator=gen).to(dtype)
        lora_a = (torch.randn(NUM_SLOTS, inner, IN_FEATURES, generator=gen) / IN_FEATURES**0.5).to(dtype)
        return x, lora_a, mapping
    y = torch.randn(rows, OUT_FEATURES, generator=gen).to(dtype)
    shrunk = torch.randn(rows, inner, generator=gen)  # float32, as lora_shrink returns it
    lora_b = (torch.randn(NUM_SLOTS, OUT_FEATURES, inner, generator=gen) / inner**0.5).to(dtype)
    return y, shrunk, lora_b, mapping
