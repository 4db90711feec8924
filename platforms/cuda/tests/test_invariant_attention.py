"""The batch-invariant attention (podium_cuda.invariant_attention): within rounding of the float64
reference, and a query token's output bit for bit the same computed as a decode alone, as a decode
among other sequences, inside a prefill chunk of any size (after a cached prefix or not) and inside
batches of other compositions. The default kernel is shown to differ on the same inputs, so the
property is not vacuous.

Under TRITON_INTERPRET=1 float32 only (the interpreter's bf16 dot is wrong); on a GPU bf16 too.
Shapes are small and key tiles 16 wide, so a sequence spans several tiles in the interpreter's time.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from cuda_checks import relative_error

from podium_cuda.tuning import CUDA_TUNING, AttentionTiling
from podium_plugin_api import AttentionLayerSpec, AttentionMetadata, reference_paged_attention

pytestmark = pytest.mark.cuda
invariant = pytest.importorskip("podium_cuda.invariant_attention", reason="the invariant attention needs triton")

TUNING = replace(CUDA_TUNING, invariant_attention=AttentionTiling(16, 16, 4, 2))  # several key tiles a sequence
HEADS, HEAD_SIZE, BLOCK_SIZE = (4, 1), 16, 8  # GQA group 4: 4 positions a program
SEQ_LENS = (26, 13, 19)


class Sequences:
    """Fixed per-position queries, keys and values of a few sequences; ``run`` computes any batch of
    pieces (seq, start, end): the queries of positions [start, end) over keys [0, end), each piece
    over freshly drawn cache blocks, so a position's bits never depend on where it is stored."""

    def __init__(self, dtype: torch.dtype, device: str, seed: int, cache_dtype: torch.dtype | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q = [torch.randn(n, HEADS[0], HEAD_SIZE, generator=gen).to(device, dtype) for n in SEQ_LENS]
        self.kv = [torch.randn(2, n, HEADS[1], HEAD_SIZE, generator=gen).to(device, cache_dtype or dtype)
                   for n in SEQ_LENS]
        self.dtype, self.device, self.rng = dtype, device, random.Random(seed)

    def run(self, pieces, layer: AttentionLayerSpec, attend) -> dict[tuple[int, int], torch.Tensor]:
        blocks = [-(-end // BLOCK_SIZE) for _, _, end in pieces]
        free = list(range(sum(blocks) + 2))
        self.rng.shuffle(free)
        cache = torch.zeros(2, len(free), BLOCK_SIZE, HEADS[1], HEAD_SIZE, dtype=self.kv[0].dtype, device=self.device)
        tables = []
        for (seq, _, end), count in zip(pieces, blocks):
            table = [free.pop() for _ in range(count)]
            for pos in range(end):
                cache[:, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = self.kv[seq][:, pos]
            tables.append(table)
        meta = AttentionMetadata.from_lengths([end - start for _, start, end in pieces], [e for *_, e in pieces],
                                              tables, BLOCK_SIZE, device=self.device)
        query = torch.cat([self.q[seq][start:end] for seq, start, end in pieces])
        out = attend(layer, query, cache, meta)
        rows = [(seq, pos) for seq, start, end in pieces for pos in range(start, end)]
        return {row: out[i] for i, row in enumerate(rows)}

    def reference(self, layer: AttentionLayerSpec) -> dict[tuple[int, int], torch.Tensor]:
        pieces = [(seq, 0, n) for seq, n in enumerate(SEQ_LENS)]
        return self.run(pieces, layer, lambda lay, q, cache, meta: reference_paged_attention(
            q.double(), cache[0].double(), cache[1].double(), meta, scale=lay.scale,
            sliding_window=lay.sliding_window, soft_cap=lay.soft_cap, compute_dtype=torch.float64))


def _layer(window=None, cap=None) -> AttentionLayerSpec:
    return AttentionLayerSpec(HEADS[0], HEADS[1], HEAD_SIZE, HEAD_SIZE**-0.5, sliding_window=window, soft_cap=cap)


def _invariant_attend(layer, query, cache, meta):
    return invariant.InvariantAttentionBackend(TUNING).attend(layer, query, cache, meta)


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _ways(rng: random.Random) -> dict[str, list[list[tuple[int, int, int]]]]:
    """Batches computing every position of every sequence, each a different way."""
    n0, n1, n2 = SEQ_LENS
    decodes = [[(s, p, p + 1)] for s, n in enumerate(SEQ_LENS) for p in range(n)]  # each token alone
    batched_decodes = [[(0, p, p + 1), (1, p % n1, p % n1 + 1), (2, p % n2, p % n2 + 1)] for p in range(n0)]
    ways = {"decode alone": decodes, "decodes among others": batched_decodes,
            "whole prompts in one batch": [[(s, 0, n) for s, n in enumerate(SEQ_LENS)]]}
    for size in (3, 5, 16):  # chunked prefill after the cached prefix of the chunks before
        steps = [[(s, a, b) for s, n in enumerate(SEQ_LENS) for a, b in _chunks(n, size)[k:k + 1]]
                 for k in range(-(-max(SEQ_LENS) // size))]
        ways[f"chunks of {size}"] = [step for step in steps if step]
    mixed = [(0, 0, 11), (1, 7, 8), (2, 0, n2), (1, 0, 7), (0, 11, n0), (1, 8, n1)]
    rng.shuffle(mixed)
    ways["mixed, shuffled"] = [mixed]  # prefill pieces, a decode and a prefix hit in one launch
    return ways


def _outputs(seqs: Sequences, layer, attend, batches) -> dict[tuple[int, int], torch.Tensor]:
    got = {}
    for batch in batches:
        got.update(seqs.run(batch, layer, attend))
    return got


def _differing(got: dict, want: dict) -> list[tuple[int, int]]:
    return [row for row in want if not torch.equal(got[row], want[row])]


@pytest.mark.parametrize("window, cap", [(None, None), (13, 2.0)], ids=["full", "window13-cap2"])
def test_a_token_has_the_same_bits_every_way(kernel_device, window, cap):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    dtypes = (torch.float32,) if kernel_device == "cpu" else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        seqs, layer = Sequences(dtype, kernel_device, seed), _layer(window, cap)
        ways = _ways(rng)
        alone = _outputs(seqs, layer, _invariant_attend, ways.pop("decode alone"))
        for how, batches in ways.items():
            differ = _differing(_outputs(seqs, layer, _invariant_attend, batches), alone)
            assert not differ, f"seed {seed} {dtype}: {len(differ)} tokens differ {how} from alone: {differ[:4]}"
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        want = seqs.reference(layer)
        worst = max(relative_error(alone[row].unsqueeze(0), want[row].unsqueeze(0))[0] for row in want)
        assert worst < tol, f"seed {seed} {dtype}: worst token {worst:.2e} from the float64 reference"


def test_the_default_kernel_is_not_invariant_on_the_same_inputs(kernel_device):
    from podium_cuda.attention import TritonAttentionBackend

    seed = random.randrange(1 << 30)
    seqs, layer = Sequences(torch.float32, kernel_device, seed), _layer()
    ways = _ways(random.Random(seed))
    default = TritonAttentionBackend().attend
    alone = _outputs(seqs, layer, default, ways["decode alone"])
    assert _differing(_outputs(seqs, layer, default, ways["whole prompts in one batch"]), alone), seed


def test_fp8_cache_against_the_reference(kernel_device):
    """An e4m3 cache: the kernel's cast of the cached keys and values, the reference reading the same bytes."""
    seed = random.randrange(1 << 30)
    seqs, layer = Sequences(torch.float32, kernel_device, seed, cache_dtype=torch.float8_e4m3fn), _layer()
    got = _outputs(seqs, layer, _invariant_attend, [[(s, 0, n) for s, n in enumerate(SEQ_LENS)]])
    want = seqs.reference(layer)
    worst = max(relative_error(got[row].unsqueeze(0), want[row].unsqueeze(0))[0] for row in want)
    assert worst < 1e-5, f"seed {seed}: worst token {worst:.2e}"


def test_the_backend_refuses_what_it_cannot_compute(kernel_device):
    backend = invariant.InvariantAttentionBackend(TUNING)
    layer = AttentionLayerSpec(2, 1, 512, 512**-0.5)  # past max_head_size: the default falls back to torch
    query = torch.zeros(1, 2, 512, device=kernel_device)
    cache = torch.zeros(2, 1, BLOCK_SIZE, 1, 512, device=kernel_device)
    meta = AttentionMetadata.from_lengths([1], [1], [[0]], BLOCK_SIZE, device=kernel_device)
    with pytest.raises(NotImplementedError, match="head sizes up to 256"):
        backend.attend(layer, query, cache, meta)
    assert backend.prepare_metadata(meta).extras == {} and not backend.tuning.decode_rotary_in_attention
