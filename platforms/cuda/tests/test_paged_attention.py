"""Triton paged attention against the contract's reference (float64) on fresh random ragged batches."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from podium_plugin_api import AttentionLayerSpec, reference_paged_attention

pytestmark = pytest.mark.cuda

# dtype -> (whole-batch relative error, worst-token relative error)
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (1.5e-2, 4e-2)}

CASES = [
    # kind, num_seqs, max_len, heads (H, Hkv), head_size, block_size, window, cap, dtype
    ("decode", 6, 300, (32, 8), 128, 16, None, None, torch.bfloat16),
    ("prefill", 4, 150, (32, 8), 128, 16, None, None, torch.bfloat16),
    ("prefix", 5, 200, (16, 4), 128, 16, None, None, torch.float16),
    ("boundary", 6, 96, (8, 8), 64, 16, None, None, torch.float32),
    ("mixed", 8, 180, (16, 2), 64, 16, None, None, torch.bfloat16),
    ("mixed", 8, 180, (8, 8), 128, 32, None, None, torch.float32),
    ("mixed", 8, 180, (16, 2), 128, 8, None, None, torch.float32),
    ("mixed", 6, 160, (8, 1), 64, 16, None, None, torch.float16),
    ("mixed", 6, 200, (16, 4), 128, 16, 40, None, torch.bfloat16),
    ("mixed", 6, 200, (16, 4), 64, 16, 17, 2.0, torch.float32),
    ("mixed", 6, 120, (16, 4), 128, 16, None, 1.5, torch.bfloat16),
    ("mixed", 5, 100, (12, 4), 96, 16, None, None, torch.float32),  # group 3, padded head size
    ("mixed", 4, 100, (8, 2), 256, 16, None, None, torch.bfloat16),
    ("boundary", 5, 70, (8, 2), 64, 7, None, None, torch.float32),  # odd block size
]


def _layer(heads, head_size, window, cap):
    return AttentionLayerSpec(heads[0], heads[1], head_size, head_size**-0.5, sliding_window=window, soft_cap=cap)


def _reference(batch, layer):
    cache = batch.kv_cache.double()
    return reference_paged_attention(
        batch.query.double(), cache[0], cache[1], batch.meta, scale=layer.scale,
        sliding_window=layer.sliding_window, soft_cap=layer.soft_cap, compute_dtype=torch.float64,
    )


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[3][0]}x{c[3][1]}-d{c[4]}-b{c[5]}-w{c[6]}-c{c[7]}-{str(c[8])[6:]}" for c in CASES])
def test_backend_matches_reference(case, kernel_device, check_dtype, make_batch, make_lengths, rel_error):
    from podium_cuda.attention import TritonAttentionBackend

    kind, num_seqs, max_len, heads, head_size, block_size, window, cap, dtype = case
    check_dtype(dtype)
    seed = random.randrange(1 << 30)  # fresh inputs each run; the seed is in the failure message
    query_lens, seq_lens = make_lengths(random.Random(seed), num_seqs, max_len, kind, block_size)
    batch = make_batch(query_lens, seq_lens, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                       block_size=block_size, dtype=dtype, device=kernel_device, seed=seed)
    layer = _layer(heads, head_size, window, cap)
    out = TritonAttentionBackend().attend(layer, batch.query, batch.kv_cache, batch.meta)
    whole, worst = rel_error(out, _reference(batch, layer))
    tol_whole, tol_worst = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert whole < tol_whole and worst < tol_worst, f"seed {seed} lens {list(zip(query_lens, seq_lens))}: {whole:.2e} {worst:.2e}"


@pytest.mark.parametrize("merge", [False, True], ids=["merge-launch", "merge-in-kernel"])
@pytest.mark.parametrize("num_splits", [1, 2, 8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_matches_reference_and_fills_poisoned_output(
    num_splits, dtype, merge, kernel_device, check_dtype, make_batch, rel_error
):
    """Flash-decoding splits (some splits empty for the short sequence) and a NaN-poisoned output; merged
    by a launch after them or by each (sequence, kv head)'s last split (twice: its counters come back to
    zero)."""
    from dataclasses import replace

    from podium_cuda.paged_attention import paged_attention
    from podium_cuda.tuning import CUDA_TUNING

    check_dtype(dtype)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    seq_lens = [rng.randint(900, 1500), 1, rng.randint(2, 40), rng.randint(200, 700)]
    batch = make_batch([1] * 4, seq_lens, num_heads=16, num_kv_heads=4, head_size=128, block_size=16,
                       dtype=dtype, device=kernel_device, seed=seed)
    layer = _layer((16, 4), 128, None, None)
    tuning = replace(CUDA_TUNING, attention_merge_in_kernel=merge)
    reference = _reference(batch, layer)
    for _ in range(2):
        out = torch.full_like(batch.query, float("nan"))
        paged_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], batch.meta.query_start_loc,
                        batch.meta.seq_lens, batch.meta.block_tables, scale=layer.scale, max_query_len=1,
                        num_splits=num_splits, out=out, tuning=tuning)
        whole, worst = rel_error(out, reference)
        assert whole < TOLERANCE[dtype][0] and worst < TOLERANCE[dtype][1], \
            f"seed {seed} {seq_lens}: {whole:.2e} {worst:.2e}"


TABLE_CASES = [CASES[i] for i in (0, 2, 3, 8, 9, 13)] + [  # decode, prefix, boundary, window, window+cap, block 7
    ("decode", 5, 300, (16, 4), 128, 16, None, None, torch.float32),  # (the interpreter's tl.dot is wrong in bf16)
]


@pytest.mark.parametrize("table_blocks", [4, 64])
@pytest.mark.parametrize("case", TABLE_CASES, ids=[f"{c[0]}-d{c[4]}-b{c[5]}-w{c[6]}-{str(c[8])[6:]}" for c in TABLE_CASES])
def test_block_ids_in_registers_match_reference(case, table_blocks, kernel_device, check_dtype, make_batch, make_lengths,
                                                rel_error):
    """Block ids from table entries held in registers (``AttentionTiling.table_blocks``):
    4 entries make every sequence span several chunks (and, at block size 7, tiles that straddle a
    chunk's first block); decodes also through splits."""
    from dataclasses import replace

    from podium_cuda.attention import TritonAttentionBackend
    from podium_cuda.paged_attention import paged_attention
    from podium_cuda.tuning import CUDA_TUNING

    kind, num_seqs, max_len, heads, head_size, block_size, window, cap, dtype = case
    check_dtype(dtype)
    seed = random.randrange(1 << 30)
    query_lens, seq_lens = make_lengths(random.Random(seed), num_seqs, max_len, kind, block_size)
    batch = make_batch(query_lens, seq_lens, num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                       block_size=block_size, dtype=dtype, device=kernel_device, seed=seed)
    layer = _layer(heads, head_size, window, cap)
    tuning = replace(CUDA_TUNING, decode=replace(CUDA_TUNING.decode, table_blocks=table_blocks),
                     prefill=replace(CUDA_TUNING.prefill, table_blocks=table_blocks))
    ref = _reference(batch, layer)
    outs = [TritonAttentionBackend(tuning).attend(layer, batch.query, batch.kv_cache, batch.meta)]
    if max(query_lens) == 1:
        out = torch.full_like(batch.query, float("nan"))
        outs.append(paged_attention(
            batch.query, batch.kv_cache[0], batch.kv_cache[1], batch.meta.query_start_loc, batch.meta.seq_lens,
            batch.meta.block_tables, scale=layer.scale, max_query_len=1, sliding_window=window, soft_cap=cap,
            num_splits=4, out=out, tuning=tuning))
    tol_whole, tol_worst = TOLERANCE[dtype]
    for out in outs:
        whole, worst = rel_error(out, ref)
        assert whole < tol_whole and worst < tol_worst, f"seed {seed} lens {list(zip(query_lens, seq_lens))}: {whole:.2e} {worst:.2e}"


def test_table_chunks_cover_whole_tiles():
    from podium_cuda.paged_attention import _table_chunk
    from podium_cuda.tuning import AttentionTiling

    assert _table_chunk(0, 32, 16) == (0, 1)
    assert _table_chunk(64, 32, 16) == (64, 32)  # tiles start on block boundaries: 64 blocks = 32 tiles
    assert _table_chunk(4, 16, 7) == (4, 1)  # a 16-key tile may touch 3 blocks of 7 from mid-block: 3 usable
    assert _table_chunk(2, 64, 16) == (0, 1)  # one tile needs 4 entries
    with pytest.raises(ValueError, match="table_blocks must be 0 or a power of two"):
        AttentionTiling(16, 32, 1, 3, table_blocks=48)


def test_prefill_fills_poisoned_output_and_window_cap(kernel_device, make_batch, rel_error):
    """Every row of a mixed batch is written (output poisoned with NaN first), with window and cap on."""
    from podium_cuda.paged_attention import paged_attention

    seed = random.randrange(1 << 30)
    query_lens, seq_lens = [1, 37, 64, 3, 129], [50, 37, 100, 3, 200]
    batch = make_batch(query_lens, seq_lens, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.float32, device=kernel_device, seed=seed)
    layer = _layer((8, 2), 64, 24, 3.0)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(batch.query, batch.kv_cache[0], batch.kv_cache[1], batch.meta.query_start_loc, batch.meta.seq_lens,
                    batch.meta.block_tables, scale=layer.scale, max_query_len=max(query_lens),
                    sliding_window=24, soft_cap=3.0, out=out)
    whole, worst = rel_error(out, _reference(batch, layer))
    assert whole < 2e-5 and worst < 1e-4, f"seed {seed}: {whole:.2e} {worst:.2e}"


def test_backend_plans_splits_for_long_decode_only(kernel_device, make_batch):
    from podium_cuda.attention import TritonAttentionBackend

    backend = TritonAttentionBackend()
    long_decode = make_batch([1], [4096], num_heads=8, num_kv_heads=8, head_size=64, block_size=16,
                             dtype=torch.float32, device="cpu", seed=0)
    assert backend.num_splits(long_decode.meta, 8) > 1
    prefill = make_batch([64], [4096], num_heads=8, num_kv_heads=8, head_size=64, block_size=16,
                         dtype=torch.float32, device="cpu", seed=0)
    assert backend.num_splits(prefill.meta, 8) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_step_with_leading_decodes_takes_both_launches(dtype, kernel_device, check_dtype, make_batch, rel_error):
    """A mixed step starting with decodes: the decode launch for them, the prefill launch for the
    rest (a decode behind a prefill stays there), and every row matches the reference."""
    from dataclasses import replace

    from podium_cuda.attention import MIXED_SPLIT, TritonAttentionBackend
    from podium_cuda.tuning import CUDA_TUNING

    check_dtype(dtype)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    decodes = rng.randint(3, 6)
    query_lens = [1] * decodes + [rng.randint(2, 70), 1, rng.randint(20, 90)]
    seq_lens = [rng.randint(1, 400) for _ in range(decodes)] + [q + rng.randint(0, 150) for q in query_lens[decodes:]]
    batch = make_batch(query_lens, seq_lens, num_heads=16, num_kv_heads=4, head_size=128, block_size=16,
                       dtype=dtype, device=kernel_device, seed=seed)
    layer = _layer((16, 4), 128, None, None)
    ref = _reference(batch, layer)
    for min_decodes, split in ((decodes, True), (decodes + 1, False), (0, False)):
        backend = TritonAttentionBackend(replace(CUDA_TUNING, mixed_decode_min=min_decodes))
        meta = backend.prepare_metadata(replace(batch.meta, extras={}))
        prefix = meta.extras.get(MIXED_SPLIT)
        assert (prefix is not None) == split
        if split:
            assert prefix.num_decodes == decodes and prefix.decodes.is_pure_decode
            assert prefix.rest.query_start_loc.tolist() == [0, *itertools.accumulate(query_lens[decodes:])]
        out = backend.attend(layer, batch.query, batch.kv_cache, meta)
        whole, worst = rel_error(out, ref)
        assert whole < TOLERANCE[dtype][0] and worst < TOLERANCE[dtype][1], \
            f"seed {seed} min {min_decodes} lens {list(zip(query_lens, seq_lens))}: {whole:.2e} {worst:.2e}"
