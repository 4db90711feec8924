"""Which attention path a TPU platform takes: the Pallas kernel or our pure-XLA paged attention.

torch_xla's Pallas ragged paged attention kernel (``torch_xla.experimental.custom_kernel.
ragged_paged_attention``, traced through JAX) runs on TPU v4 and newer only, and only for head
layouts its tiling supports. Everything else (older TPUs, XLA's CPU device, other head layouts,
no JAX installed) takes the pure-XLA path. The decision is a pure function of the device kind
string torch_xla reports (``"TPU v4"``, ``"TPU v5 lite"``, ``"TPU v6 lite"``, ``"TPU7x"``, ``"CPU"``),
so tests fake the device by passing a string.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

import torch

PALLAS_MIN_GENERATION = 4
PALLAS_HEAD_ALIGNMENT = 128  # head_size the kernel's lanes take without padding


@dataclass(frozen=True)
class AttentionChoice:
    kernel: str  # "pallas" or "xla"
    reason: str


def tpu_generation(device_kind: str) -> int | None:
    """The TPU generation in a device kind string ("TPU v5 lite" -> 5, "TPU7x" -> 7); None if not a TPU."""
    match = re.match(r"\s*TPU\s*v?(\d+)", device_kind or "", flags=re.IGNORECASE)
    return int(match.group(1)) if match else None


def select_attention(device_kind: str, jax_available: bool) -> AttentionChoice:
    """Pallas on a real TPU of generation >= 4 with JAX importable; the pure-XLA path otherwise."""
    generation = tpu_generation(device_kind)
    if generation is None:
        return AttentionChoice("xla", f"device {device_kind!r} is not a TPU")
    if generation < PALLAS_MIN_GENERATION:
        return AttentionChoice("xla", f"{device_kind} is older than TPU v{PALLAS_MIN_GENERATION}")
    if not jax_available:
        return AttentionChoice("xla", "the Pallas kernel needs JAX; pip install 'podium-tpu[tpu]'")
    return AttentionChoice("pallas", f"Pallas ragged paged attention on {device_kind}")


def _dtype_packing(dtype: torch.dtype) -> int:
    """Values per 32-bit word (the kernel tiles packed dtypes along the head axis)."""
    return max(1, 32 // (torch.empty((), dtype=dtype).element_size() * 8))


def pallas_layout_supported(num_kv_heads: int, head_size: int, kv_dtype: torch.dtype) -> bool:
    """Whether the kernel tiles this cache: 2 * num_kv_heads combined heads, packed, XLA-tileable."""
    if head_size % PALLAS_HEAD_ALIGNMENT:
        return False
    combined, packing = 2 * num_kv_heads, _dtype_packing(kv_dtype)
    if combined % packing:
        return False
    words = combined // packing
    return words in (1, 2, 4, 8) or words % 8 == 0


def probe_device_kind() -> str:
    """torch_xla's device kind for the default device; "" when it cannot be read."""
    try:
        import torch_xla.core.xla_model as xm

        return str(xm.xla_device_kind())
    except Exception:  # no torch_xla, no device: not a TPU, the caller falls back to XLA
        return ""


def jax_available() -> bool:
    return importlib.util.find_spec("jax") is not None
