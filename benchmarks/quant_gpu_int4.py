"""AWQ at Llama-3.1-8B's projections on the device: the checkpoint's layout against AWQ_MMA, the layout the
CUDA platform converts AWQ weights to (``KernelTuning.int4_gemv_mma``), at every row count a step runs:

    python benchmarks/quant_gpu_int4.py [--rows 1 2 4 8 16 64 256 1024] [--device cuda|cpu]

check (PASS / FAIL lines, relative max error against the float64 reference, bf16 rows): both layouts through
``int4_linear`` at 1, 2, 5 and 64 rows of the qkv shape.
time: microseconds a call (timed(): CUDA events over a CUDA graph of 20 calls, median of 7) per projection
and row count: bf16 cuBLAS, AWQ as stored (rows <= int4_gemv_max_rows: int4_gemv.py's split-K GEMV, more:
int4.py's GEMM), AWQ_MMA (up to 8 rows: awq_mma_gemv.py; more: int4.py's GEMM over the MMA layout; K split
for one tile of up to 16 rows); then a layer's four projections summed, "ratio mma / awq" per row count.
``--device cpu`` runs the checks at small shapes under TRITON_INTERPRET=1 (float32 rows).
"""

# ruff: noqa: B023  (the lambdas are timed where they are made, inside the loop)
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from quant_gpu_kernels import SHAPES, Projection, awq_weight, rel_error, timed, tuning, verdict

from podium_plugin_api.int4 import AWQ, AWQ_MMA, awq_to_mma, dequantize, random_packed

ROWS = (1, 2, 4, 8, 16, 64, 256, 1024)


def check(device: str) -> list[str]:
    from podium_cuda.int4 import int4_linear

    n, k = (96, 512) if device == "cpu" else SHAPES["qkv"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    packed = random_packed(AWQ, k, n, 128, False, gen)
    w = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], None, 128, AWQ).double()
    on = {name: t.to(device) for name, t in packed.items()}
    lines = []
    for rows in (1, 2, 5, 64):
        x = torch.randn(rows, k, generator=gen).to(device, dtype)
        want = x.double().cpu() @ w
        for label, fmt, qweight in (("awq", AWQ, on["qweight"]), ("mma", AWQ_MMA, awq_to_mma(on["qweight"]))):
            got = int4_linear(x, qweight, on["qzeros"], on["scales"], None, 128, fmt)
            lines.append(verdict(f"{label} rows {rows}", rel_error(got, want), 1e-2))
    return lines


def layouts(p: Projection, rows: int) -> dict[str, float]:
    from podium_cuda.int4 import int4_linear

    x = torch.randn(rows, p.k, device="cuda", dtype=torch.bfloat16)
    mma, _ = awq_weight(p.awq[0], tuning(int4_gemv_mma=True))
    return {"bf16": timed(lambda: F.linear(x, p.w)),
            "awq": timed(lambda: int4_linear(x, *p.awq, None, 128, AWQ)),
            "mma": timed(lambda: int4_linear(x, mma, *p.awq[1:], None, 128, AWQ_MMA))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    for line in check(args.device):
        print(line, flush=True)
    if args.device == "cpu":
        return
    projections = {name: Projection(n, k) for name, (n, k) in SHAPES.items()}
    for rows in args.rows:
        per = {name: layouts(p, rows) for name, p in projections.items()}
        for name, t in per.items():
            print(f"time rows {rows:5d} {name:8s}: " + ", ".join(f"{label} {us:.1f} us" for label, us in t.items())
                  + f" (mma / awq x{t['mma'] / t['awq']:.2f})", flush=True)
        total = {label: sum(t[label] for t in per.values()) for label in ("bf16", "awq", "mma")}
        print(f"layer rows {rows:5d}: bf16 {total['bf16']:.1f} us, awq {total['awq']:.1f}, mma {total['mma']:.1f}; "
              f"ratio mma / awq x{total['mma'] / total['awq']:.3f}, mma / bf16 x{total['mma'] / total['bf16']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
