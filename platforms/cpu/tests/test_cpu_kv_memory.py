"""The KV cache's host memory: lazily zeroed by default, resident from the start with the
``kv_cache_commit`` option, so that serving never grows the process.

Lazily zeroed pages (calloc) fault in as the block manager hands out blocks for the first time;
with a prefix cache it hands out every block before reusing one, so a serving process's RSS
climbs by the whole cache's size over its first minutes, then stays. Residency is read with ``mincore``, page
by page, which needs no timing and no RSS noise. Each cache here is larger than glibc's largest
mmap threshold (32 MiB), so it is a fresh mapping, not recycled heap pages that are resident anyway.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest
import torch
from model_fixtures import save_tiny_model

from podium.engine import LLMEngine
from podium_cpu import CpuPlatform, host_memory
from podium_plugin_api import KVCacheSpec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore is read through Linux's libc")

LAYER_BYTES = 40 << 20  # above the mmap threshold


def resident_fraction(address: int, nbytes: int) -> float:
    """The fraction of the pages of [address, address + nbytes) in memory, from mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = address - address % page
    pages = -(-(address + nbytes - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, address + nbytes - start, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(byte & 1 for byte in vector) / pages


def tensor_resident(tensor: torch.Tensor) -> float:
    return resident_fraction(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def test_fresh_zeros_are_not_resident_until_committed():
    """The premise (fresh pages fault in on first touch, even in a process that has freed large
    buffers before), then ``commit_pages``."""
    for _ in range(3):  # what a long test session does to the heap: large buffers come and go
        np.ones(3 * LAYER_BYTES, dtype=np.uint8).sum()
    array = host_memory.fresh_pages(LAYER_BYTES)
    assert array.flags.writeable and array.ctypes.data % mmap.PAGESIZE == 0
    assert resident_fraction(array.ctypes.data, array.nbytes) < 0.01
    assert host_memory.resident_bytes(torch.from_numpy(array)) < 0.01 * LAYER_BYTES
    host_memory.commit_pages(array)
    assert resident_fraction(array.ctypes.data, array.nbytes) == 1.0
    assert LAYER_BYTES <= host_memory.resident_bytes(torch.from_numpy(array)) <= LAYER_BYTES + 2 * mmap.PAGESIZE
    assert not array.any()


@pytest.mark.parametrize("populate", [True, False], ids=["madvise", "write-per-page"])
def test_commit_pages_keeps_the_contents(monkeypatch, populate):
    if not populate:  # a kernel without MADV_POPULATE_WRITE
        monkeypatch.setattr(host_memory, "_populate_write", lambda start, length: False)
    lazy = np.zeros(LAYER_BYTES + 123, dtype=np.uint8)[123:]  # not page aligned at either end
    host_memory.commit_pages(lazy)
    assert resident_fraction(lazy.ctypes.data, lazy.nbytes) == 1.0 and not lazy.any()
    data = np.random.default_rng(0).integers(0, 256, size=3 * mmap.PAGESIZE + 5, dtype=np.uint8)
    before = data.copy()
    host_memory.commit_pages(data)
    assert np.array_equal(data, before)


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "lazy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allocated_kv_cache_is_zeroed_aligned_and_resident_when_committed(dtype, commit):
    platform = CpuPlatform()
    platform.activate({"attention": "auto", "kv_cache_commit": commit, "linears": "auto", "amx": True, "amx_plain_weights": False})
    element = torch.empty((), dtype=dtype).element_size()
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_size=64, block_size=16, dtype=dtype)
    blocks = LAYER_BYTES // (spec.bytes_per_block // spec.num_layers) + 1
    caches = platform.allocate_kv_cache(spec, blocks)
    assert len(caches) == 2
    for cache in caches:
        assert cache.dtype == dtype and cache.numel() * element >= LAYER_BYTES
        assert cache.data_ptr() % 64 == 0
        assert tensor_resident(cache) == 1.0 if commit else tensor_resident(cache) < 0.01
        assert not cache.any()


def test_engine_kv_cache_is_resident_before_the_first_request_with_the_option(tmp_path):
    """The engine's own caches (the allocation the soak's RSS growth came from): with
    ``kv_cache_commit`` all resident from the start, so a block used for the first time adds
    nothing to the process; by default none is before a request touches it."""
    save_tiny_model("llama", {}, tmp_path, seed=1)
    common = dict(model=str(tmp_path), device="cpu", dtype="float32", block_size=16,
                  kv_cache_memory=3 * LAYER_BYTES * 2, max_model_len=64, enforce_eager=True)
    engine = LLMEngine(**common, platform_options={"kv_cache_commit": True})
    assert len(engine.kv_caches) == 3
    assert [tensor_resident(cache) for cache in engine.kv_caches] == [1.0, 1.0, 1.0]
    lazy = LLMEngine(**common)
    assert max(tensor_resident(cache) for cache in lazy.kv_caches) < 0.01


def test_the_device_key_names_the_host_and_the_cores_this_process_may_use():
    import os
    import socket

    platform = CpuPlatform()
    key = platform.device_key(0)
    host, cores = key.rsplit("/cpu:", 1)
    assert host == socket.gethostname()
    listed = set()
    for span in cores.split(","):
        first, _, last = span.partition("-")
        listed.update(range(int(first), int(last or first) + 1))
    assert listed == set(os.sched_getaffinity(0))
