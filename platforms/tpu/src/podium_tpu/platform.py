"""The TPU platform: KV cache on the XLA device, steps padded to bucketed shapes."""

from __future__ import annotations

import importlib

import torch

from podium_plugin_api import Availability, Capabilities, MemoryInfo, Platform


def _xla_runtime():
    """(torch_xla module, torch_xla.runtime module) or raise ImportError."""
    torch_xla = importlib.import_module("torch_xla")
    runtime = importlib.import_module("torch_xla.runtime")
    return torch_xla, runtime


def tpu_availability() -> Availability:
    try:
        _, runtime = _xla_runtime()
    except ImportError:
        return Availability(False, "torch_xla is not installed; pip install 'podium-tpu[xla]'")
    except Exception as exc:  # a broken torch_xla install must not take other platforms down
        return Availability(False, f"torch_xla failed to import: {type(exc).__name__}: {exc}")
    try:
        device_type = runtime.device_type()
    except Exception as exc:
        return Availability(False, f"torch_xla found no device: {type(exc).__name__}: {exc}")
    if device_type != "TPU":
        return Availability(False, f"torch_xla's device is {device_type!r}, not a TPU")
    return Availability(True, "TPU via torch_xla")


class TpuPlatform(Platform):
    name = "tpu"
    device_type = "xla"
    priority = 90

    def availability(self) -> Availability:
        return tpu_availability()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=(torch.float32, torch.bfloat16),
            default_dtype=torch.bfloat16,
            graph_capture=True,
            distributed_backend="xla",
            static_shapes=True,
            kv_cache_from_free_memory=True,
        )

    def torch_device(self, index: int = 0) -> torch.device:
        torch_xla, _ = _xla_runtime()
        return torch_xla.device(index) if hasattr(torch_xla, "device") else torch.device("xla", index)

    def synchronize(self) -> None:
        torch_xla, _ = _xla_runtime()
        torch_xla.sync()

    def memory_info(self) -> MemoryInfo:
        import torch_xla.core.xla_model as xm

        info = xm.get_memory_info(self.torch_device())
        total = int(info.get("bytes_limit", info.get("kb_total", 0) * 1024))
        used = int(info.get("bytes_used", (info.get("kb_total", 0) - info.get("kb_free", 0)) * 1024))
        return MemoryInfo(total - used, total)
