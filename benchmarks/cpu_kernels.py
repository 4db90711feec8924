"""The CPU platform's kernels alone, at SmolLM2-135M's shapes, each against what it replaced:

    python benchmarks/cpu_kernels.py [--only decode prefill linear gguf step] [--rows 1 32 64 512] [--threads N]

decode: one decode step's 30 layers of ``CpuAttentionBackend.forward`` (write + attend), 32
sequences of ``--context`` tokens over blocks scattered at random (the worst case for the hardware
prefetcher), float32 and bf16, replayed as a CPU graph: each layer its own cache (read from memory)
and all layers one cache (read from the L3); ms per step and the KV bytes read over that time.
prefill: one layer's attention of 4 fresh 512-token prompts and of a 128-token chunk over 512
cached tokens: the native kernel's flash tiles against the torch path (one SDPA call a sequence).
linear: each SmolLM2 linear shape at each ``--rows``: every native kernel this CPU runs (the one the
platform's rule picks marked ``*``) against oneDNN's packed matmul of the same dtype (float32 where oneDNN
packs no bf16: AVX2); the ratio is
native time / oneDNN time (below 1: native faster); this is what ``linear_choice``'s rule rests on.
gguf: the kept GGUF linears (``gguf_ops.gguf_linear``, random Q4_1 rows at SmolLM2's decoder shapes and a
Q8_0 LM head, bf16 rows) at each ``--rows``: on the 512-bit batch path where this CPU has one (AMX-INT8
tiles, or their layout on AVX-512 VNNI) and on the AVX2 / VNNI-256 rows, against the bf16 native linear
the platform picks for the shape; the ratio is the batch path's time / bf16's.
step (not in the default set): a decode step's linears (30 layers' four and the LM head, at ``--seqs``
rows, the kernels the platform picks) replayed as a CPU graph, weights from memory and from cache.
``--variant-flags "-DNAME=VALUE ..."``: also the same step from memory through a build of fma_linear.c
with those compiler flags added (its tuning macros, such as ``-DFMA_AHEAD=0``), the two interleaved
trial by trial in this process (medians of 12), and whether their outputs are the same bits.

Timings are the best of several, the variants interleaved trial by trial so that a busy machine
slows them alike; ``--cpu-time`` times process CPU time instead of wall time (with ``--threads 1``,
least disturbed by other processes). Leave OMP_WAIT_POLICY unset, as for any benchmark.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from podium_cpu.attention import CpuAttentionBackend
from podium_cpu.graphs import CpuGraphRunner
from podium_cpu.linear_choice import runnable_native_kernels
from podium_cpu.linear_packing import NativeLinear
from podium_cpu.native_kernels import FLAGS, LIBRARIES, _bind, _build, _compiler, load_kernels
from podium_cpu.onednn_linear import PackedLinear, can_pack
from podium_cpu.platform import CpuPlatform
from podium_plugin_api import AttentionLayerSpec, AttentionMetadata, KVCacheSpec

LAYERS, HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 30, 9, 3, 64, 16
LINEARS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYER = AttentionLayerSpec(num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE**-0.5)
CLOCK = time.perf_counter


def best_of(variants: dict, calls: int = 5, trials: int = 5) -> dict[str, float]:
    """Seconds a call of each variant, the best of ``trials``, the variants interleaved."""
    for fn in variants.values():
        fn()
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(trials):
        for name, fn in variants.items():
            start = CLOCK()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (CLOCK() - start) / calls)
    return best


def batch(backend, dtype: torch.dtype, seqs: list[tuple[int, int]], scattered: bool = True):
    """(caches, metadata, q, k, v) of a step of (query_len, seq_len) sequences, one cache a layer."""
    blocks = [-(-s // BLOCK) for _, s in seqs]
    total = sum(blocks) + 4
    spec = KVCacheSpec(num_layers=1, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK, dtype=dtype)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(0)) if scattered else torch.arange(total)
    tables, at = [], 0
    for n in blocks:
        tables.append(order[at:at + n].tolist() + [0] * (max(blocks) - n))
        at += n
    meta = AttentionMetadata.from_lengths([q for q, _ in seqs], [s for _, s in seqs], tables, BLOCK, device="cpu")
    tokens = sum(q for q, _ in seqs)
    q = torch.randn(tokens, HEADS, HEAD_SIZE).to(dtype)
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_SIZE).to(dtype) for _ in range(2))
    return torch.randn(backend.kv_cache_shape(spec, total)).to(dtype), backend.prepare_metadata(meta), q, k, v


def decode(dtype: torch.dtype, seqs: int, context: int) -> None:
    """A step's 30 attention layers replayed as a CPU graph (no Python between them, as in the engine):
    each layer its own cache ("from memory": 30 caches, more than the L3 holds at these sizes) and
    every layer the same cache ("from cache": the reads hit the L3 after the first layer). Their
    difference is what waiting on memory costs; the second is what the kernel's arithmetic and its
    cache-to-core traffic cost."""
    backend = CpuPlatform().attention_backend()
    cache, meta, q, k, v = batch(backend, dtype, [(1, context + 1)] * seqs)
    caches = [cache] + [torch.randn_like(cache.float()).to(dtype) for _ in range(LAYERS - 1)]

    def step(layer_caches):
        def run():
            for c in layer_caches:
                backend.forward(LAYER, q, k, v, c, meta)
        return CpuGraphRunner().capture(run)

    times = best_of({"from memory": step(caches), "from cache": step([cache] * LAYERS)}, calls=2)
    kv_bytes = seqs * (context + 1) * KV_HEADS * HEAD_SIZE * 2 * cache.element_size() * LAYERS
    print(f"decode attention {str(dtype):15s} {seqs} x {context} context ({backend.name}), ms a step (KV read rate): "
          + ", ".join(f"{name} {t * 1e3:.2f} ({kv_bytes / t / 1e9:.1f} GB/s)" for name, t in times.items()))


def prefill(dtype: torch.dtype) -> None:
    native, plain = CpuPlatform().attention_backend(), CpuAttentionBackend(kernels=None)
    for label, seqs in (("4 fresh x 512", [(512, 512)] * 4), ("128 over 512 cached", [(128, 640)])):
        variants = {}
        for name, backend in (("native tiles", native), ("torch SDPA", plain)):
            cache, meta, q, k, v = batch(backend, dtype, seqs, scattered=False)
            variants[name] = lambda b=backend, c=cache, m=meta, q=q, k=k, v=v: b.forward(LAYER, q, k, v, c, m)
        times = best_of(variants, calls=1)
        print(f"prefill attention {str(dtype):15s} {label:20s} one layer: " + ", ".join(
            f"{n} {t * 1e3:.2f} ms" for n, t in times.items())
              + f"; SDPA / native {times['torch SDPA'] / times['native tiles']:.2f}x")


def linears(rows_list: list[int]) -> None:
    kernels, why = load_kernels()
    natives = runnable_native_kernels(kernels) if kernels is not None else []
    platform = CpuPlatform()
    for dtype in (torch.bfloat16, torch.float32):
        mine = [k for k in natives if k.dtype == dtype]
        # where oneDNN packs no bf16 (AVX2), the bf16 kernels are timed against its float32 matmul:
        # what the engine would run with those weights widened
        reference = dtype if can_pack(dtype) else torch.float32
        if not mine or not can_pack(reference):
            print(f"linear {dtype}: nothing to compare ({why or 'no native kernel or no oneDNN packing here'})")
            continue
        for name, (n, k) in LINEARS.items():
            torch.manual_seed(0)
            base = nn.Linear(k, n, bias=False).to(dtype).requires_grad_(False)
            layers = {"onednn": PackedLinear(copy.deepcopy(base).to(reference)),  # (.to is in place)
                      **{kern.name: NativeLinear(base, kern) for kern in mine}}
            for rows in rows_list:
                x = torch.randn(rows, k).to(dtype)
                calls = max(1, int(2e8 // (rows * n * k)))
                inputs = {kind: x.to(reference) if kind == "onednn" else x for kind in layers}
                times = best_of({kind: (lambda layer=layer, x=inputs[kind]: layer(x)) for kind, layer in layers.items()},
                                calls=calls)
                chosen = platform.linear_kernel(dtype, n, k, rows).kernel
                flops = 2 * rows * n * k
                print(f"linear {str(dtype):15s} {name:8s} [{rows:4d} x {k}] -> {n}: " + ", ".join(
                    f"{kind}{'' if kind != 'onednn' or reference == dtype else ' (float32)'}{'*' if kind == chosen else ''} {t * 1e6:.0f} us ({flops / t / 1e9:.0f} GF/s)"
                    + ("" if kind == "onednn" else f" {t / times['onednn']:.2f}x") for kind, t in times.items()),
                    flush=True)


def fma_variant(kernels, flags: str, folder: str):
    """``kernels`` with fma_linear.c's entries from a build with ``flags`` added (into ``folder``): the
    platform's own build and binding, the variant library first so that its fma entries win."""
    source, extra = LIBRARIES["fma_linear"]
    target = Path(folder) / "fma_variant.so"
    _build(_compiler()[0], source, FLAGS + extra + tuple(shlex.split(flags)), target)
    entries = _bind([ctypes.CDLL(str(target)), *(ctypes.CDLL(str(path)) for path in kernels.paths)])
    return dataclasses.replace(kernels, **{name: entries[f"podium_{name}"]
                                           for name in ("fma_linear", "fma_fused_linear", "fma_pack")})


