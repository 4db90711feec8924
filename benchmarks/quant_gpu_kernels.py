"""Quantized linear kernels on the device against their references, and timed at Llama-3.1-8B's shapes:

    python benchmarks/quant_gpu_kernels.py [--device cuda|cpu] [--rows 1 16 256 4096]

check: each kernel against the contract's pure-torch reference (relative max error), random data:
podium-cuda's Triton ``gguf_linear`` (every kept GGUF format, 5 rows) and ``int4_linear`` (AWQ, GPTQ,
GPTQ act-order; the GEMV at 1 row, the GEMM at 37), the FP8 Triton GEMM (per tensor, channel and
128 x 128 block) and ``_scaled_mm`` (per channel), bf16 rows.
time: microseconds per call (CUDA events over a CUDA graph of 20 calls, as the engine replays a step;
median of 7) at each 8B shape and ``--rows``: bf16 ``F.linear`` (cuBLAS), FP8 W8A8 through
``_scaled_mm`` (with the per-token quantization's launches) and through the Triton GEMM (quantizing
inside), and the INT4 AWQ Triton kernel; each with its ratio to bf16. Then the FP8 rule the timings
imply: the largest row count at which the Triton GEMM wins at every shape is
``KernelTuning.fp8_triton_max_rows`` (``fp8 rule: ...``).
``--device cpu`` is a dry run of the checks at a small shape (run it under TRITON_INTERPRET=1).
"""

# ruff: noqa: B023  (the lambdas are timed where they are made, inside the loop)
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from podium_plugin_api.fp8 import FP8
from podium_plugin_api.fp8 import fp8_linear as fp8_reference
from podium_plugin_api.gguf_blocks import BLOCKS, NAMES, gguf_linear, random_rows
from podium_plugin_api.int4 import AWQ, GPTQ, int4_linear, quantize_awq, random_packed

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float().cpu() - want.float().cpu()).abs().max() / want.float().abs().max()).item()


def check(device: str) -> list[str]:
    from podium_cuda import fp8_gemm
    from podium_cuda.fp8_linear import scaled_mm_linear
    from podium_cuda.gguf import gguf_linear as triton_gguf
    from podium_cuda.int4 import int4_linear as triton_int4

    lines = []
    n, k = (256, 512) if device == "cpu" else (4096, 4096)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    for ggml_type in sorted(BLOCKS):
        weight = random_rows(ggml_type, n, k, gen)
        for rows in (5,):  # one compile a format (the device's budget)
            x = torch.randn(rows, k, generator=gen)
            err = rel_error(triton_gguf(x.to(device, dtype), weight.to(device), ggml_type), gguf_linear(x, weight, ggml_type))
            lines.append(f"check gguf_linear {NAMES[ggml_type]:5s} rows {rows:3d} {dtype}: rel max error {err:.2e}")
    for fmt, act_order in ((AWQ, False), (GPTQ, False), (GPTQ, True)):
        packed = random_packed(fmt, k, n, 128, act_order, gen)
        on = {name: t.to(device) for name, t in packed.items()}
        for rows in (1, 37):
            x = torch.randn(rows, k, generator=gen)
            want = int4_linear(x.double(), *(packed.get(t) for t in ("qweight", "qzeros", "scales", "g_idx")), 128, fmt)
            got = triton_int4(x.to(device, dtype), on["qweight"], on["qzeros"], on["scales"], on.get("g_idx"), 128, fmt)
            lines.append(f"check int4_linear {fmt}{' act-order' if act_order else ''} rows {rows:3d} {dtype}: "
                         f"rel max error {rel_error(got, want):.2e}")
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8)
    scales = {"tensor": torch.rand(1, generator=gen) / 1000 + 1e-4,
              "channel": torch.rand(n, 1, generator=gen) / 1000 + 1e-4,
              "block": torch.rand(n // 128, k // 128, generator=gen) / 1000 + 1e-4}
    for granularity, scale in scales.items():
        for rows in (1, 37):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            want = fp8_reference(x.double(), weight, scale.double())
            args = (x.to(device), weight.to(device), scale.to(device))
            err = rel_error(fp8_gemm.fp8_gemm(*args, fp8_dot=device != "cpu"), want)
            line = f"check fp8 {granularity:7s} rows {rows:3d} {dtype}: Triton rel max error {err:.2e}"
            if device != "cpu" and granularity == "channel":
                line += f", _scaled_mm {rel_error(scaled_mm_linear(*args), want):.2e}"
            lines.append(line)
    return lines


def timed(fn, repeat: int = 7, calls: int = 20) -> float:
    """Median microseconds a call of ``fn()`` takes, replayed from a CUDA graph of ``calls`` calls."""
    for _ in range(3):
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def time_shapes(rows_list: list[int]) -> list[str]:
    from podium_cuda.fp8_gemm import fp8_gemm
    from podium_cuda.fp8_linear import scaled_mm_linear
    from podium_cuda.int4 import int4_linear as triton_int4

    lines, triton_wins = [], {rows: True for rows in rows_list}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        s_w = (w.float().abs().amax(dim=1, keepdim=True) / 448).contiguous()
        w8 = (w.float() / s_w).to(FP8)
        awq = {key: t.contiguous() for key, t in quantize_awq(w, 128).items()}
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            base = timed(lambda: F.linear(x, w))
            results = {
                "fp8 _scaled_mm": timed(lambda: scaled_mm_linear(x, w8, s_w)),
                "fp8 Triton": timed(lambda: fp8_gemm(x, w8, s_w)),
                "int4 awq": timed(lambda: triton_int4(x, awq["qweight"], awq["qzeros"], awq["scales"], None, 128, AWQ)),
            }
            triton_wins[rows] &= results["fp8 Triton"] < results["fp8 _scaled_mm"]
            lines.append(f"time {name:8s} N={n:5d} K={k:5d} rows {rows:4d}: bf16 {base:8.1f} us; "
                         + "; ".join(f"{label} {us:8.1f} us (x{us / base:.2f})" for label, us in results.items()))
    threshold = 0
    for rows in sorted(rows_list):  # the rule is a threshold: up to the first row count Triton loses at
        if not triton_wins[rows]:
            break
        threshold = rows
    lines.append(f"fp8 rule: Triton wins at every shape up to {threshold} rows -> KernelTuning.fp8_triton_max_rows = "
                 f"{threshold} (Triton faster at rows: {[r for r in rows_list if triton_wins[r]]})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 4096])
    args = parser.parse_args()
    for line in check(args.device):
        print(line, flush=True)
    if args.device == "cuda":
        for line in time_shapes(args.rows):
            print(line, flush=True)


if __name__ == "__main__":
    main()
