"""The Triton SGMV LoRA kernels' time per decoder layer of the 8B shape, against the layer's base GEMMs.

One layer's four adapted projections (q|k|v, o, gate|up, down; rank 16, 8 slots, bf16), each a
shrink then an expand, captured in a CUDA graph and replayed (no launch overhead, as in a decode
graph), for: a decode step of 256 rows as a captured graph maps it (every row may be any slot's)
with the rows round-robin over 8 adapters, and with no adapter at all (what the base model paid in
graphs captured with the adapters); a 2048-row prefill (8 sequences of 256 rows, one adapter each)
mapped eagerly. Each decode case under a few tilings (BLOCK_M, BLOCK_N), as two launches per
projection (shrink, expand) and as the fused one (``lora_shrink_expand``); the prefill case under a
few prefill tilings (BLOCK_M, BLOCK_N, BLOCK_K, warps, the programs split-K aims at): the variants of ``podium_cuda.lora``, each
timed in the same run as its default (marked).

    python benchmarks/lora_kernel_bench.py            (a CUDA GPU; ~30 s)
    TRITON_INTERPRET=1 python benchmarks/lora_kernel_bench.py --smoke     (a check that it runs)
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import podium_cuda.lora as kernels
from podium_plugin_api.lora import lora_mapping

HIDDEN, INTER, HEADS_DIM, KV_DIM = 4096, 14336, 4096, 1024
SLOTS, RANK = 8, 16
PROJECTIONS = {  # name: (K, N, slices)
    "qkv": (HIDDEN, HEADS_DIM + 2 * KV_DIM, 3), "o": (HEADS_DIM, HIDDEN, 1),
    "gate_up": (HIDDEN, 2 * INTER, 2), "down": (INTER, HIDDEN, 1),
}
LT = kernels.LoRATiling
DECODE_VARIANTS = [  # (fused, tiling); the default tiling's two launches come first
    (False, kernels.DECODE), (False, LT(16, 64, 64, 4)), (False, LT(32, 128, 64, 4)), (False, LT(64, 128, 64, 4)),
    (True, kernels.DECODE), (True, LT(16, 64, 64, 4)), (True, LT(32, 128, 64, 4)), (True, LT(32, 64, 128, 4)),
]
PREFILL_VARIANTS = [kernels.PREFILL, LT(64, 64, 64, 4, 528), LT(64, 64, 64, 4, 1056), LT(64, 128, 64, 4),
                    LT(64, 128, 128, 8), LT(128, 128, 64, 8), LT(32, 64, 64, 4), LT(32, 64, 64, 4, 1056)]


def graph_time(fn, iters: int) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph (on the CPU: called, for --smoke)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e6 / iters
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def time_case(label: str, layer: dict, rows: int, slots: list[int], graph: bool, fused_pass: bool, iters: int,
              dev, dtype) -> None:
    """Print the base GEMMs' and the LoRA ops' microseconds per layer for one step's rows, under the
    two-launch variants or (``fused_pass``) the fused ones, with how far the fused result is from the
    default's two launches (a race in its wait would show there)."""
    mapping = lora_mapping(slots, SLOTS, dev)
    if graph:  # what a captured graph's fixed memory gives: no host counts
        mapping = dataclasses.replace(mapping, max_slot_rows=None, num_slotted_rows=None)
    xs = {name: torch.randn(rows, w.shape[1], device=dev, dtype=dtype) for name, (w, _, _) in layer.items()}
    ys = {name: torch.zeros(rows, w.shape[0], device=dev, dtype=dtype) for name, (w, _, _) in layer.items()}

    def base():
        for name, (w, _, _) in layer.items():
            torch.matmul(xs[name], w.t(), out=ys[name])

    def lora():
        for name, (_, a, b) in layer.items():
            kernels.lora_expand(ys[name], kernels.lora_shrink(xs[name], a, mapping), b, mapping)

    def fused():
        for name, (_, a, b) in layer.items():
            kernels.lora_shrink_expand(ys[name], xs[name], a, b, mapping)

    base_us = graph_time(base, iters)
    print(f"{label}: base GEMMs {base_us:.1f} us/layer")
    saved = kernels.DECODE, kernels.PREFILL
    if fused_pass:
        variants = [(True, t) for f, t in DECODE_VARIANTS if f]
    else:
        variants = [(False, t) for f, t in DECODE_VARIANTS if not f] if graph else [(False, t) for t in PREFILL_VARIANTS]
    for is_fused, tiling in variants:
        if graph:
            kernels.DECODE = tiling
        else:
            kernels.PREFILL = tiling
        default = tiling == saved[0 if graph else 1] and not is_fused
        t = tiling
        which = (f"{'decode' if graph else 'prefill'} tiling M{t.block_m} N{t.block_n} K{t.block_k} w{t.num_warps} "
                 f"P{t.target_programs}, {'fused (one launch)' if is_fused else 'two launches'}")
        try:
            lora_us = graph_time(fused if is_fused else lora, iters)
            agree = ""
            if is_fused:
                for y in ys.values():
                    y.zero_()
                fused()
                got = {name: y.clone() for name, y in ys.items()}
                kernels.DECODE, kernels.PREFILL = saved
                for y in ys.values():
                    y.zero_()
                lora()
                worst = max(float((got[n].float() - y.float()).abs().max() / (y.float().abs().max() + 1e-30))
                            for n, y in ys.items())
                agree = f", {worst:.1e} from the two launches (relative)"
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not hide the others' times
            print(f"  {which}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        finally:
            kernels.DECODE, kernels.PREFILL = saved
        print(f"  {which}{' (default)' if default else ''}: LoRA {lora_us:.1f} us/layer = "
              f"{lora_us / base_us:.3f} x the base GEMMs{agree}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="shapes / 64, float32, 1 iteration (a CPU under "
                        "TRITON_INTERPRET=1 can run it)")
    args = parser.parse_args()
    scale, dtype = (64, torch.float32) if args.smoke else (1, torch.bfloat16)
    iters = 1 if args.smoke else args.iters
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    layer = {}
    for name, (k, n, slices) in PROJECTIONS.items():
        k, n, inner = k // scale, n // scale, RANK * slices
        layer[name] = (torch.randn(n, k, generator=gen) / k**0.5, torch.randn(SLOTS, inner, k, generator=gen) / k**0.5,
                       torch.randn(SLOTS, n, inner, generator=gen) / inner**0.5)
        layer[name] = tuple(t.to(dev, dtype) for t in layer[name])
    decode, prefill = 256 // (8 if args.smoke else 1), 2048 // (8 if args.smoke else 1)
    cases = {
        f"decode {decode} rows, 8 adapters (graph mapping)": (decode, [i % SLOTS for i in range(decode)], True),
        f"decode {decode} rows, no adapter (graph mapping)": (decode, [-1] * decode, True),
        f"prefill {prefill} rows, 8 adapters (eager mapping)": (prefill, [i * SLOTS // prefill for i in range(prefill)],
                                                                False),
    }
    # the fused variants last: a kernel that waits on others' work could hang, and the timeout that
    # would end it should take no other variant's line with it
    for fused_pass in (False, True):
        for label, (rows, slots, graph) in cases.items():
            if graph or not fused_pass:
                time_case(label, layer, rows, slots, graph, fused_pass, iters, dev, dtype)


if __name__ == "__main__":
    main()
