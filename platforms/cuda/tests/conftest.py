"""CUDA platform tests: ``cuda``-marked tests need a GPU and are skipped where torch sees none.

Without a GPU they can still run through Triton's interpreter on CPU tensors, for developing
kernels on a machine with no accelerator: ``TRITON_INTERPRET=1 pytest platforms/cuda/tests``
in an environment that has triton and numpy < 2.4 installed (the ``kernel_device`` fixture then yields "cpu").
Tests that need the real device (graphs, timing) use the ``gpu`` fixture and skip there.
"""

from __future__ import annotations

import random

import pytest
import torch
from cuda_checks import ragged_lengths, relative_error
from triton_interpreter import kernel_device as where_kernels_run
from triton_interpreter import require_gpu, skip_cuda_marked_without_gpu, skip_interpreted_bf16

from podium_plugin_api import AttentionMetadata


def pytest_collection_modifyitems(config, items):
    skip_cuda_marked_without_gpu(items)


@pytest.fixture
def kernel_device() -> str:
    """Where the kernels run: the GPU, or the CPU under TRITON_INTERPRET=1."""
    return where_kernels_run()


@pytest.fixture
def check_dtype(kernel_device):
    """Skips bfloat16 under the interpreter."""
    return lambda dtype: skip_interpreted_bf16(kernel_device, dtype)


@pytest.fixture
def gpu(kernel_device) -> str:
    """A real CUDA device; skips under the interpreter."""
    return require_gpu(kernel_device)


class RaggedBatch:
    """A random flat ragged batch over a randomly filled paged cache (blocks scattered)."""

    def __init__(self, query_lens, seq_lens, *, num_heads, num_kv_heads, head_size, block_size, dtype, device, seed):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        blocks_per_seq = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3
        free = list(range(num_blocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]
        self.meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, block_size, device=device)
        shape = (2, num_blocks, block_size, num_kv_heads, head_size)  # default layout
        self.kv_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
        self.query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen).to(dtype=dtype, device=device)
        self.num_blocks = num_blocks


@pytest.fixture
def make_batch():
    return RaggedBatch


@pytest.fixture
def make_lengths():
    return ragged_lengths


@pytest.fixture
def rel_error():
    return relative_error
