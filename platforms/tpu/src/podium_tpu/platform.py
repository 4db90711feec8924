"""The TPU platform: KV cache on the XLA device, steps padded to bucketed shapes (shaping.py).

torch_xla is imported lazily (in ``availability`` and the device methods), never at import time.
XLA's CPU device stands in for a TPU only when ``PODIUM_TPU_ALLOW_XLA_CPU=1``: a test-only switch
(``make test-tpu`` uses it) that proves the XLA code path on XLA:CPU, not on a TPU.
"""

from __future__ import annotations

import importlib
import os

import torch

from podium_plugin_api import (
    AttentionBackend,
    Availability,
    Capabilities,
    GraphRunner,
    KVCacheSpec,
    MemoryInfo,
    Platform,
    StepShaping,
)

from .graph import XlaGraphRunner, cut_graph
from .pallas_attention import PallasAttentionBackend
from .selection import AttentionChoice, jax_available, probe_device_kind, select_attention
from .shaping import BucketShaping
from .xla_attention import XlaAttentionBackend

ALLOW_XLA_CPU_ENV = "PODIUM_TPU_ALLOW_XLA_CPU"


def _xla_runtime():
    """(torch_xla module, torch_xla.runtime module) or raise ImportError."""
    torch_xla = importlib.import_module("torch_xla")
    runtime = importlib.import_module("torch_xla.runtime")
    return torch_xla, runtime


def xla_cpu_allowed() -> bool:
    """The test-only switch: may XLA's CPU device stand in for a TPU?"""
    return os.environ.get(ALLOW_XLA_CPU_ENV, "") == "1"


def tpu_availability() -> Availability:
    try:
        _, runtime = _xla_runtime()
    except ImportError:
        return Availability(False, "torch_xla is not installed; pip install 'podium-tpu[tpu]'")
    except Exception as exc:  # a broken torch_xla install must not take other platforms down
        return Availability(False, f"torch_xla failed to import: {type(exc).__name__}: {exc}")
    try:
        device_type = runtime.device_type()
    except Exception as exc:
        return Availability(False, f"torch_xla found no device: {type(exc).__name__}: {exc}")
    if device_type == "TPU":
        return Availability(True, "TPU via torch_xla")
    if device_type == "CPU" and xla_cpu_allowed():
        return Availability(True, f"XLA's CPU device, not a TPU ({ALLOW_XLA_CPU_ENV}=1 is a test-only switch)")
    return Availability(False, f"torch_xla's device is {device_type!r} (PJRT_DEVICE), not a TPU")


class TpuPlatform(Platform):
    name = "tpu"
    device_type = "xla"
    priority = 90

    def __init__(self) -> None:
        self._backend: AttentionBackend | None = None
        self.attention_choice: AttentionChoice | None = None

    def availability(self) -> Availability:
        return tpu_availability()

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=(torch.float32, torch.bfloat16),
            default_dtype=torch.bfloat16,
            graph_capture=True,
            distributed_backend="xla",
            kv_cache_from_free_memory=True,
            # torch_xla 2.9 fails any nn.Linear under torch.inference_mode ("Cannot set version_counter
            # for inference tensor"): the core must run steps under torch.no_grad here
            inference_mode=False,
        )

    # device -----------------------------------------------------------------------------------
    def device_count(self) -> int:
        torch_xla, _ = _xla_runtime()
        return int(torch_xla.device_count())

    def torch_device(self, index: int = 0) -> torch.device:
        torch_xla, _ = _xla_runtime()
        return torch_xla.device(index)

    def synchronize(self) -> None:
        """Cut the pending lazy graph here: compile (first time per shape) and run it, then wait."""
        torch_xla, _ = _xla_runtime()
        torch_xla.sync(wait=True)

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch_xla, _ = _xla_runtime()
        torch_xla.manual_seed(seed)

    # memory -----------------------------------------------------------------------------------
    def _device_memory(self) -> dict | None:
        """torch_xla's memory stats, or None where the device has none (XLA's CPU device)."""
        import torch_xla.core.xla_model as xm

        try:
            return dict(xm.get_memory_info(self.torch_device()))
        except RuntimeError:
            return None

    def memory_info(self) -> MemoryInfo:
        info = self._device_memory()
        if info is None:  # XLA:CPU keeps tensors in host memory
            return super().memory_info()
        total = int(info["bytes_limit"])
        return MemoryInfo(total - int(info["bytes_used"]), total)

    def peak_memory(self) -> int:
        info = self._device_memory()
        return int(info.get("peak_bytes_used", 0)) if info else 0

    # attention, cache, graphs -----------------------------------------------------------------
    def attention_backend(self) -> AttentionBackend:
        """Pallas on TPU v4+ with JAX, pure XLA elsewhere; chosen once, so the cache layout stays put."""
        if self._backend is None:
            self.attention_choice = select_attention(probe_device_kind(), jax_available())
            pallas = self.attention_choice.kernel == "pallas"
            self._backend = PallasAttentionBackend(sync=cut_graph) if pallas else XlaAttentionBackend(sync=cut_graph)
        return self._backend

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
        """One zeroed cache per layer on the XLA device, materialized there before the first step."""
        caches = super().allocate_kv_cache(spec, num_blocks)
        self.synchronize()
        return caches

    def graph_runner(self) -> GraphRunner:
        return XlaGraphRunner(self.synchronize)

    def step_shaping(self) -> StepShaping:
        """Steps padded to bucketed shapes, logits cut from the forward, sampling on the host."""
        return BucketShaping(self.synchronize)
