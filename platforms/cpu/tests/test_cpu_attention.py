"""The CPU platform's paged attention against the pure-torch reference, on random ragged batches.

Every path is exercised: the native kernel (or IPEX's, in `make test-ipex`), the pure-torch
batched decode and per-sequence SDPA used without a compiler, the generic (non-vectorised)
branches of the kernel (block sizes and head sizes that are not multiples of 16), and the bf16
key layout's fallback for odd head sizes (no (d, d+1) pairs: torch paths).
"""

from __future__ import annotations

import os

import pytest
import torch

from podium_cpu import CpuPlatform
from podium_cpu.attention import CpuAttentionBackend
from podium_cpu.ipex_support import ipex_status
from podium_cpu.native_kernels import load_kernels
from podium_plugin_api import AttentionMetadata, KVCacheSpec
from podium_plugin_api.testing.batches import AttentionCase, build_batch
from podium_plugin_api.testing.report import check_close

CASES = [
    AttentionCase("decodes-gqa", ((1, 5), (1, 16), (1, 17), (1, 100), (1, 1)), num_heads=9, num_kv_heads=3),
    AttentionCase("mixed", ((1, 37), (23, 23), (9, 49), (1, 16), (40, 40), (17, 60)), num_heads=8, num_kv_heads=2),
    AttentionCase("window", ((1, 70), (25, 60), (3, 20), (33, 33)), num_heads=4, num_kv_heads=2, sliding_window=19),
    AttentionCase("soft-cap", ((1, 30), (12, 12), (5, 26), (20, 45)), num_heads=4, num_kv_heads=1, soft_cap=2.5),
    AttentionCase("block4-head80", ((1, 9), (6, 6), (2, 13)), num_heads=4, num_kv_heads=2, head_size=80, block_size=4),
    AttentionCase("block32-mha", ((1, 70), (12, 45), (1, 33)), num_heads=4, num_kv_heads=4, block_size=32),
    AttentionCase("head72", ((1, 40), (5, 21)), num_heads=6, num_kv_heads=2, head_size=72),
    AttentionCase("odd-head33", ((1, 40), (5, 21)), num_heads=2, num_kv_heads=1, head_size=33),  # keys not paired
    AttentionCase("decodes-window", ((1, 70), (1, 5), (1, 33)), num_heads=4, num_kv_heads=2, sliding_window=19),
    AttentionCase("decodes-soft-cap", ((1, 30), (1, 64)), num_heads=4, num_kv_heads=1, soft_cap=2.5),
    # longer queries: several tiles a sequence (attention_plan.tiles_for), fresh and over cached context
    AttentionCase("long", ((1, 37), (60, 60), (50, 90), (23, 23), (1, 16)), num_heads=8, num_kv_heads=2),
    AttentionCase("long-window", ((64, 64), (49, 80), (1, 70)), num_heads=4, num_kv_heads=2, sliding_window=19),
    AttentionCase("long-soft-cap", ((50, 50), (1, 30)), num_heads=4, num_kv_heads=1, soft_cap=2.5),
    # SmolLM2's heads: a long fresh prompt, a chunk over a long cached context, a decode among them
    AttentionCase("prefill-smollm2", ((300, 300), (130, 700), (1, 500), (2, 2)), num_heads=9, num_kv_heads=3),
    AttentionCase("prefill-window-mha", ((200, 260), (97, 97)), num_heads=2, num_kv_heads=2, sliding_window=70,
                  block_size=32),
]


@pytest.fixture(scope="module")
def platform():
    return CpuPlatform()


def run_case(platform, backend, case, dtype, seed=0):
    batch = build_batch(platform, backend, case, dtype, seed)
    layer = case.layer()
    out = backend.forward(layer, batch.query, batch.key, batch.value, batch.kv_cache, batch.meta)
    check_close(out, batch.reference_output(), what=f"{backend.name} {case.name}", dtype=dtype, locate=batch.locate)
    again = backend.attend(layer, batch.query, batch.kv_cache, batch.meta)
    check_close(again, out, what=f"{backend.name} {case.name}: attend over the cache", dtype=dtype)
    return batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_platform_backend_matches_reference(platform, case, dtype):
    run_case(platform, platform.attention_backend(), case, dtype, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.name)
