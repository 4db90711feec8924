"""The Pallas backend's cache layout and kernel wiring, on CPU tensors (no TPU here).

The kernel itself runs only on TPU v4+. What can be checked without one: the interleaved layout
(write/read/split agree), the fallback to the pure-XLA math for head layouts the kernel cannot
tile, and that the kernel is called with inputs meaning what its contract says. For the last, a
stand-in kernel computes the contract from its arguments alone: pages with key head h at combined
head 2h and value head h at 2h + 1, ``kv_lens``/``page_indices``/``cu_q_lens`` valid for the first
``num_seqs`` sequences. Under ``make test-tpu`` torch_xla's own non-kernel definition of the
contract is used too.
"""

from __future__ import annotations

import pytest
import torch
from tpu_test_batches import padded_meta, random_tables

from podium_plugin_api import AttentionLayerSpec, AttentionMetadata, KVCacheSpec
from podium_plugin_api.reference import reference_paged_attention
from podium_tpu.pallas_attention import PallasAttentionBackend, kernel_inputs


def contract_kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap):
    """The ragged paged attention contract, computed from the kernel's own arguments."""
    for name, t in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens),
                    ("num_seqs", num_seqs)):
        assert t.dtype == torch.int32, name
    assert num_seqs.shape == (1,) and cu_q_lens.shape == (kv_lens.shape[0] + 1,)
    n = int(num_seqs[0])
    meta = AttentionMetadata(cu_q_lens[: n + 1], kv_lens[:n], page_indices[:n], torch.empty(0), 0, 0)
    out = torch.zeros_like(q)
    real = int(cu_q_lens[n])
    out[:real] = reference_paged_attention(q[:real], kv_pages[:, :, 0::2], kv_pages[:, :, 1::2], meta,
                                           scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    return out


def torch_xla_nonkernel():
    """torch_xla's own definition of the kernel's semantics (only where torch_xla is installed)."""
    custom_kernel = pytest.importorskip("torch_xla.experimental.custom_kernel")
    reference = getattr(custom_kernel, "_ragged_paged_attention_nonkernel", None)
    if reference is None:
        pytest.skip("this torch_xla has no _ragged_paged_attention_nonkernel")

    def kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window, soft_cap):
        real = reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, None, None, sm_scale=sm_scale,
                         sliding_window=sliding_window, soft_cap=soft_cap)
        return torch.cat([real, torch.zeros(q.shape[0] - real.shape[0], *q.shape[1:], dtype=q.dtype)])

    return kernel


def run(backend, kv_heads, head_size, window=None, soft_cap=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query_lens, seq_lens, bs, heads = [1, 6, 3], [11, 6, 9], 4, 2 * kv_heads
    tables, num_blocks = random_tables(seq_lens, bs, gen)
    spec = KVCacheSpec(1, kv_heads, head_size, bs, torch.float32)
    cache = torch.randn(backend.kv_cache_shape(spec, num_blocks), generator=gen)
    meta = padded_meta(query_lens, seq_lens, tables, bs)
    t = meta.num_tokens
    q = torch.randn(t, heads, head_size, generator=gen)
    k, v = torch.randn(t, kv_heads, head_size, generator=gen), torch.randn(t, kv_heads, head_size, generator=gen)
    layer = AttentionLayerSpec(heads, kv_heads, head_size, head_size**-0.5, window, soft_cap)
    out = backend.forward(layer, q, k, v, cache, meta)
    ref_meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, bs)
    key_cache, value_cache = backend.split_cache(cache)
    expected = reference_paged_attention(q[:10].double(), key_cache.double(), value_cache.double(), ref_meta,
                                         scale=layer.scale, sliding_window=window, soft_cap=soft_cap,
                                         compute_dtype=torch.float64)
    return out, expected, cache, k, v, meta


def test_interleaved_layout_round_trips_and_padding_writes_scratch_only():
    backend = PallasAttentionBackend(kernel=contract_kernel)
    spec = KVCacheSpec(1, 2, 128, 4, torch.float32)
    assert backend.kv_cache_shape(spec, 5) == (6, 4, 4, 128)  # one scratch block, 2 * Hkv combined heads
    cache = torch.zeros(backend.kv_cache_shape(spec, 5))
    k, v = torch.randn(3, 2, 128), torch.randn(3, 2, 128)
    backend.write_kv(cache, k, v, torch.tensor([7, -1, 0]))
    got_k, got_v = backend.read_kv(cache, torch.tensor([7, 0]))
    assert torch.equal(got_k, k[[0, 2]]) and torch.equal(got_v, v[[0, 2]])
    assert torch.equal(cache[1, 3, 0::2], k[0]) and torch.equal(cache[1, 3, 1::2], v[0])  # slot 7 = block 1, offset 3
    assert torch.count_nonzero(cache[:5]) == torch.count_nonzero(torch.stack([k[[0, 2]], v[[0, 2]]]))
    assert torch.count_nonzero(cache[5]) > 0  # the padded token went to the scratch block


@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (5, None), (None, 3.0)])
def test_kernel_gets_its_contract_inputs(window, soft_cap):
    backend = PallasAttentionBackend(kernel=contract_kernel)
    out, expected, *_ = run(backend, kv_heads=2, head_size=128, window=window, soft_cap=soft_cap)
    torch.testing.assert_close(out[:10].double(), expected, rtol=1e-5, atol=1e-5)


def test_kernel_wiring_against_torch_xla_definition():
    backend = PallasAttentionBackend(kernel=torch_xla_nonkernel())
    out, expected, *_ = run(backend, kv_heads=2, head_size=128, window=5)
    torch.testing.assert_close(out[:10].double(), expected, rtol=1e-5, atol=1e-5)


def test_untileable_heads_fall_back_to_xla_math():
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel cannot tile 3 kv heads of size 64; the fallback must run")

    backend = PallasAttentionBackend(kernel=no_kernel)
    out, expected, *_ = run(backend, kv_heads=3, head_size=64)
    torch.testing.assert_close(out[:10].double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[10:], torch.zeros_like(out[10:]))


def test_kernel_inputs_count_real_sequences_on_device():
    meta = padded_meta([2, 1], [5, 9], [[0, 1], [2, 3, 4]], 4)
    kv_lens, pages, cu, num_seqs = kernel_inputs(meta)
    assert num_seqs.tolist() == [2] and kv_lens.shape == (8,) and cu.shape == (9,) and pages.shape == (8, 4)
