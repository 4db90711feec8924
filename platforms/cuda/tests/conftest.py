"""CUDA platform tests: ``cuda``-marked tests need a GPU and are skipped where torch sees none.

Without a GPU they can still run through Triton's interpreter on CPU tensors, for developing
kernels on a machine with no accelerator: ``TRITON_INTERPRET=1 pytest platforms/cuda/tests``
in an environment that has triton installed (the ``kernel_device`` fixture then yields "cpu").
Tests that need the real device (graphs, timing) use the ``gpu`` fixture and skip there.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

from podium_plugin_api import AttentionMetadata


def interpreting() -> bool:
    """True when Triton's CPU interpreter is requested and triton is importable."""
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or interpreting():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def kernel_device() -> str:
    """Where the kernels run: the GPU, or the CPU under TRITON_INTERPRET=1."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def check_dtype(kernel_device):
    """Skips bfloat16 under the interpreter: its bf16 tl.dot returns garbage and its fp32 -> bf16
    conversion truncates instead of rounding to nearest (seen with triton 3.9)."""

    def check(dtype: torch.dtype) -> None:
        if kernel_device == "cpu" and dtype == torch.bfloat16:
            pytest.skip("Triton's CPU interpreter computes bf16 tl.dot wrongly; runs on the GPU only")

    return check


@pytest.fixture
def gpu() -> str:
    """A real CUDA device; skips under the interpreter."""
    if not torch.cuda.is_available():
        pytest.skip("needs a real CUDA device, not the Triton interpreter")
    return "cuda"


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


def ragged_lengths(rng: random.Random, num_seqs: int, max_len: int, kind: str, block_size: int):
    """(query_lens, seq_lens) of a given kind: decode, prefill, prefix (chunks over cached context),
    boundary (lengths at block edges), or mixed (all of them)."""
    query_lens, seq_lens = [], []
    for i in range(num_seqs):
        pick = kind if kind != "mixed" else ("decode", "prefill", "prefix", "boundary")[i % 4]
        if pick == "boundary":
            s = block_size * rng.randint(1, max(1, max_len // block_size)) + rng.choice([-1, 0, 1])
            s = max(2, min(s, max_len))
            q = rng.choice([1, block_size, block_size + 1, s])
            q = min(q, s)
        else:
            s = rng.randint(1 if pick != "prefix" else 2, max_len)
            q = {"decode": 1, "prefill": s, "prefix": rng.randint(1, max(1, s - 1))}[pick]
        query_lens.append(q)
        seq_lens.append(s)
    return query_lens, seq_lens


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||out - ref|| / ||ref|| over everything, the worst per-token value); NaN -> inf."""
    diff = (out.double() - ref.double()).flatten(1)
    refn = ref.double().flatten(1)
    if not torch.isfinite(out).all():
        return float("inf"), float("inf")
    whole = float(diff.norm() / refn.norm())
    worst = float((diff.norm(dim=1) / refn.norm(dim=1).clamp_min(1e-12)).max())
    return whole, worst


@pytest.fixture
def make_batch():
    return RaggedBatch


@pytest.fixture
def make_lengths():
    return ragged_lengths


@pytest.fixture
def rel_error():
    return relative_error