def step_linears(dtype: torch.dtype, rows: int, variant_flags: str | None = None) -> None:
    """A decode step's linears as the engine runs them: 30 layers' qkv, o, gate_up and down and the LM
    head at ``rows`` rows, through the kernel the platform picks, replayed as a CPU graph; each layer
    its own weights ("from memory") and every layer the same ("from cache"), and their rate against
    the machine's dot-product peak (benchmarks/cpu_ceilings.py)."""
    platform = CpuPlatform()
    kernels, _ = load_kernels()
    by_name = {k.name: k for k in runnable_native_kernels(kernels) if k.dtype == dtype} if kernels else {}
    torch.manual_seed(0)

    def layer(name: str) -> NativeLinear | None:
        n, k = LINEARS[name]
        kernel = by_name.get(platform.linear_kernel(dtype, n, k, rows).kernel)
        return None if kernel is None else NativeLinear(nn.Linear(k, n, bias=False).to(dtype).requires_grad_(False), kernel)

    names = ("qkv", "o", "gate_up", "down")
    layers = [{name: layer(name) for name in names} for _ in range(LAYERS)]
    head = layer("lm_head")
    if head is None or any(m is None for m in layers[0].values()):
        print(f"step linears {dtype}: a linear here is not native (no graph to replay)")
        return
    xs = {k: torch.randn(rows, k).to(dtype) for k in {LINEARS[name][1] for name in names}}

    def graph(which):
        def run():
            for i in which:
                for name in names:
                    layers[i][name](xs[LINEARS[name][1]])
        return CpuGraphRunner().capture(run)

    times = best_of({"from memory": graph(range(LAYERS)), "from cache": graph([0] * LAYERS),
                     "LM head": CpuGraphRunner().capture(lambda: head(xs[576]))}, calls=2)
    flops = {"LM head": 2 * rows * 49152 * 576}
    flops["from memory"] = flops["from cache"] = 2 * rows * LAYERS * sum(n * k for n, k in (LINEARS[m] for m in names))
    print(f"step linears {str(dtype):15s} {rows} rows, ms (GF/s): " + ", ".join(
        f"{name} {t * 1e3:.2f} ({flops[name] / t / 1e9:.0f})" for name, t in times.items()))
    if variant_flags is None:
        return
    if any(m.kernel.name != "fma" for m in [head, *layers[0].values()]):
        print(f"step linears {dtype}: --variant-flags builds fma_linear.c, which these linears do not run")
        return
    with tempfile.TemporaryDirectory() as folder:
        other = {k.dtype: k for k in runnable_native_kernels(fma_variant(kernels, variant_flags, folder))
                 if k.name == "fma"}[dtype]

        def twin(built: NativeLinear) -> NativeLinear:  # the same weight through the variant's kernel
            linear = nn.Linear(built.in_features, built.out_features, bias=False).to(dtype).requires_grad_(False)
            linear.weight.copy_(built.weight)
            return NativeLinear(linear, other)

        twins = [{name: twin(layers[i][name]) for name in names} for i in range(LAYERS)]
        twin_head = twin(head)

        def whole(ls, h):
            def run():
                for layer_ in ls:
                    for name in names:
                        layer_[name](xs[LINEARS[name][1]])
                h(xs[576])
            return CpuGraphRunner().capture(run)

        runs = {"built": whole(layers, head), "variant": whole(twins, twin_head)}
        same = all(torch.equal(layers[i][n](xs[LINEARS[n][1]]), twins[i][n](xs[LINEARS[n][1]]))
                   for i in (0, LAYERS - 1) for n in names) and torch.equal(head(xs[576]), twin_head(xs[576]))
        samples = {name: [] for name in runs}
        for trial in range(12):
            for name in (("built", "variant") if trial % 2 == 0 else ("variant", "built")):
                start = CLOCK()
                runs[name]()
                samples[name].append(CLOCK() - start)
        built, variant = (statistics.median(samples[n]) for n in ("built", "variant"))
        print(f"step linears + LM head {str(dtype):15s} {rows} rows from memory, medians of 12 interleaved: "
              f"as built {built * 1e3:.2f} ms, with {variant_flags} {variant * 1e3:.2f} ms "
              f"(variant / built {variant / built:.3f}; same bits: {same})")


