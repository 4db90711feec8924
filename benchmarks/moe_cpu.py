"""The CPU platform's fused MoE op (experts on packed linears) against the contract's pure-torch
reference, in one process, alternated: one MoE layer's expert computation at decode and prefill sizes.

    python benchmarks/moe_cpu.py                      # Mixtral's layer (8 experts, top 2, 4096 x 14336), bf16
    python benchmarks/moe_cpu.py --shape qwen3-30b-a3b --dtype float32 --tokens 1 16 256
    python benchmarks/moe_cpu.py --shape small        # a quick check that it runs (seconds)

Prints, per token count, the median time of each and the ratio reference / platform (> 1: the
platform's op is faster), and checks the two agree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from podium_cpu import CpuPlatform
from podium_cpu.fused_ops import cpu_ops
from podium_cpu.linear_packing import pack_linear_layers
from podium_cpu.moe import PACKED_ATTRIBUTE, pack_experts
from podium_cpu.native_kernels import load_kernels
from podium_plugin_api.moe import MoEExperts
from podium_plugin_api.ops import fused_moe as reference

# name -> (experts, top_k, hidden, intermediate)
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768), "small": (8, 2, 256, 512)}


def experts_for(shape: str, dtype: torch.dtype) -> MoEExperts:
    num_experts, _, hidden, inter = SHAPES[shape]
    experts = MoEExperts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, hidden**-0.5)
        experts.down_proj.normal_(0, inter**-0.5)
    return experts.requires_grad_(False).to(dtype)


def timed(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def alternated(first, second, args: tuple, repeats: int, pairs: int) -> tuple[float, float]:
    """Median ms of ``first(*args)`` and ``second(*args)``, timed in alternation ``pairs`` times."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(pairs):
        for fn, out in zip((first, second), times):
            out.append(timed(lambda fn=fn: fn(*args), repeats) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--pairs", type=int, default=5, help="alternated (reference, platform) timing pairs")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernels, why = load_kernels()
    platform_op = cpu_ops(kernels)["fused_moe"]
    experts = experts_for(args.shape, dtype)
    packed = pack_experts(experts, partial(pack_linear_layers, rules=CpuPlatform().linear_rules()))
    num_experts, top_k, hidden, inter = SHAPES[args.shape]
    kind = type(getattr(experts, PACKED_ATTRIBUTE).gate_up[0]).__name__ if packed else "none (reference)"
    print(f"{args.shape} {args.dtype}: {num_experts} experts, top {top_k}, {hidden} x {inter}; packed linears: {kind}; "
          f"native kernels: {'yes' if kernels else why}; {torch.get_num_threads()} threads")
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden).to(dtype)
        weights, ids = torch.randn(tokens, num_experts).softmax(-1).topk(top_k, dim=-1)
        want, got = reference(x, experts, weights, ids), platform_op(x, experts, weights, ids)
        error = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        ref_ms, our_ms = alternated(reference, platform_op, (x, experts, weights, ids), max(1, 64 // tokens), args.pairs)
        print(f"tokens {tokens:5d}: reference {ref_ms:9.3f} ms  platform {our_ms:9.3f} ms  "
              f"ratio {ref_ms / our_ms:5.2f}x  (max relative difference {error:.1e})")


if __name__ == "__main__":
    main()
