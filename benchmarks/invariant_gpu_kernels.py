"""The batch-invariant kernels alone on a GPU, bf16 (run by benchmarks/invariant_gpu.sh; ~20-40 s):

1. GEMM (podium_cuda.invariant_gemm) at Llama-3.1-8B / 3.2-1B linear shapes: rows 0, 5, 63, 64, 299
   alone == the same rows inside batches of 7, 64, 256 and 300, cuBLAS's F.linear alongside; then
   its time against cuBLAS at 256 rows (a decode step of 256) and 8192 (a prefill step);
2. attention (podium_cuda.invariant_attention) at the 8B's heads (32 / 8, head 128, 16-token blocks),
   bf16 and fp8 e4m3 caches: every sampled query token's output as a decode alone == inside whole
   prompts in one launch == in 100-token chunks after their prefix == in a shuffled mixed launch;
   the default kernel (TritonAttentionBackend) on the same inputs alongside.

    python benchmarks/invariant_gpu_kernels.py --out DIR      (appends to DIR/summary.txt, writes DIR/kernels.json)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import triton
from torch.nn import functional as F

from podium_cuda.attention import TritonAttentionBackend
from podium_cuda.invariant_attention import InvariantAttentionBackend
from podium_cuda.invariant_gemm import invariant_linear
from podium_plugin_api import AttentionLayerSpec, AttentionMetadata

SHAPES = {  # name: (K, N)
    "8B qkv": (4096, 6144), "8B o": (4096, 4096), "8B gate_up": (4096, 28672), "8B down": (14336, 4096),
    "1B qkv": (2048, 3072), "1B down": (8192, 2048), "1B lm_head": (2048, 128256),
}
TIMED = ("8B qkv", "8B o", "8B gate_up", "8B down")
ROWS, BATCHES = (0, 5, 63, 64, 299), (7, 64, 256, 300)
HEADS, HEAD, BLOCK = (32, 8), 128, 16
SEQ_LENS = (300, 520, 130)


def gemm_checks(lines: list[str], record: dict) -> None:
    dev, dt = "cuda", torch.bfloat16
    for name, (k, n) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(k + n)
        w = torch.randn(n, k, device=dev, dtype=dt, generator=g) / k**0.5
        x = torch.randn(8192, k, device=dev, dtype=dt, generator=g)
        differ = {}
        for label, fn in (("gemm", invariant_linear), ("cublas", F.linear)):
            alone = {i: fn(x[i:i + 1], w) for i in ROWS}
            differ[label] = sum(not torch.equal(fn(x[:m], w)[i:i + 1], alone[i]) for m in BATCHES for i in ROWS if i < m)
        ref = x[:64].double() @ w.double().T
        err = ((invariant_linear(x[:64], w).double() - ref).norm() / ref.norm()).item()
        line = f"GEMM {name:11s} K={k} N={n}: rows alone != in batch: gemm {differ['gemm']}, cuBLAS {differ['cublas']}"
        if name in TIMED:
            ratios = []
            for m in (256, 8192):
                xs = x[:m]
                t_g = triton.testing.do_bench(lambda: invariant_linear(xs, w), warmup=5, rep=25)
                t_c = triton.testing.do_bench(lambda: F.linear(xs, w), warmup=5, rep=25)
                ratios.append(f"M={m}: {t_c / t_g:.2f}x cuBLAS's speed ({t_g * 1e3:.0f} us)")
            line += "; " + ", ".join(ratios)
        lines.append(line + f"; rel err {err:.1e}")
        record[name] = {"gemm_differ": differ["gemm"], "cublas_differ": differ["cublas"], "rel_err": err}
        print(lines[-1], flush=True)


class Sequences:
    """Fixed per-position q / k / v of a few sequences; ``run`` attends a batch of pieces (seq, start, end)
    over freshly drawn cache blocks (the same layout as tests/test_invariant_attention.py)."""

    def __init__(self, cache_dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.q = [torch.randn(n, HEADS[0], HEAD, device="cuda", generator=gen).bfloat16() for n in SEQ_LENS]
        self.kv = [torch.randn(2, n, HEADS[1], HEAD, device="cuda", generator=gen).to(cache_dtype) for n in SEQ_LENS]
        self.rng = random.Random(seed)

    def run(self, pieces, attend) -> dict[tuple[int, int], torch.Tensor]:
        blocks = [-(-end // BLOCK) for _, _, end in pieces]
        free = list(range(sum(blocks) + 2))
        self.rng.shuffle(free)
        cache = torch.zeros(2, len(free), BLOCK, HEADS[1], HEAD, dtype=self.kv[0].dtype, device="cuda")
        tables = []
        for (seq, _, end), count in zip(pieces, blocks):
            table = [free.pop() for _ in range(count)]
            for b, block in enumerate(table):
                cache[:, block, :min(BLOCK, end - b * BLOCK)] = self.kv[seq][:, b * BLOCK:min((b + 1) * BLOCK, end)]
            tables.append(table)
        meta = AttentionMetadata.from_lengths([e - s for _, s, e in pieces], [e for *_, e in pieces], tables, BLOCK,
                                              device="cuda")
        out = attend(torch.cat([self.q[seq][s:e] for seq, s, e in pieces]), cache, meta)
        rows = [(seq, pos) for seq, s, e in pieces for pos in range(s, e)]
        return {row: out[i] for i, row in enumerate(rows)}


def attention_ways(seqs: Sequences, attend) -> dict[str, int]:
    """Tokens (of the sampled positions) whose output differs from the decode alone, per way."""
    positions = [(s, p) for s, n in enumerate(SEQ_LENS) for p in range(0, n, 7)]
    alone = {}
    for s, p in positions:
        alone.update(seqs.run([(s, p, p + 1)], attend))
    chunks = [[(s, a, min(a + 100, n)) for s, n in enumerate(SEQ_LENS) if a < n] for a in range(0, max(SEQ_LENS), 100)]
    mixed = [(0, 0, 77), (1, 0, 200), (2, 0, 130), (0, 77, 78), (1, 200, 520), (0, 78, 300)]
    seqs.rng.shuffle(mixed)
    ways = {"whole prompts": [[(s, 0, n) for s, n in enumerate(SEQ_LENS)]], "100-token chunks": chunks,
            "mixed launch": [mixed]}
    counts = {}
    for way, batches in ways.items():
        got = {}
        for batch in batches:
            got.update(seqs.run(batch, attend))
        counts[way] = sum(not torch.equal(got[row], alone[row]) for row in alone)
    return counts


def attention_checks(lines: list[str], record: dict) -> None:
    layer = AttentionLayerSpec(HEADS[0], HEADS[1], HEAD, HEAD**-0.5)
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        seqs = Sequences(cache_dtype, seed=3)
        for label, backend in (("invariant", InvariantAttentionBackend()), ("default", TritonAttentionBackend())):
            counts = attention_ways(seqs, lambda q, cache, meta: backend.attend(layer, q, cache, meta))
            total = sum(len(range(0, n, 7)) for n in SEQ_LENS)
            lines.append(f"attention {label:9s} {str(cache_dtype)[6:]} cache: tokens != their decode alone (of {total}): "
                         + ", ".join(f"{way} {c}" for way, c in counts.items()))
            record[f"{label} {cache_dtype}"] = counts
            print(lines[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16"]
    record: dict = {}
    try:
        attention_checks(lines, record)
        gemm_checks(lines, record)
    finally:
        out = Path(args.out)
        (out / "kernels.json").write_text(json.dumps(record, default=str))
        with open(out / "summary.txt", "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
