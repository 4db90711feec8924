"""GPU checks of podium-cuda's kernels that every platform launching them runs on its own device.

The CUDA platform's tests and the ROCm platform's tests (podium-cuda's kernels under the ROCm
tuning table, on an AMD GPU or forced onto an NVIDIA one) call the same checks, so the two
platforms are held to one specification. Each check takes what a platform installs (its op table,
or the platform itself) and raises AssertionError naming the case and its seed. Nothing here
imports triton or pytest: the ops and the platform bring the kernels.

- fused ops (``rms_norm``, ``fused_add_rms_norm``, ``rotary_embedding``, ``silu_and_mul``) against
  the contract's pure-torch reference ops, within two roundings of the output dtype; ``argmax``
  exactly (ties, NaNs, infinities, strided rows);
- a decode step captured with the platform's graph runner replays exactly like eager after new
  lengths, block tables, slots and q/k/v are copied into the captured tensors;
- the attention tests' shared pieces: random ragged lengths and the relative-error measure.

``triton_interpreter`` holds the pytest side (GPU / interpreter skips) both conftests use. Both are test
support, not part of the podium-cuda distribution: the root pyproject's pytest ``pythonpath`` names this
folder, so the ROCm tests import them too.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from podium_plugin_api import AttentionLayerSpec, AttentionMetadata, Platform, RotaryInputs, reference_paged_attention
from podium_plugin_api import ops as reference

OpTable = dict[str, Callable]

FUSED_OP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
RMS_NORM_HIDDEN = (576, 4096)  # 4096: 16 warps (1024 lanes on a 64-lane wavefront)
ROTARY_SHAPES = (((32, 8), 128), ((9, 3), 64), ((4, 1), 80))  # ((H, Hkv), head_size)
SILU_INTER = (1536, 14336, 100)
# two roundings of the output dtype: a fused exp/rsqrt may round an intermediate the other way
ULP2 = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 1e-4},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-3},
}


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    torch.testing.assert_close(actual, expected, **ULP2[dtype], msg=lambda m: f"{what}: {m}")


def check_rms_norm(ops: OpTable, dtype: torch.dtype, hidden: int, device: str, seed: int) -> None:
    """rms_norm and fused_add_rms_norm on 37 rows; the weight's dtype decides the output's."""
    what = f"rms_norm, {dtype}, hidden {hidden}, seed {seed}"
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, 37, hidden, dtype=dtype, device=device, scale=3.0)
    residual = _randn(gen, 37, hidden, dtype=dtype, device=device)
    weight = _randn(gen, hidden, dtype=dtype, device=device)
    _close(ops["rms_norm"](x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), dtype, what)
    normed, summed = ops["fused_add_rms_norm"](x, residual, weight, 1e-5)
    ref_normed, ref_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed), f"{what}: fused_add_rms_norm's sum differs from x + residual"
    _close(normed, ref_normed, dtype, f"fused_add_{what}")
    fp32_weight = weight.float()
    out, expected = ops["rms_norm"](x[:5], fp32_weight, 1e-6), reference.rms_norm(x[:5], fp32_weight, 1e-6)
    assert out.dtype == expected.dtype, f"{what}, float32 weight: output {out.dtype}, reference {expected.dtype}"
    _close(out, expected, dtype, f"{what}, float32 weight")


def check_rotary_embedding(
    ops: OpTable, dtype: torch.dtype, heads: tuple[int, int], head_size: int, device: str, seed: int
) -> None:
    """Neox rotary on query/key views of one fused qkv projection (token stride > heads x head size)."""
    what = f"rotary_embedding, {dtype}, heads {heads}, head_size {head_size}, seed {seed}"
    gen = torch.Generator().manual_seed(seed)
    num_tokens, (num_heads, num_kv_heads), max_pos = 29, heads, 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)  # [max_pos, D]
    qkv = _randn(gen, num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, device=device)
    q_width, k_end = num_heads * head_size, (num_heads + num_kv_heads) * head_size
    query = qkv[:, :q_width].view(num_tokens, num_heads, head_size)
    key = qkv[:, q_width:k_end].view(num_tokens, num_kv_heads, head_size)
    before = qkv.clone()
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(device)
    q, k = ops["rotary_embedding"](positions, query, key, cache)
    ref_q, ref_k = reference.rotary_embedding(positions, query, key, cache)
    _close(q, ref_q, dtype, f"{what}, query")
    _close(k, ref_k, dtype, f"{what}, key")
    assert torch.equal(qkv, before), f"{what}: the inputs were modified"


def check_silu_and_mul(ops: OpTable, dtype: torch.dtype, inter: int, device: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, 19, 2 * inter, dtype=dtype, device=device, scale=4.0)
    _close(ops["silu_and_mul"](x), reference.silu_and_mul(x), dtype, f"silu_and_mul, {dtype}, inter {inter}, seed {seed}")


ARGMAX_SHAPES = ((1, 128256), (5, 49152), (3, 4097), (2, 7))  # (rows, vocab): one, several, ragged chunks


def check_argmax(ops: OpTable, dtype: torch.dtype, rows: int, vocab: int, device: str, seed: int) -> None:
    """The first index of each row's maximum, exactly torch's: ties (values on a coarse grid), a
    late maximum, NaNs (the first one wins), an all -inf row, and rows of a wider tensor (strided)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randint(-20, 20, (rows + 3, vocab + 5), generator=gen).float() / 4  # many ties
    wide[0, vocab - 1] = 100.0  # the maximum in the last column
    wide[1, vocab // 2], wide[1, vocab // 3] = float("nan"), float("nan")
    wide[2, :] = float("-inf")
    wide[3, 0], wide[3, vocab - 1] = float("inf"), float("nan")
    for logits in (wide[:rows, :vocab], wide[3:rows + 3, :vocab]):
        on_device = logits.to(dtype=dtype, device=device)
        got = ops["argmax"](on_device)
        want = on_device.cpu().argmax(dim=-1)
        what = f"argmax, {dtype}, [{rows}, {vocab}] (row stride {on_device.stride(0)}), seed {seed}"
        assert got.dtype == torch.int64 and got.shape == (rows,), f"{what}: got {got.dtype} {list(got.shape)}"
        assert torch.equal(got.cpu(), want), f"{what}: {got.cpu().tolist()} != torch's {want.tolist()}"


def check_token_bitmask(op, dtype: torch.dtype, rows: int, vocab: int, device: str, seed: int) -> None:
    """Structured output's mask equal to the contract's reference, bit for bit: every row masked, and
    a subset in another order, over a vocabulary ending mid-word, with all-allowed / all-forbidden
    words among random ones, on rows of a wider tensor (strided)."""
    gen = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    for index in (None, torch.randperm(rows, generator=gen)[: max(1, rows // 2)]):
        count = rows if index is None else len(index)
        bitmask = torch.randint(-2**31, 2**31 - 1, (count, words), generator=gen, dtype=torch.int64).to(torch.int32)
        bitmask[0, 0], bitmask[-1, words - 1] = -1, 0
        wide = torch.randn(rows, vocab + 7, generator=gen).to(dtype)
        want = reference.apply_token_bitmask(wide[:, :vocab].clone(), bitmask, index)
        logits = wide.to(device)[:, :vocab]
        got = op(logits, bitmask.to(device), None if index is None else index.to(device))
        what = f"apply_token_bitmask, {dtype}, [{rows}, {vocab}], rows {None if index is None else index.tolist()}"
        assert got.data_ptr() == logits.data_ptr(), f"{what}: not in place"
        assert torch.equal(got.cpu(), want), f"{what}: differs from the reference"


# decode graph: Llama-3.1-8B attention (32 q heads, 8 KV heads, head 128), 8 sequences up to 2048
# tokens, so the step the graph holds takes the split (flash-decoding) path
NUM_SEQS, HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, MAX_LEN = 8, 32, 8, 128, 16, 2048


def cache_bits(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as integers, so fp8 caches compare with ``torch.equal`` (bit for bit)."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def _refill(seed: int, meta: AttentionMetadata, q, k, v, num_blocks: int) -> list[int]:
    """New lengths, block tables, slots and q/k/v copied into the same (captured) tensors."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(1, MAX_LEN) for _ in range(NUM_SEQS)]
    lens[0] = 1
    width = MAX_LEN // BLOCK_SIZE
    tables = torch.randperm(num_blocks, generator=gen)[: NUM_SEQS * width].view(NUM_SEQS, width).to(torch.int32)
    last = torch.tensor(lens) - 1
    slots = tables[torch.arange(NUM_SEQS), last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    meta.block_tables.copy_(tables)
    meta.slot_mapping.copy_(slots)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return lens


def check_decode_graph_replay(
    platform: Platform, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, rotary: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """A bf16 decode step (KV write + split attention; with ``rotary``, ``forward_rotary`` with the
    platform's rotary op, positions refilled too) captured with ``platform.graph_runner()``
    replays bit-exactly like eager, and both stay within bf16 tolerance of the reference, for three
    refills of lengths, tables, slots and q/k/v. ``cache_dtype``: the cache's, if not ``dtype`` (fp8)."""
    backend, runner = platform.attention_backend(), platform.graph_runner()
    rotate = platform.custom_ops().get("rotary_embedding", reference.rotary_embedding)
    angles = torch.rand(MAX_LEN, HEAD_SIZE // 2, generator=torch.Generator().manual_seed(7)) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)
    positions = torch.zeros(NUM_SEQS, dtype=torch.int64, device=device)
    layer = AttentionLayerSpec(HEADS, KV_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5)
    num_blocks = NUM_SEQS * (MAX_LEN // BLOCK_SIZE) + 5
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, device=device).to(cache_dtype or dtype)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(NUM_SEQS + 1, dtype=torch.int32, device=device),
        seq_lens=torch.ones(NUM_SEQS, dtype=torch.int32, device=device),
        block_tables=torch.zeros(NUM_SEQS, MAX_LEN // BLOCK_SIZE, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(NUM_SEQS, dtype=torch.int64, device=device),
        max_query_len=1,
        max_seq_len=MAX_LEN,  # the bound replays stay under: the split plan covers them
    )
    q = torch.empty(NUM_SEQS, HEADS, HEAD_SIZE, dtype=dtype, device=device)
    k = torch.empty(NUM_SEQS, KV_HEADS, HEAD_SIZE, dtype=dtype, device=device)
    v = torch.empty_like(k)
    assert backend.num_splits(meta, KV_HEADS) > 1, "the captured step should take the split path"
    inputs = RotaryInputs(positions, cos_sin, rotate)

    def step(kv_cache):
        if rotary:
            return backend.forward_rotary(layer, q, k, v, kv_cache, meta, inputs)
        return backend.forward(layer, q, k, v, kv_cache, meta)

    positions.copy_(meta.seq_lens.long() - 1)
    _refill(0, meta, q, k, v, num_blocks)
    replay = runner.capture(lambda: step(cache))
    for seed in (1, 2, 3):
        lens = _refill(seed, meta, q, k, v, num_blocks)
        positions.copy_(meta.seq_lens.long() - 1)
        eager_cache = cache.clone()
        eager = step(eager_cache).clone()
        replayed = replay()
        platform.synchronize()
        assert torch.equal(replayed, eager), f"graph replay != eager, seed {seed} lens {lens}"
        assert torch.equal(cache_bits(cache), cache_bits(eager_cache)), \
            f"graph replay's KV write != eager's, seed {seed} lens {lens}"
        query = reference.rotary_embedding(positions, q, k, cos_sin)[0] if rotary else q
        ref = reference_paged_attention(query.float(), cache[0].float(), cache[1].float(), meta, scale=layer.scale)
        err = float((replayed.float() - ref).norm() / ref.norm())
        assert err < 1.5e-2, f"replayed decode vs reference, seed {seed}: relative error {err:.2e}"


def ragged_lengths(rng: random.Random, num_seqs: int, max_len: int, kind: str, block_size: int):
    """(query_lens, seq_lens): decode (1 new token), prefill (all new), prefix (new tokens after a
    cached prefix, as on a prefix-cache hit or a later chunk), boundary (lengths at block edges),
    mixed (all four in one batch)."""
    query_lens, seq_lens = [], []
    for i in range(num_seqs):
        pick = kind if kind != "mixed" else ("decode", "prefill", "prefix", "boundary")[i % 4]
        if pick == "boundary":
            s = block_size * rng.randint(1, max(1, max_len // block_size)) + rng.choice([-1, 0, 1])
            s = max(2, min(s, max_len))
            q = min(rng.choice([1, block_size, block_size + 1, s]), s)
        else:
            s = rng.randint(2 if pick == "prefix" else 1, max_len)
            q = {"decode": 1, "prefill": s, "prefix": rng.randint(1, s - 1) if s > 1 else 1}[pick]
        query_lens.append(q)
        seq_lens.append(s)
    return query_lens, seq_lens


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||out - ref|| / ||ref|| over everything, the worst per-token value), in float64 on the CPU;
    NaN or inf in ``out`` -> inf."""
    out = out.detach().cpu()
    if not torch.isfinite(out).all():
        return float("inf"), float("inf")
    refn = ref.detach().cpu().double().flatten(1)
    diff = out.double().flatten(1) - refn
    whole = float(diff.norm() / refn.norm())
    worst = float((diff.norm(dim=1) / refn.norm(dim=1).clamp_min(1e-12)).max())
    return whole, worst
