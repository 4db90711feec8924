"""Triton decode-batch GEMM (podium_cuda.gemm) against cuBLAS on Llama-3.1-8B / 3.2-1B linears.

    python3 platforms/cuda/scripts/bench_gemm.py --out $OUT [--budget-s 240] [--only 8b]

For every linear and M in {64, 128, 256, 512}: each Triton variant is checked against a float32
torch.mm reference (bf16 tolerance, fresh random data, output poisoned first), then timed with
cuBLAS (x @ w.t(); for gate_up also + the platform's SiLU-and-mul and + plain torch silu * up).
Times are CUDA-graph replays of many calls, median over replays; the calls rotate over enough
weight copies (> 256 MB together, L2 is 60 MB) that every call streams its weights from HBM.
Writes bench_gemm.log and bench_gemm.json under --out; prints progress and a summary table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from podium_cuda.fused_ops import silu_and_mul
from podium_cuda.gemm import gemm, gemm_kernel, gemm_silu_mul, pair_gate_up, plan_schedule
from podium_cuda.tuning import GemmTiling

DTYPE, DEV = torch.bfloat16, "cuda"
MS = (256, 64, 128, 512)  # 256 first: the decode batch the target is set at
LINEARS = {  # name: (K, N); gate_up N = 2 * intermediate
    "8b": {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144), "o": (4096, 4096)},
    "1b": {"gate_up": (2048, 16384), "down": (8192, 2048), "qkv": (2048, 3072), "o": (2048, 2048)},
}
ROTATE_BYTES = 256e6
CALLS = 16  # calls per captured graph
TOL = 1e-2  # bf16 operands and output: about 3e-3 expected


def T(bm, bn, bk=64, w=8, s=3, loader="tma", ws=False):
    return GemmTiling(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, loader=loader, warp_specialize=ws,
                      stream_k_waves=1)


# tile shapes per kind; each is timed under every schedule in SCHEDULES (a run-time choice: no rebuild).
# Run 1 (2026-11-29) also had warp_specialize=True variants: on sm_90 they built without warp
# specialization (no setmaxnreg) and timed like the plain ones, so they are gone.
PLAIN = [T(128, 256, s=4), T(128, 256, loader="ptr"), T(128, 128, s=4), T(256, 128, s=3), T(256, 128, s=4),
         T(64, 256, w=4, s=4), T(128, 128, w=4, s=4), T(128, 128, bk=128, s=3)]
HALVES = [T(128, 128, s=4), T(128, 128, loader="ptr"), T(256, 64, s=4), T(64, 128, w=4, s=4)]
PAIRED = [T(128, 256, s=4), T(256, 128, s=3), T(256, 128, s=4), T(128, 128, s=4), T(64, 256, w=4, s=4),
          T(128, 256, loader="ptr")]
SCHEDULES = (1, 2, 0, -1)  # a schedule that plans like an earlier one for the shape is skipped


def with_waves(t: GemmTiling, waves: int) -> GemmTiling:
    return GemmTiling(**{**t.__dict__, "stream_k_waves": waves})


def graph_us(calls, replays: int = 20) -> float:
    """Microseconds per call: all calls captured in one CUDA graph, median over replays."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) * 1e3 / len(calls)


def new_builds(seen: set) -> list[dict]:
    """Registers, spills, shared memory and the instructions used by gemm_kernel builds not yet in ``seen``."""
    reports = []
    try:
        for cache in gemm_kernel.device_caches.values():
            for key, kernel in cache[0].items():
                if key in seen or not hasattr(kernel, "n_regs"):
                    continue
                seen.add(key)
                ptx = kernel.asm.get("ptx", "")
                reports.append({"regs": kernel.n_regs, "spills": kernel.n_spills, "shared": kernel.metadata.shared,
                                "wgmma": "wgmma" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
                                "setmaxnreg": "setmaxnreg" in ptx})
    except Exception as exc:  # triton internals: a report is nice to have, never fatal
        reports.append({"report_error": repr(exc)[:200]})
    return reports


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out.float() - ref).norm() / ref.norm())


