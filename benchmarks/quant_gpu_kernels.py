"""Quantized linear kernels on the device against their references, at Llama-3.1-8B's linear shapes:

    python benchmarks/quant_gpu_kernels.py [--device cuda|cpu] [--rows 1 256]

check: each kernel against the contract's pure-torch reference (relative max error), on random data:
podium-cuda's Triton ``gguf_linear`` for every kept GGUF format and its ``fp8_linear``
(``torch._scaled_mm``, per-channel scales) in bf16.
time: microseconds per call (CUDA events, median of 50 after warm-up) of bf16 ``F.linear`` (cuBLAS),
fp8 W8A8 (``torch._scaled_mm`` with the per-token activation quantization, and the bare GEMM), and the
Triton GGUF kernels (Q4_K, Q8_0, Q4_0); each with its ratio to bf16 in the same run.
``--device cpu`` is a dry run of the checks at a small shape (under TRITON_INTERPRET=1 for the GGUF kernels).
"""

# ruff: noqa: B023  (the lambdas are timed where they are made, inside the loop)
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from podium_plugin_api.fp8 import fp8_linear as fp8_reference
from podium_plugin_api.fp8 import quantize_per_token
from podium_plugin_api.gguf_blocks import BLOCKS, NAMES, Q4_0, Q4_K, Q8_0, gguf_linear, random_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def check(device: str) -> list[str]:
    from podium_cuda.fp8_linear import fp8_linear
    from podium_cuda.gguf import gguf_linear as triton_gguf

    lines = []
    n, k = (256, 512) if device == "cpu" else (4096, 4096)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    for ggml_type in sorted(BLOCKS):
        weight = random_rows(ggml_type, n, k, gen).to(device)
        for rows in (1, 37):
            x = torch.randn(rows, k, generator=gen).to(device, dtype)
            err = rel_error(triton_gguf(x, weight, ggml_type), gguf_linear(x.float(), weight, ggml_type))
            lines.append(f"check gguf_linear {NAMES[ggml_type]:5s} rows {rows:3d} {dtype}: rel max error {err:.2e}")
    if device != "cpu":
        weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
        scale = (torch.rand(n, 1, generator=gen) / 1000 + 1e-4).to(device)
        for rows in (1, 256):
            x = torch.randn(rows, k, generator=gen).to(device, torch.bfloat16)
            err = rel_error(fp8_linear(x, weight, scale), fp8_reference(x.float(), weight, scale))
            lines.append(f"check fp8_linear _scaled_mm rows {rows}: rel max error {err:.2e}")
    return lines


def timed(fn, repeat: int = 50) -> float:
    """Median microseconds of ``fn()`` over ``repeat`` calls (CUDA events), after 5 warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def time_shapes(rows_list: list[int]) -> list[str]:
    from podium_cuda.fp8_linear import fp8_linear
    from podium_cuda.gguf import gguf_linear as triton_gguf

    lines = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        w8 = (w.float() * 448 / w.float().abs().amax(dim=1, keepdim=True)).to(torch.float8_e4m3fn)
        s_w = (w.float().abs().amax(dim=1, keepdim=True) / 448).contiguous()
        blocks = {t: random_rows(t, n, k).cuda() for t in (Q4_K, Q8_0, Q4_0)}
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            q, s_x = quantize_per_token(x)
            base = timed(lambda: F.linear(x, w))
            results = {
                "fp8 W8A8": timed(lambda: fp8_linear(x, w8, s_w)),
                "fp8 GEMM only": timed(lambda: torch._scaled_mm(q, w8.t(), scale_a=s_x, scale_b=s_w.reshape(1, -1),
                                                                out_dtype=torch.bfloat16)),
                **{f"gguf {NAMES[t]}": timed(lambda t=t: triton_gguf(x, blocks[t], t)) for t in blocks},
            }
            lines.append(f"time {name:8s} N={n:5d} K={k:5d} rows {rows:3d}: bf16 {base:8.1f} us; "
                         + "; ".join(f"{label} {us:8.1f} us (x{us / base:.2f})" for label, us in results.items()))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 256])
    args = parser.parse_args()
    for line in check(args.device):
        print(line, flush=True)
    if args.device == "cuda":
        for line in time_shapes(args.rows):
            print(line, flush=True)


if __name__ == "__main__":
    main()
