"""The one-row quantized GEMVs of an 8B layer under Nsight Compute: what bounds each (DRAM throughput,
occupancy, issue rate, the warps' stall reasons), the question a timing alone does not answer.

    bash benchmarks/quant_gpu.sh ncu          (on the device: ncu runs this script, then --report reads it)
    ncu --clock-control none -k regex:gemv --metrics "$(python3 benchmarks/quant_gpu_ncu.py --metrics)" \\
        -o gemv python3 benchmarks/quant_gpu_ncu.py
    python3 benchmarks/quant_gpu_ncu.py --report gemv.ncu-rep

Each variant (``--variants``, VARIANTS' labels: the one-row AWQ GEMV in float32, packed and on the warp MMA
over its Marlin-style copy, FP8 on the CUDA cores and on the warp MMA, the MMAs with their L2 bulk prefetch,
loads in the iteration or fewer steps in flight; by default the MMA ones) is called once per projection with
the prologue the decoder gives it, in the order printed, so the profiled launches come in that order (the
FP8 paths' quantize launches are not GEMVs and are not matched). ncu flushes the caches before each
profiled launch: every weight comes from DRAM.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess

import torch
from quant_gpu_kernels import PROLOGUE_OF, SHAPES, Projection, awq_weight, code, prologue_inputs, tuning

VARIANTS = {"awq float32": {"int4_gemv_packed": False, "int4_gemv_mma": False},
            "awq packed": {"int4_gemv_packed": True, "int4_gemv_mma": False},
            "awq mma": {"int4_gemv_mma": True}, "awq mma g2": {"int4_gemv_mma": True, "int4_mma_groups": 2},
            "awq mma g4": {"int4_gemv_mma": True, "int4_mma_groups": 4},
            "awq mma prefetch": {"int4_gemv_mma": True, "int4_mma_prefetch": True},
            "awq mma prefetch in-iteration": {"int4_gemv_mma": True, "int4_mma_prefetch": True, "int4_mma_ahead": False},
            "fp8 cuda cores": {"fp8_gemv_mma": False}, "fp8 mma": {"fp8_gemv_mma": True},
            "fp8 mma bulk": {"fp8_gemv_mma": True, "fp8_mma_bulk_prefetch": True},
            "fp8 mma bulk unroll 1": {"fp8_gemv_mma": True, "fp8_mma_bulk_prefetch": True, "fp8_mma_unroll": 1}}
# the defaults and the settings that aim at their memory latency (the stalls the first run showed)
DEFAULT_VARIANTS = ("awq mma", "awq mma prefetch", "awq mma prefetch in-iteration", "fp8 mma", "fp8 mma bulk",
                    "fp8 mma bulk unroll 1")
# (label, ncu metric): the figures a row of the report shows
METRICS = (
    ("us", "gpu__time_duration.sum"),
    ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("MB read", "dram__bytes_read.sum"),
    ("occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("theoretical %", "sm__maximum_warps_per_active_cycle_pct"),
    ("warp inst", "smsp__inst_executed.sum"),
    ("issue %", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("regs", "launch__registers_per_thread"),
    ("grid", "launch__grid_size"),
    ("block", "launch__block_size"),
)
# ncu's units in the raw page, to microseconds (time) and megabytes (bytes)
SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
STALLS = ("long_scoreboard", "short_scoreboard", "lg_throttle", "wait", "barrier", "math_pipe_throttle",
          "not_selected", "selected", "mio_throttle", "no_instruction", "dispatch_stall", "branch_resolving")


def stall_metric(reason: str) -> str:
    """The share of a warp's active cycles it spent stalled for ``reason``."""
    return f"smsp__warp_issue_stalled_{reason}_per_warp_active.pct"


def metrics() -> str:
    """ncu's --metrics argument: the report's figures and stall reasons."""
    return ",".join([metric for _, metric in METRICS] + [stall_metric(reason) for reason in STALLS])


def calls(variants: list[str]) -> list[tuple[str, str]]:
    """Run every (variant, projection) once, in order; returns their labels."""
    from podium_cuda.fp8_gemv import fp8_gemv
    from podium_cuda.int4_gemv import int4_gemv

    gen = torch.Generator().manual_seed(0)
    done = []
    for name, (n, k) in SHAPES.items():
        p = Projection(n, k)
        prologue = PROLOGUE_OF[name]
        x, residual, g = prologue_inputs(prologue, 1, k, torch.bfloat16, "cuda", gen)
        for label in variants:
            t = tuning(**VARIANTS[label])
            if label.startswith("awq"):
                weight, fmt = awq_weight(p.awq[0], t)
                int4_gemv(x, weight, *p.awq[1:], 128, fmt, None, code(prologue), residual, g, 1e-5, t)
            else:
                fp8_gemv(x, p.w8, p.s_w, None, code(prologue), residual, g, 1e-5, t)
            torch.cuda.synchronize()
            done.append((label, name))
    return done


def report(path: str, labels: list[tuple[str, str]]) -> None:
    """One line a profiled launch: the METRICS and the largest stall reasons (% of warp-active cycles)."""
    text = subprocess.run(["ncu", "--import", path, "--csv", "--page", "raw"], capture_output=True, text=True,
                          check=True).stdout
    rows = list(csv.DictReader(io.StringIO(text)))
    units = next((r for r in rows if not r.get("Kernel Name")), {})  # the line after the header
    rows = [r for r in rows if r.get("Kernel Name") and "gemv" in r["Kernel Name"]]
    for i, r in enumerate(rows):
        label, name = labels[i] if i < len(labels) else ("?", "?")
        figures = []
        for short, metric in METRICS:
            value = r.get(metric, "")
            try:
                number = float(value.replace(",", "")) * SCALE.get(units.get(metric, ""), 1.0)
                value = f"{number:.3g}"
            except ValueError:
                pass
            figures.append(f"{short} {value}")
        stalls = {}
        for reason in STALLS:
            try:
                stalls[reason] = float(r.get(stall_metric(reason), "").replace(",", ""))
            except ValueError:
                pass
        top = ", ".join(f"{k} {v:.0f}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:5])
        print(f"ncu {label:30s} {name:8s} {r['Kernel Name'][:28]:28s} " + ", ".join(figures) + f"; stalls: {top}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--report", help="an ncu report of this script's launches: print its lines")
    parser.add_argument("--metrics", action="store_true", help="print ncu's --metrics argument and stop")
    args = parser.parse_args()
    if args.metrics:
        print(metrics())
        return
    variants = [v.strip() for v in args.variants.split(",")]
    labels = [(label, name) for name in SHAPES for label in variants]
    if args.report:
        report(args.report, labels)
        return
    for label, name in calls(variants):
        print(f"called {label} {name}", flush=True)


if __name__ == "__main__":
    main()
