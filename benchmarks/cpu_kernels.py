"""The CPU platform's kernels alone, at SmolLM2-135M's decode shapes: paged attention and linears.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_kernels.py [--rows 32] [--context 112] [--only attention linear]

attention: one decode step's 30 layers of ``CpuAttentionBackend.forward`` (write + attend), 32
sequences of ``--context`` tokens over blocks scattered at random (the worst case for the hardware
prefetcher), float32 and bf16; reported as ms per step and the KV bytes read over that time.
linear: each SmolLM2 linear shape at ``--rows`` rows: torch's F.linear (float32: MKL's sgemm;
bf16: whatever this torch does), oneDNN's packed matmul (PackedLinear, where oneDNN packs the
dtype) and the native bf16 kernels this CPU runs (FmaLinear, AmxLinear); best of 5 timings.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from podium_cpu.linear_packing import AmxLinear, FmaLinear, PackedLinear, can_pack
from podium_cpu.native_kernels import load_kernels
from podium_cpu.platform import CpuPlatform
from podium_plugin_api import AttentionLayerSpec, AttentionMetadata, KVCacheSpec

LAYERS, HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 30, 9, 3, 64, 16
LINEARS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def best_seconds(fn, calls: int = 10, trials: int = 5) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def attention(dtype: torch.dtype, seqs: int, context: int) -> None:
    backend = CpuPlatform().attention_backend()
    per_seq = -(-(context + 1) // BLOCK)
    num_blocks = seqs * per_seq + 4
    spec = KVCacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK, dtype=dtype)
    caches = [torch.randn(backend.kv_cache_shape(spec, num_blocks)).to(dtype) for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[: seqs * per_seq]
    meta = AttentionMetadata.from_lengths([1] * seqs, [context + 1] * seqs, tables.view(seqs, per_seq).tolist(),
                                          BLOCK, device="cpu")
    meta = backend.prepare_metadata(meta)
    layer = AttentionLayerSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5)
    q = torch.randn(seqs, HEADS, HEAD_SIZE).to(dtype)
    k, v = (torch.randn(seqs, KV_HEADS, HEAD_SIZE).to(dtype) for _ in range(2))

    def step():
        for cache in caches:
            backend.forward(layer, q, k, v, cache, meta)

    seconds = best_seconds(step, calls=5)
    kv_bytes = seqs * (context + 1) * KV_HEADS * HEAD_SIZE * 2 * caches[0].element_size() * LAYERS
    print(f"attention {str(dtype):15s} {seqs} x {context} context ({backend.name}): {seconds * 1e3:7.2f} ms a step, "
          f"KV {kv_bytes / 1e6:.0f} MB -> {kv_bytes / seconds / 1e9:.1f} GB/s")


def linear_times(n: int, k: int, rows: int, native) -> dict[str, float]:
    """Seconds per call of every path this CPU has for a [rows, k] x [k, n] linear."""
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False).requires_grad_(False)
    x32 = torch.randn(rows, k)
    times = {"F.linear fp32": best_seconds(lambda: F.linear(x32, base.weight))}
    if can_pack(torch.float32):
        packed = PackedLinear(base)
        times["onednn fp32"] = best_seconds(lambda: packed(x32))
    bf16 = nn.Linear(k, n, bias=False).bfloat16().requires_grad_(False)
    x16 = x32.bfloat16()
    times["F.linear bf16"] = best_seconds(lambda: F.linear(x16, bf16.weight), calls=2, trials=2)
    if can_pack(torch.bfloat16):
        packed16 = PackedLinear(bf16)
        times["onednn bf16"] = best_seconds(lambda: packed16(x16))
    for cls, kernel, pack in native:
        if kernel is not None:
            layer = cls(bf16, kernel, pack)
            times[f"{cls.kind} bf16"] = best_seconds(lambda layer=layer: layer(x16))
    return times


def linears(rows: int) -> None:
    kernels = load_kernels()[0]
    native = []
    if kernels is not None:
        native = [(cls, getattr(kernels, f"{kind}_linear").get(torch.bfloat16), getattr(kernels, f"{kind}_pack")[torch.bfloat16])
                  for cls, kind in ((AmxLinear, "amx"), (FmaLinear, "fma"))]
    for name, (n, k) in LINEARS.items():
        flops = 2 * rows * n * k
        times = linear_times(n, k, rows, native)
        print(f"linear {name:8s} [{rows} x {k}] -> {n}: " + ", ".join(
            f"{label} {t * 1e6:.0f} us ({flops / t / 1e9:.0f} GF/s)" for label, t in times.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=112)
    parser.add_argument("--only", nargs="+", choices=["attention", "linear"], default=["attention", "linear"])
    args = parser.parse_args()
    with torch.inference_mode():
        if "attention" in args.only:
            for dtype in (torch.float32, torch.bfloat16):
                attention(dtype, args.rows, args.context)
        if "linear" in args.only:
            linears(args.rows)


if __name__ == "__main__":
    main()
