"""The 8B engine's batch-256 decode attention launch, for Nsight Compute to read its counters.

    ncu --clock-control none -k regex:paged_attention_kernel -s 3 -c 1 --set full -o decode_fp8 \\
        python3 platforms/cuda/scripts/ncu_decode.py --cache fp8 --ctx 640
    ncu --import decode_fp8.ncu-rep --page details        # throughput, stalls, occupancy, as text

Runs ``bench_kernels.EngineDecodeSets`` (ragged lengths ``ctx`` +- 8, q / k / v views of one qkv row,
the new token rotated and stored in the kernel) a few times with the platform's tuning, or with
``--tuning`` (the tuning option's syntax, e.g. ``fp8_decode=16/32/1/2``); ``-s 3`` skips the
warm-up launches so the one profiled launch runs a compiled kernel over a set not in L2.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from bench_kernels import BLOCK, DEV, DTYPE, FP8, HEAD, KV_HEADS, EngineDecodeSets  # the script's folder

from podium_cuda.tuning import CUDA_TUNING, parse_tuning


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--ctx", type=int, default=640)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--tuning", default="", help="changes to the platform's tuning in the tuning option's syntax")
    args = parser.parse_args()
    tuning = replace(CUDA_TUNING, **parse_tuning(args.tuning))
    sets = EngineDecodeSets(args.ctx, torch.Generator().manual_seed(0))
    cache_dtype = FP8 if args.cache == "fp8" else DTYPE
    cache = torch.empty(2, sets.num_blocks, BLOCK, KV_HEADS, HEAD, dtype=DTYPE, device=DEV).normal_().to(cache_dtype)
    calls = sets.calls(cache, tuning, new_path=True)
    for i in range(args.calls):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    kv_bytes = sets.tokens * 2 * KV_HEADS * HEAD * cache_dtype.itemsize
    print(f"{args.calls} decode launches, {args.cache} cache, ~{args.ctx} context: {kv_bytes / 1e6:.1f} MB of K/V each")


if __name__ == "__main__":
    main()
