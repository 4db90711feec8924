"""The plugin API's conformance kit against the TPU platform on XLA's CPU device (needs torch_xla).

Attention against the float64 reference on the kit's ragged batches, cache writes by slot
mapping (with -1 padding), layout, graph capture/replay, device and memory hooks: all on a real
XLA device, so they go through lazy tracing and XLA compilation. XLA:CPU, not a TPU.
"""

from __future__ import annotations

import pytest
import torch

from podium_plugin_api.testing.attention_checks import check_attention, check_graph_capture
from podium_plugin_api.testing.batches import ATTENTION_CASES
from podium_plugin_api.testing.kv_cache_checks import check_layout, check_write_read, kit_spec
from podium_plugin_api.testing.platform_checks import (
    check_capabilities,
    check_device_and_memory,
    check_distributed_backend,
)
from podium_tpu import TpuPlatform

pytest.importorskip("torch_xla")


@pytest.fixture(scope="module")
def platform():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PODIUM_TPU_ALLOW_XLA_CPU", "1")
        patch.setenv("PJRT_DEVICE", "CPU")
        tpu = TpuPlatform()
        availability = tpu.availability()
        assert availability.ok, availability.reason
        yield tpu


def test_device_memory_and_distributed_hooks(platform):
    check_device_and_memory(platform)
    check_distributed_backend(check_capabilities(platform))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cache_layout_and_writes(platform, dtype):
    backend = platform.attention_backend()
    check_layout(platform, backend, kit_spec(dtype))
    check_write_read(platform, backend, kit_spec(dtype))


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.name)
def test_attention_matches_reference_float32(platform, case):
    check_attention(platform, platform.attention_backend(), case, torch.float32)


@pytest.mark.parametrize("case", ATTENTION_CASES[:2], ids=lambda c: c.name)
def test_attention_matches_reference_bfloat16(platform, case):
    check_attention(platform, platform.attention_backend(), case, torch.bfloat16)


def test_graph_capture_replays_like_eager(platform):
    check_graph_capture(platform, platform.attention_backend(), torch.float32)
