"""GPU tests of the ROCm platform's own code path: its tuning table, graph capture and kernels.

On a ROCm machine they run on the AMD GPU as they are. On an NVIDIA machine the ``rocm_platform``
fixture turns on the test-only switch (``PODIUM_ROCM_FORCE_ON_CUDA=1``) for each test, so the ROCm
path runs on the CUDA device. Tests marked ``cuda`` are skipped where torch sees no GPU. With the
conformance kit too (the kit reads the switch at startup, so set it on the command line):

    PODIUM_ROCM_FORCE_ON_CUDA=1 python -m pytest platforms/rocm/tests --podium-platform rocm -q

``bash platforms/rocm/scripts/device_run.sh -x`` does that in one device call (platforms/rocm/NOTES.md).

Without a GPU the kernels can still run through Triton's CPU interpreter, for developing on a
machine with no accelerator: ``TRITON_INTERPRET=1 pytest platforms/rocm/tests`` where triton (and numpy < 2.4) is
installed (tests that need the real device, graphs or compiled kernels, skip there; so does bf16,
which the interpreter computes wrongly).
"""

from __future__ import annotations

import random

import pytest
import torch
from cuda_checks import ragged_lengths, relative_error
from triton_interpreter import kernel_device, require_gpu, skip_cuda_marked_without_gpu, skip_interpreted_bf16

from podium_plugin_api import AttentionBackend, AttentionLayerSpec, AttentionMetadata, reference_paged_attention
from podium_rocm import RocmPlatform
from podium_rocm.detection import FORCE_ON_CUDA_ENV

# dtype -> (whole-batch relative error, worst-token relative error); as the CUDA platform's tests
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (1.5e-2, 4e-2)}


def pytest_collection_modifyitems(config, items):
    skip_cuda_marked_without_gpu(items)


@pytest.fixture
def device() -> str:
    """Where the kernels run: the GPU, or the CPU under Triton's interpreter."""
    return kernel_device()


@pytest.fixture
def gpu(device) -> str:
    """A real GPU; skips under the interpreter."""
    return require_gpu(device)


@pytest.fixture
def check_dtype(device):
    return lambda dtype: skip_interpreted_bf16(device, dtype)


@pytest.fixture
def rocm_platform(monkeypatch, device) -> RocmPlatform:
    """The rocm platform on this GPU: itself on ROCm, forced onto the CUDA device elsewhere."""
    if not getattr(torch.version, "hip", None):
        monkeypatch.setenv(FORCE_ON_CUDA_ENV, "1")
    platform = RocmPlatform()
    availability = platform.availability()
    if not availability.ok and device == "cuda":  # a GPU is present (else skipped): this is a bug
        pytest.fail(f"the rocm platform is unavailable on this GPU machine: {availability.reason}")
    return platform


class RaggedStep:
    """One step of a random flat ragged batch over a paged cache with scattered blocks.

    The cache already holds every sequence's context (random values); the step's new tokens'
    query/key/value are random too. ``reference`` writes the new K/V with the contract's pure-torch
    write and computes attention in float64 on the CPU.
    """

    def __init__(self, query_lens, seq_lens, *, heads, head_size, block_size, dtype, seed, device="cuda"):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        num_heads, num_kv_heads = heads
        per_seq = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(per_seq) + 3
        free = list(range(num_blocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(n)] for n in per_seq]
        self.device = device
        self.meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, block_size, device=device)
        self.cpu_meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, block_size)
        num_tokens = sum(query_lens)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        self.start_cache = randn(2, num_blocks, block_size, num_kv_heads, head_size)  # [2, blocks, bs, Hkv, D]
        self.query = randn(num_tokens, num_heads, head_size)  # [T, H, D]
        self.key = randn(num_tokens, num_kv_heads, head_size)  # [T, Hkv, D]
        self.value = randn(num_tokens, num_kv_heads, head_size)
        self.description = f"seed {seed}, (new tokens, context) {list(zip(query_lens, seq_lens))}"

    def on_device(self) -> tuple[torch.Tensor, ...]:
        """(query, key, value, kv_cache) on the device; the cache is a fresh copy of the start cache."""
        return tuple(t.to(self.device, copy=True) for t in (self.query, self.key, self.value, self.start_cache))

    def reference(self, layer: AttentionLayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache after the pure-torch write, attention output in float64), both on the CPU."""
        cache = self.start_cache.clone()
        AttentionBackend().write_kv(cache, self.key, self.value, self.cpu_meta.slot_mapping)
        wide = cache.double()
        out = reference_paged_attention(
            self.query.double(), wide[0], wide[1], self.cpu_meta, scale=layer.scale,
            sliding_window=layer.sliding_window, soft_cap=layer.soft_cap, compute_dtype=torch.float64,
        )
        return cache, out


def within_tolerance(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, context: str) -> None:
    whole, worst = relative_error(out, ref)
    tol_whole, tol_worst = TOLERANCE[dtype]
    assert whole < tol_whole and worst < tol_worst, f"{context}: relative error {whole:.2e} (worst token {worst:.2e})"


@pytest.fixture
def make_step(device, check_dtype):
    """RaggedStep on the test's device (skips bf16 under the interpreter)."""

    def make(*args, dtype, **kwargs) -> RaggedStep:
        check_dtype(dtype)
        return RaggedStep(*args, dtype=dtype, device=device, **kwargs)

    return make


@pytest.fixture
def make_lengths():
    return ragged_lengths


@pytest.fixture
def check_output():
    return within_tolerance