def test_pure_torch_paths_match_reference(platform, case, dtype):
    run_case(platform, CpuAttentionBackend(kernels=None), case, dtype, seed=2)


@pytest.mark.parametrize("case", [c for c in CASES if c.head_size == 64 and c.block_size == 16 and
                                  any(q > 1 for q, _ in c.seqs)], ids=lambda c: c.name)
def test_bf16_prefill_tiles_on_amx_and_on_avx512_both_match_the_reference(platform, case):
    """Where AMX runs, bf16 prefill tiles of SmolLM2's shape (head 64, block 16) go to AMX tiles
    (amx_attention.h); the AVX512-BF16 tiles they replaced stay the path of CPUs without AMX.
    Both against the reference: scores, the masks (causal, window), soft cap, rescaled sums."""
    kernels, why = load_kernels()
    if kernels is None:
        pytest.skip(why)
    if not kernels.amx_linear:
        pytest.skip("no AMX here: the AVX512-BF16 tiles run, tested above")
    for amx in (True, False):  # (the platform's amx option)
        run_case(platform, CpuAttentionBackend(kernels, amx=amx), case, torch.bfloat16, seed=3 + amx)


def test_native_kernel_is_built_here():
    kernels, why = load_kernels()
    assert kernels is not None, why
    assert CpuPlatform().attention_backend().name == "cpu-paged-native"


def ipex_backend():
    ipex, why = ipex_status()
    if ipex is None:
        if os.environ.get("PODIUM_EXPECT_IPEX"):  # `make test-ipex`: IPEX must load there
            pytest.fail(f"intel_extension_for_pytorch did not load: {why or 'not installed'}")
        pytest.skip("intel_extension_for_pytorch is not installed")
    from podium_cpu.ipex_attention import IpexAttentionBackend

    return IpexAttentionBackend(ipex)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ipex_backend_matches_reference(platform, case, dtype):
    run_case(platform, ipex_backend(), case, dtype, seed=3)


def test_plan_follows_metadata_changed_in_place(platform):
    """A step's plan is reused by its layers, but not once the metadata it described changed."""
    backend = platform.attention_backend()
    case = AttentionCase("grow", ((1, 20), (1, 35)), num_heads=4, num_kv_heads=2)
    batch = run_case(platform, backend, case, torch.float32)
    meta = batch.meta
    # both sequences one token shorter: their last keys must no longer be seen
    shorter = AttentionMetadata.from_lengths([1, 1], [19, 34], batch.ref_meta.block_tables.tolist(), 16)
    meta.seq_lens.copy_(shorter.seq_lens)
    meta.seq_lens_host[:] = [19, 34]
    batch.ref_meta.seq_lens.copy_(shorter.seq_lens)
    out = backend.attend(case.layer(), batch.query, batch.kv_cache, meta)
    check_close(out, batch.reference_output(), what="after the lengths changed in place", dtype=torch.float32)


def test_block_ids_beyond_the_cache_are_rejected(platform):
    backend = platform.attention_backend()
    case = AttentionCase("bad", ((1, 20),), num_heads=4, num_kv_heads=2)
    batch = build_batch(platform, backend, case, torch.float32, 0)
    batch.meta.block_tables[0, 0] = 10_000
    with pytest.raises(ValueError, match="block"):
        backend.forward(case.layer(), batch.query, batch.key, batch.value, batch.kv_cache, batch.meta)


def test_write_outside_the_cache_is_rejected(platform):
    backend = platform.attention_backend()
    case = AttentionCase("w", ((1, 4),), num_heads=4, num_kv_heads=2)
    batch = build_batch(platform, backend, case, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="slot"):
        backend.write_kv(batch.kv_cache, batch.key, batch.value, torch.tensor([10_000]))


def test_kernel_refuses_a_foreign_cache_layout(platform):
    """A cache tensor in another layout must raise, not reach the native code."""
    backend = platform.attention_backend()
    case = AttentionCase("layout", ((1, 20),), num_heads=4, num_kv_heads=2)
    batch = build_batch(platform, backend, case, torch.float32, 0)
    wrong = batch.kv_cache.transpose(2, 3)  # [2, blocks, block_size, Hkv, D], not contiguous
    with pytest.raises(ValueError):
        backend.attend(case.layer(), batch.query, wrong, batch.meta)


