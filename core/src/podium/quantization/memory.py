"""What a model's weights occupy, by dtype (a quantized model's packed bytes show as uint8/int32/fp8)."""

from __future__ import annotations

from torch import nn


def weight_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """{dtype name: bytes} over the model's parameters and buffers (a platform's private packed copies are
    not among them), each storage counted once
    (a tied head shares the embedding's), largest first."""
    seen: set[tuple[int, int]] = set()
    totals: dict[str, int] = {}
    tensors = [p for _, p in model.named_parameters(remove_duplicate=False)]
    tensors += [b for _, b in model.named_buffers(remove_duplicate=False)]
    for tensor in tensors:
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        try:
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        except RuntimeError:  # a device whose tensors expose no data pointer (XLA): a tied head is the same object
            key = (id(tensor), -1)
        if key in seen:
            continue
        seen.add(key)
        name = str(tensor.dtype).replace("torch.", "")
        totals[name] = totals.get(name, 0) + tensor.numel() * tensor.element_size()
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def format_weight_bytes(totals: dict[str, int]) -> str:
    """``weights 74.2 MiB: uint8 60.1 MiB, float32 14.1 MiB``."""
    total = sum(totals.values())
    parts = ", ".join(f"{name} {nbytes / 2**20:.1f} MiB" for name, nbytes in totals.items())
    return f"weights {total / 2**20:.1f} MiB: {parts}"
