"""The batch-invariant kernels alone on a GPU, bf16 (run by benchmarks/invariant_gpu.sh; ~20-40 s):

1. GEMM (podium_cuda.invariant_gemm) at Llama-3.1-8B / 3.2-1B linear shapes: rows 0, 5, 63, 64, 299
   alone == the same rows inside batches of 7, 64, 256 and 300, cuBLAS's F.linear alongside; then
   its time against cuBLAS at 256 rows (a decode step of 256) and 8192 (a prefill step); with
   ``--sweep`` only the same times for a few other tilings (``KernelTuning.invariant_gemm``: any
   fixed tiling is batch-invariant, so the default may move to the fastest);
2. attention (podium_cuda.invariant_attention) at the 8B's heads (32 / 8, head 128, 16-token blocks),
   bf16 and fp8 e4m3 caches: every sampled query token's output as a decode alone == inside whole
   prompts in one launch == in 100-token chunks after their prefix == in a shuffled mixed launch;
   the default kernel (TritonAttentionBackend) on the same inputs alongside.

    python benchmarks/invariant_gpu_kernels.py --out DIR [--sweep]   (appends to DIR/summary.txt line by
                                                                      line, writes DIR/kernels.json)
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path

import torch
import triton
from torch.nn import functional as F

from podium_cuda.attention import TritonAttentionBackend
from podium_cuda.invariant_attention import InvariantAttentionBackend
from podium_cuda.invariant_gemm import invariant_linear
from podium_cuda.gemm_plan import GemmPlan, GemmTiling
from podium_cuda.tuning import CUDA_TUNING
from podium_plugin_api import AttentionLayerSpec, AttentionMetadata

SHAPES = {  # name: (K, N)
    "8B qkv": (4096, 6144), "8B o": (4096, 4096), "8B gate_up": (4096, 28672), "8B down": (14336, 4096),
    "1B qkv": (2048, 3072), "1B down": (8192, 2048), "1B lm_head": (2048, 128256),
}
TIMED = ("8B qkv", "8B o", "8B gate_up", "8B down")
OTHER_TILINGS = (GemmTiling(128, 256, 64, 8, 3), GemmTiling(64, 128, 64, 4, 4), GemmTiling(128, 128, 64, 4, 4),
                 GemmTiling(128, 128, 32, 8, 4))
ROWS, BATCHES = (0, 5, 63, 64, 299), (7, 64, 256, 300)
DEVICE = "cuda"
HEADS, HEAD, BLOCK = (32, 8), 128, 16
SEQ_LENS = (300, 520, 130)


class Report:
    """Lines appended to DIR/summary.txt as they come (a step cut by its timeout keeps what it found)."""

    def __init__(self, out: Path) -> None:
        self.out, self.record = out, {}

    def line(self, text: str) -> None:
        print(text, flush=True)
        with open(self.out / "summary.txt", "a") as f:
            f.write(text + "\n")

    def save(self) -> None:
        (self.out / "kernels.json").write_text(json.dumps(self.record, default=str))


def _times(x: torch.Tensor, w: torch.Tensor, tuning) -> list[str]:
    ratios = []
    for m in (256, 8192):
        xs = x[:m]
        t_g = triton.testing.do_bench(lambda xs=xs: invariant_linear(xs, w, tuning=tuning), warmup=5, rep=25)
        t_c = triton.testing.do_bench(lambda xs=xs: F.linear(xs, w), warmup=5, rep=25)
        ratios.append(f"M={m}: {t_c / t_g:.2f}x cuBLAS's speed ({t_g * 1e3:.0f} us)")
    return ratios


def _weights(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    return w, torch.randn(8192, k, device="cuda", dtype=torch.bfloat16, generator=g)


def gemm_sweep(report: Report) -> None:
    for tiling in OTHER_TILINGS:
        tuning = replace(CUDA_TUNING, invariant_gemm=GemmPlan(tiling))
        for name in TIMED:
            w, x = _weights(*SHAPES[name])
            tag = "/".join(str(v) for v in (tiling.block_m, tiling.block_n, tiling.block_k, tiling.num_warps,
                                            tiling.num_stages))
            report.line(f"GEMM tiling {tag} {name}: " + ", ".join(_times(x, w, tuning)))


def gemm_checks(report: Report) -> None:
    for name, (k, n) in SHAPES.items():
        w, x = _weights(k, n)
        differ = {}
        for label, fn in (("gemm", invariant_linear), ("cublas", F.linear)):
            alone = {i: fn(x[i:i + 1], w) for i in ROWS}
            differ[label] = sum(not torch.equal(fn(x[:m], w)[i:i + 1], alone[i]) for m in BATCHES for i in ROWS if i < m)
        ref = x[:64].double() @ w.double().T
        err = ((invariant_linear(x[:64], w).double() - ref).norm() / ref.norm()).item()
        line = f"GEMM {name:11s} K={k} N={n}: rows alone != in batch: gemm {differ['gemm']}, cuBLAS {differ['cublas']}"
        if name in TIMED:
            line += "; " + ", ".join(_times(x, w, CUDA_TUNING))
        report.line(line + f"; rel err {err:.1e}")
        report.record[name] = {"gemm_differ": differ["gemm"], "cublas_differ": differ["cublas"], "rel_err": err}
        report.save()


class Sequences:
    """Fixed per-position q / k / v of a few sequences; ``run`` attends a batch of pieces (seq, start, end)
    over freshly drawn cache blocks (the same layout as tests/test_invariant_attention.py)."""

    def __init__(self, cache_dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.q = [torch.randn(n, HEADS[0], HEAD, device=DEVICE, generator=gen).bfloat16() for n in SEQ_LENS]
        self.kv = [torch.randn(2, n, HEADS[1], HEAD, device=DEVICE, generator=gen).to(cache_dtype) for n in SEQ_LENS]
        self.rng = random.Random(seed)

    def run(self, pieces, attend) -> dict[tuple[int, int], torch.Tensor]:
        blocks = [-(-end // BLOCK) for _, _, end in pieces]
        free = list(range(sum(blocks) + 2))
        self.rng.shuffle(free)
        cache = torch.zeros(2, len(free), BLOCK, HEADS[1], HEAD, dtype=self.kv[0].dtype, device=DEVICE)
        tables = []
        for (seq, _, end), count in zip(pieces, blocks):
            table = [free.pop() for _ in range(count)]
            for b, block in enumerate(table):
                cache[:, block, :min(BLOCK, end - b * BLOCK)] = self.kv[seq][:, b * BLOCK:min((b + 1) * BLOCK, end)]
            tables.append(table)
        meta = AttentionMetadata.from_lengths([e - s for _, s, e in pieces], [e for *_, e in pieces], tables, BLOCK,
                                              device=DEVICE)
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


def attention_checks(report: Report) -> None:
    layer = AttentionLayerSpec(HEADS[0], HEADS[1], HEAD, HEAD**-0.5)
    total = sum(len(range(0, n, 7)) for n in SEQ_LENS)
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        seqs = Sequences(cache_dtype, seed=3)
        for label, backend in (("invariant", InvariantAttentionBackend()), ("default", TritonAttentionBackend())):
            counts = attention_ways(seqs, lambda q, cache, meta, b=backend: b.attend(layer, q, cache, meta))
            report.line(f"attention {label:9s} {str(cache_dtype)[6:]} cache: tokens != their decode alone (of {total}): "
                        + ", ".join(f"{way} {c}" for way, c in counts.items()))
            report.record[f"{label} {cache_dtype}"] = counts
            report.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true", help="only the other GEMM tilings' times")
    args = parser.parse_args()
    report = Report(Path(args.out))
    if args.sweep:
        gemm_sweep(report)
        return
    report.line(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16")
    attention_checks(report)
    gemm_checks(report)


if __name__ == "__main__":
    main()
