"""Few-row linears on a GPU: cuBLAS (``F.linear``) against ``skinny_linear`` (Triton), Llama shapes.

    python3 platforms/cuda/scripts/bench_skinny.py --out skinny.json [--sweep]

For each weight shape of Llama-3.2-1B and Llama-3.1-8B and each row count (1..16), times cuBLAS and
the policy's skinny tiling (``KernelTuning.skinny``); ``--sweep`` also times a grid of tilings at one
row. Times are CUDA-graph replays of calls over enough weight copies to exceed the L2 cache (median
of replays); bandwidth counts the weight bytes. Also times cuBLAS against cuBLASLt
(``torch.backends.cuda.preferred_blas_library``) at 256 and 8192 rows (decode / prefill batches).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time

import torch
from torch.nn import functional as F

from podium_cuda.skinny_gemm import pick_tiling, skinny_linear
from podium_cuda.tuning import CUDA_TUNING, SkinnyTiling

SHAPES = {  # name: (out, in)
    "1b.qkv": (3072, 2048), "1b.o": (2048, 2048), "1b.gate_up": (16384, 2048), "1b.down": (2048, 8192),
    "1b.lm_head": (128256, 2048),
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "8b.lm_head": (128256, 4096),
}
ROWS = (1, 2, 4, 8, 16)
L2_ROTATE_BYTES = 200e6
DTYPE = torch.bfloat16


def graph_us(fn, weights: list[torch.Tensor], replays: int = 10) -> float:
    """Microseconds per call of ``fn(w)``: one CUDA graph calls it 4 times on each weight (median over replays)."""
    calls = [functools.partial(fn, w) for w in weights] * 4
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def weights_for(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, int(L2_ROTATE_BYTES // (n * k * 2)) + 1)
    return [torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5 for _ in range(min(copies, 8))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="skinny.json")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": {}, "sweep": {},
                     "blas": {}}
    started = time.perf_counter()
    for name, (n, k) in SHAPES.items():
        ws = weights_for(n, k)
        gb = n * k * 2 / 1e9
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
            tiling = pick_tiling(n, k, CUDA_TUNING)
            for w in ws[:1]:  # correctness on the real shape before timing
                torch.testing.assert_close(skinny_linear(x, w, tiling=tiling), F.linear(x, w), rtol=2e-2, atol=2e-2)
            cublas = graph_us(functools.partial(F.linear, x), ws)
            skinny = graph_us(functools.partial(skinny_linear, x, tiling=tiling), ws)
            row = {"cublas_us": cublas, "skinny_us": skinny, "speedup": cublas / skinny,
                   "cublas_tbps": gb / cublas * 1e3, "skinny_tbps": gb / skinny * 1e3, "tiling": tiling.__dict__}
            results["rows"][f"{name}/m{rows}"] = row
            print(f"{name:12s} m={rows:2d}  cublas {cublas:7.1f} us ({row['cublas_tbps']:.2f} TB/s)  "
                  f"skinny {skinny:7.1f} us ({row['skinny_tbps']:.2f} TB/s)  x{row['speedup']:.2f}  {tiling}", flush=True)
        if args.sweep:
            x = torch.randn(1, k, device="cuda", dtype=DTYPE)
            best = None
            for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 5)):
                tiling = SkinnyTiling(bn, min(bk, k), warps, stages)
                try:
                    us = graph_us(functools.partial(skinny_linear, x, tiling=tiling), ws, replays=5)
                except Exception as error:  # noqa: BLE001 (a config may not fit; record and go on)
                    results["sweep"][f"{name}/{bn}/{bk}/{warps}/{stages}"] = repr(error)[:200]
                    continue
                results["sweep"][f"{name}/{bn}/{bk}/{warps}/{stages}"] = us
                if best is None or us < best[0]:
                    best = (us, tiling)
            print(f"{name:12s} m= 1  best sweep {best[0]:.1f} us ({gb / best[0] * 1e3:.2f} TB/s) with {best[1]}", flush=True)
        del ws
        torch.cuda.empty_cache()
    for name in ("8b.qkv", "8b.o", "8b.gate_up", "8b.down"):
        n, k = SHAPES[name]
        ws = weights_for(n, k)[:2]
        for rows in (256, 8192):
            x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
            flops = 2 * rows * n * k
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                us = graph_us(functools.partial(F.linear, x), ws)
                results["blas"][f"{name}/m{rows}/{lib}"] = {"us": us, "tflops": flops / us / 1e6}
                print(f"{name:12s} m={rows:5d} {lib:9s} {us:8.1f} us  {flops / us / 1e6:6.0f} TFLOP/s", flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")
    results["seconds"] = time.perf_counter() - started
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
