"""The Triton fused MoE kernel on a GPU at real sizes: correctness against the contract's reference,
time, achieved bandwidth and FLOP rate against the device's ceilings, and a small tiling sweep.

    python benchmarks/moe_gpu.py                          # Mixtral-8x7B and Qwen3-30B-A3B layers, bf16
    python benchmarks/moe_gpu.py --shapes qwen3-30b-a3b --tokens 1 64 256 --sweep

One layer's expert computation (router outputs random, weights random): the default tiling, timed
with CUDA events over a captured CUDA graph of the op (what a decode step replays), and the
reference (eager; it syncs the host). Bytes: the weights of every expert the batch routes to, plus
the activations in and out; FLOPs: 6 * assignments * hidden * intermediate. Ceilings: H200 HBM3e
4.8 TB/s, bf16 dense tensor cores 989 TFLOP/s (override with --peak-tbs / --peak-tflops).
"""

from __future__ import annotations

import argparse

import torch

from podium_cuda.moe import MOE_TILINGS, MoETiling, fused_moe, moe_tiling
from podium_plugin_api.moe import MoEExperts
from podium_plugin_api.moe import fused_moe as reference

SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}  # E, K, H, I
SWEEP = [MoETiling(m, n, 64, w, s) for m, n, w, s in ((16, 64, 4, 4), (16, 128, 4, 4), (32, 64, 4, 4), (32, 128, 4, 3),
                                                      (64, 64, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3))]


def experts_for(shape: str, dtype: torch.dtype) -> MoEExperts:
    num_experts, _, hidden, inter = SHAPES[shape]
    with torch.device("cuda"):
        experts = MoEExperts(num_experts, hidden, inter).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, hidden**-0.5)
        experts.down_proj.normal_(0, inter**-0.5)
    return experts.requires_grad_(False)


def graph_time_ms(fn, repeats: int = 50) -> float:
    """Median-free mean of ``repeats`` replays of ``fn`` captured in a CUDA graph, in ms."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def eager_time_ms(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def traffic(shape: str, ids: torch.Tensor, tokens: int, element: int) -> tuple[float, float]:
    """(bytes, flops) of one call: the routed experts' weights and the activations; 6 A H I."""
    _, top_k, hidden, inter = SHAPES[shape]
    experts_hit = int(torch.unique(ids).numel())
    weight_bytes = experts_hit * 3 * hidden * inter * element
    activation_bytes = tokens * hidden * element * 2 + tokens * top_k * (inter * element * 2 + hidden * 4 * 2)
    return weight_bytes + activation_bytes, 6.0 * tokens * top_k * hidden * inter


def measure(shape: str, experts: MoEExperts, tokens: int, args) -> None:
    """One token count: correctness, the default tiling's time and rates, the reference, the sweep."""
    num_experts, top_k, hidden, _ = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(experts.gate_up_proj.dtype)
    weights, ids = torch.randn(tokens, num_experts, device="cuda", generator=gen).softmax(-1).topk(top_k, dim=-1)
    got, want = fused_moe(x, experts, weights, ids), reference(x, experts, weights, ids)
    error = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    status = "OK" if error < 2e-2 else "MISMATCH"
    tiling = moe_tiling(tokens * top_k, num_experts)
    kernel_ms = graph_time_ms(lambda: fused_moe(x, experts, weights, ids))
    ref_ms = float("nan")
    if tokens <= args.reference_max_tokens:
        ref_ms = eager_time_ms(lambda: reference(x, experts, weights, ids))
    nbytes, flops = traffic(shape, ids, tokens, x.element_size())
    tbs, tflops = nbytes / kernel_ms / 1e9, flops / kernel_ms / 1e9
    print(f"tokens {tokens:5d}: {status} (relative error {error:.1e}); kernel {kernel_ms * 1e3:9.1f} us "
          f"[{tiling.block_m}/{tiling.block_n}/{tiling.block_k}/{tiling.num_warps}/{tiling.num_stages}]  "
          f"{tbs:5.2f} TB/s ({100 * tbs / args.peak_tbs:4.1f}% of {args.peak_tbs})  "
          f"{tflops:6.1f} TFLOP/s ({100 * tflops / args.peak_tflops:4.1f}% of {args.peak_tflops:.0f})  "
          f"reference {ref_ms * 1e3:10.1f} us ({ref_ms / kernel_ms:6.1f}x)")
    if args.sweep:
        timings = {t: graph_time_ms(lambda t=t: fused_moe(x, experts, weights, ids, tiling=t), 20) for t in SWEEP}
        best = min(timings, key=timings.get)
        print(f"    sweep: best {best.block_m}/{best.block_n}/{best.block_k}/{best.num_warps}/{best.num_stages} "
              f"{timings[best] * 1e3:.1f} us; " + ", ".join(f"{t.block_m}/{t.block_n}/{t.num_warps}/{t.num_stages}:"
                                                         f"{ms * 1e3:.0f}" for t, ms in timings.items()))


def run_shape(shape: str, tokens_list: list[int], args) -> None:
    num_experts, top_k, hidden, inter = SHAPES[shape]
    experts = experts_for(shape, getattr(torch, args.dtype))
    print(f"== {shape} ({num_experts} experts, top {top_k}, {hidden} x {inter}, {args.dtype})")
    for tokens in tokens_list:
        measure(shape, experts, tokens, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES, reverse=True))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 4096])
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--sweep", action="store_true", help="also time the tilings in SWEEP")
    parser.add_argument("--reference-max-tokens", type=int, default=4096)
    parser.add_argument("--peak-tbs", type=float, default=4.8)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; default tilings by assignments per expert: "
          + ", ".join(f"<= {limit}: {t.block_m}/{t.block_n}/{t.block_k}/{t.num_warps}/{t.num_stages}"
                      for limit, t in MOE_TILINGS))
    for shape in args.shapes:
        run_shape(shape, args.tokens, args)


if __name__ == "__main__":
    main()