class Case:
    """One linear at one M: weight copies to rotate, an input, a float32 reference."""

    def __init__(self, model: str, name: str, K: int, N: int, M: int):
        self.model, self.name, self.K, self.N, self.M = model, name, K, N, M
        self.gated = name == "gate_up"
        self.out_cols = N // 2 if self.gated else N
        copies = max(2, min(32, math.ceil(ROTATE_BYTES / (N * K * 2))))
        self.weights = [torch.randn(N, K, device=DEV, dtype=DTYPE) * K**-0.5 for _ in range(copies)]
        self.x = torch.randn(M, K, device=DEV, dtype=DTYPE)
        self.flops = 2 * M * N * K
        full = self.x.float() @ self.weights[0].float().T
        self.ref = F.silu(full[:, : self.out_cols]) * full[:, self.out_cols:] if self.gated else full
        self.paired = [pair_gate_up(w) for w in self.weights] if self.gated else []
        self.y = torch.empty(M, self.out_cols, device=DEV, dtype=DTYPE)
        self.gu = torch.empty(M, N, device=DEV, dtype=DTYPE)

    def rotated(self, fn, paired: bool = False):
        weights = self.paired if paired else self.weights
        return [lambda w=w: fn(w) for w in weights] * max(1, CALLS // len(weights))

    def baselines(self):
        I, x = self.out_cols, self.x
        yield "cublas", lambda w: torch.mm(x, w.t(), out=self.gu if self.gated else self.y)
        if self.gated:
            yield "cublas+silu_triton", lambda w: silu_and_mul(torch.mm(x, w.t(), out=self.gu))
            yield "cublas+silu_torch", lambda w: F.silu(torch.mm(x, w.t(), out=self.gu)[:, :I]) * self.gu[:, I:]

    def variants(self):
        """(kind, tiling) for every Triton variant worth timing at this M."""
        kinds = [("halves", HALVES), ("paired", PAIRED)] if self.gated else [("plain", PLAIN)]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for kind, shapes in kinds:
            rows = {"plain": self.N, "halves": self.N // 2, "paired": self.N}[kind]
            for shape in shapes:
                if shape.block_m > self.M or (shape.block_m > 64 and self.M <= 64 and shape.block_n >= 256):
                    continue
                tiles = -(-self.M // shape.block_m) * -(-rows // shape.block_n)
                plans = set()
                for waves in SCHEDULES:
                    plan = plan_schedule(tiles, -(-self.K // shape.block_k), sms, waves)
                    if plan not in plans:
                        plans.add(plan)
                        yield kind, with_waves(shape, waves)

    def triton_call(self, kind: str, tiling: GemmTiling):
        if kind == "paired":
            return lambda w: gemm_silu_mul(self.x, w, tiling, out=self.y, paired=True)
        op = gemm_silu_mul if self.gated else gemm
        return lambda w: op(self.x, w, tiling, out=self.y)

    def check(self, kind: str, tiling: GemmTiling) -> float:
        self.y.fill_(float("nan"))  # poisoned: an unwritten element fails the check
        self.triton_call(kind, tiling)((self.paired if kind == "paired" else self.weights)[0])
        torch.cuda.synchronize()
        return rel_err(self.y, self.ref)


def run_case(case: Case, log, rows: list, deadline: float, failed: set, seen: set) -> None:
    base = {"model": case.model, "linear": case.name, "M": case.M, "K": case.K, "N": case.N}
    cublas_us = None
    for name, fn in case.baselines():
        us = graph_us(case.rotated(fn))
        cublas_us = cublas_us or us
        rows.append({**base, "variant": name, "us": us, "TFLOPs": case.flops / us / 1e6})
        log(f"  {name:<41} {us:8.1f} us {case.flops / us / 1e6:6.0f} TFLOP/s")
    # gated: against what the model runs now, cuBLAS + the platform's SiLU-and-mul kernel
    ref_us = next(r["us"] for r in rows[::-1] if r["variant"] == "cublas+silu_triton") if case.gated else cublas_us
    for kind, tiling in case.variants():
        tag = f"{kind} {tiling.tag()}" if case.gated else tiling.tag()
        build_key = f"{kind} {with_waves(tiling, 1).tag()}"
        if time.time() > deadline or build_key in failed:
            continue
        try:
            t0 = time.time()
            err = case.check(kind, tiling)
            for build in new_builds(seen):
                log(f"  build {tag} ({time.time() - t0:.1f} s): {json.dumps(build)}")
                rows.append({**base, "variant": tag, "build": build})
            us = graph_us(case.rotated(case.triton_call(kind, tiling), kind == "paired")) if err < TOL else float("nan")
        except Exception as exc:  # a tiling that does not build on this device: record it, go on
            failed.add(build_key)
            log(f"  {tag:<41} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            rows.append({**base, "variant": tag, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            continue
        ratio = ref_us / us if us == us else float("nan")  # noqa: PLR0124 (NaN)
        rows.append({**base, "variant": tag, "us": us, "TFLOPs": case.flops / us / 1e6, "rel_err": err,
                     "speedup_vs_cublas": ratio})
        flag = "" if err < TOL else f"  WRONG rel_err {err:.2e}"
        log(f"  {tag:<41} {us:8.1f} us {case.flops / us / 1e6:6.0f} TFLOP/s x{ratio:5.3f} err {err:.1e}{flag}")


def summarize(rows: list, log) -> None:
    log("\n== summary: per linear and M, cuBLAS (gate_up: cuBLAS + platform SiLU-mul) vs the best Triton variant")
    log(f"{'model':<4} {'linear':<8} {'M':>4} {'cublas us':>10} {'best us':>8} {'speedup':>8}  best variant")
    keys = sorted({(r["model"], r["linear"], r["M"]) for r in rows}, key=lambda k: (k[0] != "8b", k[1], k[2]))
    for key in keys:
        group = [r for r in rows if (r["model"], r["linear"], r["M"]) == key]
        base = next((r for r in group if r["variant"] == ("cublas+silu_triton" if key[1] == "gate_up" else "cublas")), None)
        tri = [r for r in group if "speedup_vs_cublas" in r and r["us"] == r["us"]]  # noqa: PLR0124 (NaN)
        if base is None or not tri:
            continue
        best = min(tri, key=lambda r: r["us"])
        log(f"{key[0]:<4} {key[1]:<8} {key[2]:>4} {base['us']:>10.1f} {best['us']:>8.1f} {best['speedup_vs_cublas']:>8.3f}"
            f"  {best['variant']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop starting Triton variants after this")
    parser.add_argument("--only", nargs="*", default=None, help="models (8b, 1b) or linears (gate_up, down, ...)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    started = time.time()
    logf = open(os.path.join(args.out, "bench_gemm.log"), "w")

    def log(line: str) -> None:
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    import triton

    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
        f"SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    torch.manual_seed(0)
    rows: list = []
    failed: set = set()
    seen: set = set()
    for M in MS:
        for model, linears in LINEARS.items():
            for name, (K, N) in linears.items():
                if args.only and model not in args.only and name not in args.only:
                    continue
                log(f"[{time.time() - started:5.0f} s] {model} {name} M={M} K={K} N={N}")
                try:
                    run_case(Case(model, name, K, N, M), log, rows, started + args.budget_s, failed, seen)
                except Exception:
                    log(traceback.format_exc())
                torch.cuda.empty_cache()
                with open(os.path.join(args.out, "bench_gemm.json"), "w") as f:
                    json.dump(rows, f, indent=1)
    summarize(rows, log)
    log(f"total {time.time() - started:.0f} s")
    logf.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