def gguf_linears(rows_list: list[int]) -> None:
    from podium_cpu import gguf_ops
    from podium_plugin_api.gguf_blocks import random_rows

    kernels, why = load_kernels()
    platform = CpuPlatform()
    if kernels is None:
        print(f"gguf: nothing to compare ({why})")
        return
    amx = bool(kernels.amx_linear) and bool(kernels.gguf_amx(1))
    wide = "amx" if amx else "vnni512" if kernels.gguf_vnni512(1) else None

    def path(on: bool) -> None:  # the 512-bit batch path on, or the AVX2 / VNNI-256 rows
        kernels.gguf_amx(1 if on and amx else 0)
        kernels.gguf_vnni512(1 if on and wide == "vnni512" else 0)

    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in LINEARS.items():
        ggml_type = 8 if name == "lm_head" else 3  # Q8_0, Q4_1
        weight = random_rows(ggml_type, n, k, gen)
        base = nn.Linear(k, n, bias=False).to(torch.bfloat16).requires_grad_(False)
        for rows in rows_list:
            x = torch.randn(rows, k).to(torch.bfloat16)
            choice = platform.linear_kernel(torch.bfloat16, n, k, rows).kernel
            native = [kern for kern in runnable_native_kernels(kernels) if kern.name == choice]
            bf16 = NativeLinear(base, native[0]) if native else PackedLinear(copy.deepcopy(base))
            def kept(on: bool, x=x, w=weight, t=ggml_type):
                path(on)
                return gguf_ops.gguf_linear(kernels, x, w, t)

            variants = {"vectors": lambda kept=kept: kept(False), "bf16": lambda x=x, layer=bf16: layer(x)}
            if wide:
                variants[wide] = lambda kept=kept: kept(True)
            times = best_of(variants, calls=max(1, int(2e8 // (rows * n * k))))
            path(True)
            print(f"gguf {'Q8_0' if ggml_type == 8 else 'Q4_1'} {name:8s} [{rows:4d} x {k}] -> {n}: "
                  + ", ".join(f"{kind} {t * 1e6:.0f} us" for kind, t in times.items())
                  + (f"; {wide} / bf16 ({choice}) {times[wide] / times['bf16']:.2f}x" if wide else ""), flush=True)


def main() -> None:
    global CLOCK
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64, 512])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=112)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--variant-flags", default=None, help="step: also through fma_linear.c built with these flags")
    parser.add_argument("--only", nargs="+", choices=["decode", "prefill", "linear", "gguf", "step"],
                        default=["decode", "prefill", "linear"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        CLOCK = time.process_time
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            if "decode" in args.only:
                decode(dtype, args.seqs, args.context)
            if "prefill" in args.only:
                prefill(dtype)
            if "step" in args.only:
                step_linears(dtype, args.seqs, args.variant_flags)
        if "linear" in args.only:
            linears(args.rows)
        if "gguf" in args.only:
            gguf_linears(args.rows)


if __name__ == "__main__":
    main()