def _exploding_rotate(*args):
    raise AssertionError("the fused path must not call the rotary op")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [c for c in CASES if c.head_size % 2 == 0], ids=lambda c: c.name)
def test_fused_rotary_equals_rotary_then_forward_bit_for_bit(platform, case, dtype):
    """Every step rotates inside the kernel, with exactly the rotary op's roundings."""
    from podium_plugin_api import RotaryInputs, ops
    from podium_plugin_api.testing.attention_checks import rotary_table

    backend = platform.attention_backend()
    fused, plain = (build_batch(platform, backend, case, dtype, 5) for _ in range(2))
    positions = torch.cat([torch.arange(s - q, s) for q, s in case.seqs])
    table = rotary_table(max(s for _, s in case.seqs), case.head_size)
    got = backend.forward_rotary(case.layer(), fused.query, fused.key, fused.value, fused.kv_cache, fused.meta,
                                 RotaryInputs(positions, table, _exploding_rotate))
    query, key = ops.rotary_embedding(positions, plain.query, plain.key, table)
    want = backend.forward(case.layer(), query, key, plain.value, plain.kv_cache, plain.meta)
    assert torch.equal(got, want)
    assert torch.equal(fused.kv_cache, plain.kv_cache)


def test_fused_rotary_rejects_positions_beyond_the_table(platform):
    from podium_plugin_api import RotaryInputs
    from podium_plugin_api.testing.attention_checks import rotary_table

    backend = platform.attention_backend()
    case = AttentionCase("r", ((1, 20), (1, 9)), num_heads=4, num_kv_heads=2)
    batch = build_batch(platform, backend, case, torch.bfloat16, 0)
    rotary = RotaryInputs(torch.tensor([19, 8]), rotary_table(10, case.head_size), _exploding_rotate)
    with pytest.raises(ValueError, match=r"positions must be in \[0, 10\)"):
        backend.forward_rotary(case.layer(), batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, rotary)


def _tile_backend(platform):
    """The native backend as a CPU without AMX runs it (AMX machines: their AVX512-BF16 tiles)."""
    kernels, why = load_kernels()
    if kernels is None:
        pytest.skip(why)
    return CpuAttentionBackend(kernels, amx=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [0, 37], ids=["causal", "window37"])
def test_a_prompt_rows_do_not_depend_on_how_it_was_chunked(platform, dtype, window):
    """A query row's prefill result is the same bits whether its prompt came whole or in chunks over
    the cached rest: its tile's other rows, where the tiles start and how many keys a tile sees
    change nothing (the tiles' online softmax is per row, its steps aligned to the cache blocks)."""
    from podium_plugin_api import AttentionLayerSpec

    backend = _tile_backend(platform)
    heads, kv_heads, head_size, block, total = 9, 3, 64, 16, 150
    layer = AttentionLayerSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=head_size, scale=head_size**-0.5,
                               sliding_window=window or None)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(total, heads, head_size, generator=gen).to(dtype)
    k, v = (torch.randn(total, kv_heads, head_size, generator=gen).to(dtype) for _ in range(2))
    table = torch.randperm(12, generator=gen)[: -(-total // block)].tolist()
    spec = KVCacheSpec(num_layers=1, num_kv_heads=kv_heads, head_size=head_size, block_size=block, dtype=dtype)
    cache = torch.zeros(backend.kv_cache_shape(spec, 12), dtype=dtype)

    def prefill(start: int, end: int) -> torch.Tensor:
        meta = AttentionMetadata.from_lengths([end - start], [end], [table], block)
        return backend.forward(layer, q[start:end], k[start:end], v[start:end], cache, backend.prepare_metadata(meta))

    whole = prefill(0, total)
    for start, end in ((0, 21), (21, 26), (26, 101), (101, 150)):  # tiles of 1 to 3 vectors of rows
        assert torch.equal(prefill(start, end), whole[start:end]), (start, end)
