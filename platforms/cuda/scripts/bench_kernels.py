"""Time podium_cuda's kernels on a GPU: decode/prefill attention (with tiling variants), fused ops.

    python3 platforms/cuda/scripts/bench_kernels.py --out results.json [--quick]

Kernel times come from CUDA-graph replays of many calls (launch gaps removed), the median of
several replays; inputs rotate over enough distinct KV sets to exceed the L2 cache, and are
random (never zeros). Eager times (``triton.testing.do_bench``, median) include the host's launch
cost. Decode bandwidth counts the K/V bytes each call must read; prefill counts causal FLOPs.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import time
import traceback
from dataclasses import replace

import torch
import triton.testing

from podium_cuda.fused_ops import FUSED_OPS
from podium_cuda.paged_attention import paged_attention
from podium_cuda.tuning import CUDA_TUNING, AttentionTiling, KernelTuning, plan_splits
from podium_plugin_api import ops as reference_ops

HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16  # Llama-3.1-8B attention, bf16
DTYPE = torch.bfloat16
DEV = "cuda"
ROTATE_BYTES = 256e6  # inputs rotated per timing: several times the 60 MB L2
DECODE_BATCHES, DECODE_CONTEXTS = (1, 64, 256), (512, 2048, 8192)
PREFILL_SHAPES = ((16, 0, 512), (2, 4096, 512), (4, 0, 2048))  # (sequences, cached tokens, new tokens)
OP_TOKENS = (1, 64, 256, 2048, 8192)
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)

DECODE_VARIANTS = [CUDA_TUNING.decode, AttentionTiling(16, 64, 4, 3), AttentionTiling(16, 128, 4, 2),
                   AttentionTiling(16, 32, 4, 3)]
PREFILL_VARIANTS = [CUDA_TUNING.prefill] + [AttentionTiling(*t) for t in (  # over both caches (fp8_prefill off)
    (128, 64, 4, 3), (128, 64, 4, 3, 64), (128, 32, 4, 3), (128, 32, 4, 3, 64), (128, 32, 4, 4, 64), (64, 32, 4, 3, 64))]


def tag(t: AttentionTiling) -> str:
    return f"m{t.block_m}/n{t.block_n}/w{t.num_warps}/s{t.num_stages}" + (f"/t{t.table_blocks}" if t.table_blocks else "")


def graph_ms(calls, replays: int = 15) -> float:
    """Milliseconds per call: capture all calls in one CUDA graph, median over replays."""
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
    return statistics.median(times) / len(calls)


def eager_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def ceilings() -> dict:
    x = torch.randn(2**29, dtype=torch.float32, device=DEV)  # 2 GiB
    y = torch.empty_like(x)
    ms = graph_ms([lambda: y.copy_(x)] * 10)
    a = torch.randn(8192, 8192, device=DEV, dtype=DTYPE)
    b = torch.randn(8192, 8192, device=DEV, dtype=DTYPE)
    mm = graph_ms([lambda: a @ b] * 5)
    return {"copy_TBps": 2 * x.numel() * 4 / ms / 1e9, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm / 1e9}


class PagedSets:
    """``sets`` distinct batches (block tables over disjoint random blocks) sharing one cache."""

    def __init__(self, num_seqs: int, ctx: int, q_len: int, rotate: bool = True, cache_dtype: torch.dtype = DTYPE):
        self.num_seqs, self.ctx, self.q_len = num_seqs, ctx, q_len
        per_seq = -(-ctx // BLOCK)
        self.kv_bytes = 2 * num_seqs * ctx * KV_HEADS * HEAD * cache_dtype.itemsize
        sets = max(1, min(128, math.ceil(ROTATE_BYTES / self.kv_bytes))) if rotate else 1
        num_blocks = sets * num_seqs * per_seq
        self.cache = torch.empty(2, num_blocks, BLOCK, KV_HEADS, HEAD, dtype=DTYPE, device=DEV).normal_().to(cache_dtype)
        perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
        self.tables = [perm[s * num_seqs * per_seq:(s + 1) * num_seqs * per_seq].view(num_seqs, per_seq) for s in range(sets)]
        self.qsl = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=DEV) * q_len
        self.seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=DEV)
        self.queries = [torch.randn(num_seqs * q_len, HEADS, HEAD, device=DEV, dtype=DTYPE) for _ in range(sets)]
        self.outs = [torch.empty_like(q) for q in self.queries]

    def calls(self, tuning: KernelTuning, splits: int):
        def call(i):
            return lambda: paged_attention(
                self.queries[i], self.cache[0], self.cache[1], self.qsl, self.seq_lens, self.tables[i],
                scale=HEAD**-0.5, max_query_len=self.q_len, num_splits=splits, out=self.outs[i], tuning=tuning)
        return [call(i) for i in range(len(self.tables))] * max(1, 8 // len(self.tables))


def bench_decode(results: dict, quick: bool) -> None:
    rows = results.setdefault("decode", [])
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            sets = PagedSets(batch, ctx, 1)
            for tiling in DECODE_VARIANTS[: 1 if quick else None]:
                tuning = KernelTuning(decode=tiling)
                splits = plan_splits(batch, KV_HEADS, ctx, tuning.split)
                ms = graph_ms(sets.calls(tuning, splits))
                rows.append({"batch": batch, "ctx": ctx, "tiling": tag(tiling), "splits": splits, "us": ms * 1e3,
                             "TBps": sets.kv_bytes / ms / 1e9})
                print(f"decode b={batch:<3} ctx={ctx:<5} {tag(tiling)} splits={splits:<2} {ms * 1e3:8.1f} us "
                      f"{sets.kv_bytes / ms / 1e9:6.2f} TB/s", flush=True)
            if batch == 1 or (batch == 64 and ctx == 8192):
                for splits in SPLIT_SWEEP:
                    ms = graph_ms(sets.calls(CUDA_TUNING, splits))
                    results.setdefault("decode_splits", []).append(
                        {"batch": batch, "ctx": ctx, "splits": splits, "us": ms * 1e3, "TBps": sets.kv_bytes / ms / 1e9})
            del sets
            torch.cuda.empty_cache()


SWEEP_CASES = ((256, 520), (256, 640), (256, 760), (64, 2048), (1, 512))  # (batch, context): the 8B runs' decode steps
SWEEP_VARIANTS = [AttentionTiling(16, n, w, st) for n in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3, 4)]


def bench_decode_sweep(results: dict, quick: bool) -> None:
    """Decode tilings at the contexts a 512-in / 256-out run passes through (ragged last blocks)."""
    rows = results.setdefault("decode_sweep", [])
    for batch, ctx in SWEEP_CASES:
        sets = PagedSets(batch, ctx, 1)
        best = None
        for tiling in SWEEP_VARIANTS[: 2 if quick else None]:
            tuning = KernelTuning(decode=tiling)
            splits = plan_splits(batch, KV_HEADS, ctx, tuning.split)
            try:
                ms = graph_ms(sets.calls(tuning, splits))
            except Exception as error:  # noqa: BLE001 (a tiling may not fit; keep sweeping)
                rows.append({"batch": batch, "ctx": ctx, "tiling": tag(tiling), "error": repr(error)[:200]})
                continue
            rows.append({"batch": batch, "ctx": ctx, "tiling": tag(tiling), "splits": splits, "us": ms * 1e3,
                         "TBps": sets.kv_bytes / ms / 1e9})
            if best is None or ms < best[0]:
                best = (ms, tag(tiling))
        current = next(r for r in rows if r["batch"] == batch and r["ctx"] == ctx and r["tiling"] == tag(CUDA_TUNING.decode))
        print(f"decode sweep b={batch:<3} ctx={ctx:<5} current {tag(CUDA_TUNING.decode)} {current['us']:.1f} us "
              f"({current['TBps']:.2f} TB/s); best {best[1]} {best[0] * 1e3:.1f} us "
              f"({sets.kv_bytes / best[0] / 1e9:.2f} TB/s)", flush=True)
        del sets
        torch.cuda.empty_cache()


FP8_DECODE_CASES = ((256, 640), (256, 520), (256, 760), (64, 2048), (1, 512))
FP8_PREFILL_SHAPES = ((2, 4096, 512), (16, 0, 512))
FP8_TILINGS = [AttentionTiling(16, n, w, st) for n in (32, 64, 128) for w in (2, 4) for st in (2, 3, 4)]


def bench_fp8(results: dict, quick: bool) -> None:
    """fp8 (e4m3) caches against bf16 at the 8B runs' shapes: value tiles converted by Triton's cast
    or in registers (``fp8_values_in_registers``) at the default decode tiling, then (batch 256,
    in registers) over FP8_TILINGS and split in two."""
    rows = results.setdefault("fp8", [])

    def record(kind, shape, label, calls, sets, flops=None):
        try:
            ms = graph_ms(calls)
        except Exception as error:  # noqa: BLE001 (a tiling may not fit)
            rows.append({"kind": kind, "shape": shape, "variant": label, "error": repr(error)[:200]})
            return
        row = {"kind": kind, "shape": shape, "variant": label, "us": ms * 1e3, "TBps": sets.kv_bytes / ms / 1e9}
        if flops:
            row["TFLOPs"] = flops / ms / 1e9
        rows.append(row)
        print(f"fp8 {kind} {shape} {label:30s} {ms * 1e3:8.1f} us {row['TBps']:5.2f} TB/s", flush=True)

    def name(cache_dtype, registers):
        return "bf16" if cache_dtype == DTYPE else f"fp8 {'registers' if registers else 'triton-cast'}"

    for batch, ctx in FP8_DECODE_CASES:
        shape = f"b{batch}/ctx{ctx}"
        for cache_dtype in (DTYPE, torch.float8_e4m3fn):
            sets = PagedSets(batch, ctx, 1, cache_dtype=cache_dtype)
            variants = [(False, CUDA_TUNING.decode, None)]
            if cache_dtype != DTYPE:
                variants.append((True, CUDA_TUNING.decode, None))
                if batch >= 256 and not quick:
                    variants += [(True, t, None) for t in FP8_TILINGS if t != CUDA_TUNING.decode]
                    variants.append((True, CUDA_TUNING.decode, 2))
            for registers, tiling, forced_splits in variants:
                tuning = replace(CUDA_TUNING, decode=tiling, fp8_values_in_registers=registers, fp8_decode=None)
                splits = forced_splits or plan_splits(batch, KV_HEADS, ctx, tuning.split)
                label = f"{name(cache_dtype, registers)} {tag(tiling)} splits {splits}"
                record("decode", shape, label, sets.calls(tuning, splits), sets)
            del sets
            torch.cuda.empty_cache()
    for num_seqs, cached, q_len in FP8_PREFILL_SHAPES:
        shape = f"{num_seqs}x{q_len}+{cached}"
        for cache_dtype in (DTYPE, torch.float8_e4m3fn):
            sets = PagedSets(num_seqs, cached + q_len, q_len, rotate=False, cache_dtype=cache_dtype)
            for registers in (False,) if cache_dtype == DTYPE else (False, True):
                tuning = replace(CUDA_TUNING, fp8_values_in_registers=registers)
                record("prefill", shape, name(cache_dtype, registers), sets.calls(tuning, 1), sets,
                       causal_flops(num_seqs, cached, q_len))
            del sets
            torch.cuda.empty_cache()
    for batch, ctx in FP8_DECODE_CASES:  # the best few of each decode shape, last (the tool returns the tail)
        shape = f"b{batch}/ctx{ctx}"
        best = sorted((r for r in rows if r["shape"] == shape and "us" in r), key=lambda r: r["us"])[:4]
        print(f"fp8 best {shape}: " + "; ".join(f"{r['variant']} {r['us']:.1f} us" for r in best), flush=True)


ENGINE_DECODE_BATCH, ENGINE_DECODE_CONTEXTS = 256, (520, 640, 760)  # lengths within +-8 (the 512/256 run's decode steps)
T = AttentionTiling
FP8 = torch.float8_e4m3fn
ENGINE_DECODE_VARIANTS = (  # (label, cache dtype, new-token path, changes to CUDA_TUNING)
    ("new, default", FP8, True, {}),
    ("new, 16/32/1/3 (one warp, ids in the loop)", FP8, True, {"fp8_decode": T(16, 32, 1, 3)}),
    ("new, 16/64/4/2", FP8, True, {"fp8_decode": None}),
    ("new, 16/16/1/5", FP8, True, {"fp8_decode": T(16, 16, 1, 5)}),
    # block ids from table entries in registers (table_blocks): copies num_stages - 1 tiles ahead
    *((f"new, {m}/{n}/{w}/{st}/{tb}", FP8, True, {"fp8_decode": T(m, n, w, st, tb)})
      for m, n, w, st, tb in ((16, 16, 1, 4, 64), (16, 16, 1, 5, 64), (16, 16, 1, 6, 64), (16, 32, 1, 4, 64))),
    ("cached, default", FP8, False, {}),
    ("cached, 16/32/1/3", FP8, False, {"fp8_decode": T(16, 32, 1, 3)}),
    ("bf16 new, default", DTYPE, True, {}),
    ("bf16 new, 16/64/4/2/64", DTYPE, True, {"decode": T(16, 64, 4, 2, 64)}),
    ("bf16 new, 16/16/1/5/64", DTYPE, True, {"decode": T(16, 16, 1, 5, 64)}),
)


def _env_value(value) -> str:
    if isinstance(value, AttentionTiling):
        return f"{value.block_m}/{value.block_n}/{value.num_warps}/{value.num_stages}/{value.table_blocks}"
    return str(int(value)) if isinstance(value, bool) else str(value)


class EngineDecodeSets:
    """Batch-256 decode inputs as the 8B engine hands them over: ragged lengths (``ctx`` +- 8), q / k /
    v as views of one fused qkv row, positions, slots and a float32 cos/sin table, over ``sets``
    block tables of disjoint random blocks (enough to pass the L2 cache) sharing one cache."""

    def __init__(self, ctx: int, gen: torch.Generator) -> None:
        batch = ENGINE_DECODE_BATCH
        self.lengths = torch.randint(ctx - 8, ctx + 9, (batch,), generator=gen)
        width = -(-int(self.lengths.max()) // BLOCK)
        self.tokens = int(self.lengths.sum())
        sets = max(1, min(16, math.ceil(ROTATE_BYTES / (self.tokens * 2 * KV_HEADS * HEAD))))
        self.num_blocks = sets * batch * width + 1
        perm = torch.randperm(self.num_blocks - 1, generator=gen).to(torch.int32)
        self.tables = [perm[i * batch * width:(i + 1) * batch * width].view(batch, width).to(DEV) for i in range(sets)]
        self.seq_lens = self.lengths.to(torch.int32).to(DEV)
        self.positions = (self.seq_lens - 1).to(torch.int64)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        self.qkv = [torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD, device=DEV, dtype=DTYPE) for _ in range(sets)]
        blocks = [t.gather(1, (self.positions // BLOCK).view(-1, 1)).view(-1).to(torch.int64) for t in self.tables]
        self.slots = [b * BLOCK + self.positions % BLOCK for b in blocks]
        self.outs = [torch.empty(batch, HEADS, HEAD, device=DEV, dtype=DTYPE) for _ in range(sets)]
        self.cos_sin = torch.randn(1024, HEAD, device=DEV, dtype=torch.float32)

    def call(self, i: int, cache: torch.Tensor, tuning: KernelTuning, new_path: bool):
        from podium_cuda.paged_attention import NewTokens

        qkv = self.qkv[i]
        new = NewTokens(self.positions, qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:], self.cos_sin,
                        self.slots[i]) if new_path else None
        return functools.partial(paged_attention, qkv[:, :HEADS], cache[0], cache[1], self.qsl, self.seq_lens,
                                 self.tables[i], scale=HEAD**-0.5, max_query_len=1, out=self.outs[i], new_tokens=new,
                                 tuning=tuning)

    def calls(self, cache: torch.Tensor, tuning: KernelTuning, new_path: bool):
        sets = len(self.tables)
        return [self.call(i, cache, tuning, new_path) for i in range(sets)] * max(1, 8 // sets)


def bench_engine_decode(results: dict, quick: bool) -> None:
    """The 8B engine's decode attention at batch 256 (``EngineDecodeSets``): the new tokens rotated,
    stored and attended in the kernel (``NewTokens``) over the decode tilings, against the
    cached-only launch (a mixed step's decodes). Writes the fastest fp8 new-token variant's
    PODIUM_CUDA_TUNING to ``best_engine_decode_env`` beside ``--out``."""
    rows = results.setdefault("engine_decode", [])
    gen = torch.Generator().manual_seed(0)
    for ctx in ENGINE_DECODE_CONTEXTS[:1] if quick else ENGINE_DECODE_CONTEXTS:
        sets = EngineDecodeSets(ctx, gen)
        for cache_dtype in (FP8, DTYPE):
            cache = torch.empty(2, sets.num_blocks, BLOCK, KV_HEADS, HEAD, dtype=DTYPE, device=DEV).normal_().to(cache_dtype)
            kv_bytes = sets.tokens * 2 * KV_HEADS * HEAD * cache_dtype.itemsize
            for label, dtype, new_path, changes in ENGINE_DECODE_VARIANTS:
                if dtype != cache_dtype:
                    continue
                try:
                    ms = graph_ms(sets.calls(cache, replace(CUDA_TUNING, **changes), new_path))
                except Exception as error:  # noqa: BLE001 (a variant may not compile or fit)
                    rows.append({"ctx": ctx, "variant": label, "error": repr(error)[:200]})
                    print(f"engine decode ctx~{ctx} {label}: {error!r}"[:300], flush=True)
                    continue
                rows.append({"ctx": ctx, "variant": label, "cache": str(cache_dtype).replace("torch.", ""),
                             "env": ",".join(f"{k}={_env_value(v)}" for k, v in changes.items()),
                             "us": ms * 1e3, "TBps": kv_bytes / ms / 1e9})
                print(f"engine decode ctx~{ctx} {label:28s} {ms * 1e3:8.1f} us {kv_bytes / ms / 1e9:5.2f} TB/s", flush=True)
            del cache
            torch.cuda.empty_cache()
    fp8_new = {}
    for r in rows:
        if "us" in r and r["cache"] != "bfloat16" and r["variant"].startswith("new, "):
            fp8_new.setdefault(r["variant"], []).append(r)
    if fp8_new:
        best = min(fp8_new.values(), key=lambda rs: sum(r["us"] for r in rs))
        results["engine_decode_best"] = {"variant": best[0]["variant"], "env": best[0]["env"]}
        print(f"engine decode best fp8 new-token variant (sum over contexts): {best[0]['variant']} "
              f"(PODIUM_CUDA_TUNING={best[0]['env']})", flush=True)


GEMM_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
               "lm_head": (128256, 4096)}  # Llama-3.1-8B (N, K)


def bench_gemm(results: dict, quick: bool) -> None:
    """cuBLAS's default against PyTorch TunableOp's pick (torch.cuda.tunable) for the 8B linears at
    decode (256 rows) and prefill (8192 rows) batches, bf16, in CUDA graphs."""
    import torch.nn.functional as F
    from torch.cuda import tunable

    rows = results.setdefault("gemm", [])
    for m in (256,) if quick else (256, 8192):
        for name, (n, k) in GEMM_SHAPES.items():
            xs = [torch.randn(m, k, device=DEV, dtype=DTYPE) for _ in range(2)]
            ws = [torch.randn(n, k, device=DEV, dtype=DTYPE) / k**0.5 for _ in range(max(1, math.ceil(ROTATE_BYTES / (2 * n * k))))]
            calls = [functools.partial(F.linear, xs[i % 2], w) for i, w in enumerate(ws)] * max(1, 8 // len(ws))
            default = graph_ms(calls)
            tunable.enable(True)
            tunable.tuning_enable(True)
            tunable.set_max_tuning_duration(200)
            try:
                F.linear(xs[0], ws[0])
                torch.cuda.synchronize()
                tunable.tuning_enable(False)
                tuned = graph_ms(calls)
            finally:
                tunable.tuning_enable(False)
                tunable.enable(False)
            flops = 2 * m * n * k
            rows.append({"m": m, "gemm": name, "default_us": default * 1e3, "tunable_us": tuned * 1e3,
                         "default_TFLOPs": flops / default / 1e9, "tunable_TFLOPs": flops / tuned / 1e9})
            print(f"gemm m={m:<5} {name:8s} default {default * 1e3:8.1f} us ({flops / default / 1e9:5.0f} TF/s) "
                  f"tunable {tuned * 1e3:8.1f} us ({flops / tuned / 1e9:5.0f} TF/s)", flush=True)
            del xs, ws, calls
    results["tunable_results"] = [str(r) for r in tunable.get_results()]  # (op, shape, chosen kernel, ms) rows
    print("tunableop results:", json.dumps(results["tunable_results"])[:3000], flush=True)


MIXED_DECODES = (16, 64, 128, 240)  # decodes at the front of a mixed step, ~600 context each
MIXED_PROMPTS = (16, 512)  # then this many new prompts of this length


def bench_mixed(results: dict, quick: bool) -> None:
    """A 512/256 run's mixed step: decodes first, then 16 new 512-token prompts; one prefill launch
    for every row (``mixed_decode_min=0``) against the decode launch for the decodes."""
    from podium_cuda.attention import TritonAttentionBackend
    from podium_plugin_api import AttentionLayerSpec, AttentionMetadata

    rows = results.setdefault("mixed", [])
    layer = AttentionLayerSpec(HEADS, KV_HEADS, HEAD, HEAD**-0.5)
    gen = torch.Generator().manual_seed(0)
    for num_decodes in MIXED_DECODES[-1:] if quick else MIXED_DECODES:
        prompts, prompt_len = MIXED_PROMPTS
        query_lens = [1] * num_decodes + [prompt_len] * prompts
        seq_lens = [int(x) for x in torch.randint(520, 760, (num_decodes,), generator=gen)] + [prompt_len] * prompts
        widths = [-(-n // BLOCK) for n in seq_lens]
        perm = torch.randperm(sum(widths) + 1, generator=gen).tolist()
        tables, at = [], 0
        for w in widths:
            tables.append(perm[at:at + w])
            at += w
        meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, BLOCK, device=DEV)
        query = torch.randn(sum(query_lens), HEADS, HEAD, device=DEV, dtype=DTYPE)
        for cache_dtype in (DTYPE, torch.float8_e4m3fn):
            cache = torch.randn(2, sum(widths) + 1, BLOCK, KV_HEADS, HEAD, device=DEV, dtype=DTYPE).to(cache_dtype)
            row = {"decodes": num_decodes, "cache": str(cache_dtype).replace("torch.", "")}
            for label, min_decodes in (("one_launch_us", 0), ("split_us", 1)):
                backend = TritonAttentionBackend(replace(CUDA_TUNING, mixed_decode_min=min_decodes))
                step = backend.prepare_metadata(replace(meta, extras={}))
                row[label] = graph_ms([functools.partial(backend.attend, layer, query, cache, step)] * 4) * 1e3
            rows.append(row)
            print(f"mixed {num_decodes:>3} decodes + {prompts} x {prompt_len} prefill, {row['cache']:14s} one launch "
                  f"{row['one_launch_us']:7.1f} us, split {row['split_us']:7.1f} us", flush=True)
            del cache
        torch.cuda.empty_cache()


def causal_flops(num_seqs: int, ctx: int, q_len: int) -> float:
    pairs = q_len * ctx + q_len * (q_len + 1) / 2  # (query, key) pairs each query sees, per sequence
    return 4.0 * HEAD * HEADS * num_seqs * pairs


def bench_prefill(results: dict, quick: bool) -> None:
    """Prefill chunks over bf16 and fp8 caches (PREFILL_SHAPES) over PREFILL_VARIANTS; writes the
    fastest fp8 tiling of the first shape (the 8B 512/256 run's mixed steps) as PODIUM_CUDA_TUNING
    to ``best_prefill_env`` beside ``--out``."""
    rows = results.setdefault("prefill", [])
    for num_seqs, cached, q_len in PREFILL_SHAPES:
        flops = causal_flops(num_seqs, cached, q_len)
        for cache_dtype in (DTYPE, FP8):
            sets = PagedSets(num_seqs, cached + q_len, q_len, rotate=False, cache_dtype=cache_dtype)
            cache = "bf16" if cache_dtype == DTYPE else "fp8"
            for tiling in PREFILL_VARIANTS[: 1 if quick else None]:
                label = tag(tiling)
                try:
                    ms = graph_ms(sets.calls(replace(CUDA_TUNING, prefill=tiling, fp8_prefill=None), 1))
                except Exception as error:  # noqa: BLE001 (a tiling may not fit)
                    print(f"prefill {num_seqs}x{q_len} over {cached} {cache} {label}: {error!r}"[:300], flush=True)
                    continue
                rows.append({"seqs": num_seqs, "cached": cached, "q_len": q_len, "cache": cache, "tiling": label,
                             "env": f"prefill={_env_value(tiling)},fp8_prefill=none",
                             "us": ms * 1e3, "TFLOPs": flops / ms / 1e9})
                print(f"prefill {num_seqs}x{q_len} over {cached:<5} {cache:4s} {label} {ms * 1e3:8.1f} us "
                      f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
            del sets
            torch.cuda.empty_cache()
        if cached == 0:  # torch SDPA on the same dense causal problem, for scale
            q = torch.randn(num_seqs, HEADS, q_len, HEAD, device=DEV, dtype=DTYPE)
            k = torch.randn(num_seqs, KV_HEADS, q_len, HEAD, device=DEV, dtype=DTYPE)
            v = torch.randn_like(k)
            sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=True,
                                     enable_gqa=True)
            ms = graph_ms([sdpa] * 8)
            rows.append({"seqs": num_seqs, "cached": 0, "q_len": q_len, "tiling": "torch-sdpa", "us": ms * 1e3,
                         "TFLOPs": flops / ms / 1e9})
            print(f"prefill {num_seqs}x{q_len} torch SDPA (dense, no paging) {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s")
    first = PREFILL_SHAPES[0]
    fp8 = [r for r in rows if (r["seqs"], r["cached"], r["q_len"]) == first and r.get("cache") == "fp8"]
    if fp8:
        best = min(fp8, key=lambda r: r["us"])
        results["prefill_best"] = {"tiling": best["tiling"], "env": best["env"]}
        print(f"prefill best fp8 tiling at {first}: {best['tiling']} {best['us']:.1f} us", flush=True)


def op_inputs(name: str, tokens: int):
    """Arguments of one op at the Llama-3.1-8B shape (hidden 4096, intermediate 14336)."""
    if name in ("rms_norm", "fused_add_rms_norm"):
        x = torch.randn(tokens, 4096, device=DEV, dtype=DTYPE)
        w = torch.randn(4096, device=DEV, dtype=DTYPE)
        return (x, w, 1e-5) if name == "rms_norm" else (x, torch.randn_like(x), w, 1e-5)
    if name == "rotary_embedding":
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD, device=DEV, dtype=DTYPE)
        q = qkv[:, : HEADS * HEAD].view(tokens, HEADS, HEAD)
        k = qkv[:, HEADS * HEAD:(HEADS + KV_HEADS) * HEAD].view(tokens, KV_HEADS, HEAD)
        cache = torch.randn(8192, HEAD, device=DEV, dtype=DTYPE)
        return torch.randint(0, 8192, (tokens,), device=DEV), q, k, cache
    return (torch.randn(tokens, 2 * 14336, device=DEV, dtype=DTYPE),)


def bench_ops(results: dict, quick: bool) -> None:
    rows = results.setdefault("ops", [])
    for name, fused in FUSED_OPS.items():
        reference = reference_ops.REFERENCE_OPS[name]
        for tokens in OP_TOKENS:
            args = op_inputs(name, tokens)
            times = {}
            for label, fn in (("fused", fused), ("torch", reference)):
                call = functools.partial(fn, *args)
                times[f"{label}_graph_us"] = graph_ms([call] * 20) * 1e3
                times[f"{label}_eager_us"] = eager_ms(call) * 1e3
            rows.append({"op": name, "tokens": tokens, **times})
            print(f"op {name:<18} T={tokens:<5} graph fused {times['fused_graph_us']:7.1f} torch {times['torch_graph_us']:7.1f} us"
                  f" | eager fused {times['fused_eager_us']:7.1f} torch {times['torch_eager_us']:7.1f} us", flush=True)


def bench_kv_write(results: dict, quick: bool) -> None:
    from podium_cuda.attention import TritonAttentionBackend
    from podium_plugin_api import AttentionBackend

    for tokens in (256, 8192):
        cache = torch.randn(2, 20000, BLOCK, KV_HEADS, HEAD, device=DEV, dtype=DTYPE)
        k = torch.randn(tokens, KV_HEADS, HEAD, device=DEV, dtype=DTYPE)
        slots = torch.randperm(20000 * BLOCK, device=DEV)[:tokens]
        row = {"tokens": tokens}
        for label, backend in (("triton", TritonAttentionBackend()), ("torch", AttentionBackend())):
            row[f"{label}_eager_us"] = eager_ms(functools.partial(backend.write_kv, cache, k, k, slots)) * 1e3
        row["triton_graph_us"] = graph_ms([functools.partial(TritonAttentionBackend().write_kv, cache, k, k, slots)] * 20) * 1e3
        results.setdefault("kv_write", []).append(row)
        print(f"kv_write T={tokens:<5} {row}", flush=True)


def summarize(results: dict) -> None:
    """Short tables last (the device tool returns the end of the output)."""
    print("\n== summary", results["device"], "torch", results["torch"], "triton", results["triton"])
    print("ceilings", json.dumps(results.get("ceilings", {})))
    default_decode, default_prefill = tag(CUDA_TUNING.decode), tag(CUDA_TUNING.prefill)
    shapes = sorted({(r["batch"], r["ctx"]) for r in results.get("decode", [])})
    for batch, ctx in shapes:
        rows = [r for r in results["decode"] if (r["batch"], r["ctx"]) == (batch, ctx)]
        best = min(rows, key=lambda r: r["us"])
        dflt = next((r for r in rows if r["tiling"] == default_decode), best)
        print(f"decode b={batch:<3} ctx={ctx:<5} default {dflt['us']:8.1f} us {dflt['TBps']:5.2f} TB/s | "
              f"best {best['tiling']} {best['us']:8.1f} us {best['TBps']:5.2f} TB/s")
    for r in results.get("decode_splits", []):
        print(f"splits b={r['batch']} ctx={r['ctx']} ns={r['splits']:<2} {r['us']:7.1f} us {r['TBps']:5.2f} TB/s")
    keys = sorted({(r["seqs"], r["cached"], r["q_len"], r["cache"]) for r in results.get("prefill", []) if "cache" in r})
    for key in keys:
        rows = [r for r in results["prefill"] if (r["seqs"], r["cached"], r["q_len"]) == key[:3]]
        ours = [r for r in rows if r.get("cache") == key[3]]
        best = min(ours, key=lambda r: r["us"])
        dflt = next((r for r in ours if r["tiling"] == default_prefill), best)
        sdpa = " ".join(f"| sdpa {r['us']:.1f} us {r['TFLOPs']:.0f} TF/s" for r in rows if r["tiling"] == "torch-sdpa")
        print(f"prefill {key[0]}x{key[2]} over {key[1]} {key[3]}: default {dflt['us']:.1f} us {dflt['TFLOPs']:.0f} TF/s | "
              f"best {best['tiling']} {best['us']:.1f} us {best['TFLOPs']:.0f} TF/s {sdpa}")
    for r in results.get("ops", []):
        print(f"op {r['op']:<18} T={r['tokens']:<5} graph {r['fused_graph_us']:6.1f} vs {r['torch_graph_us']:6.1f} us"
              f" | eager {r['fused_eager_us']:6.1f} vs {r['torch_eager_us']:6.1f} us")
    for r in results.get("mixed", []):
        print(f"mixed {r['decodes']:>3} decodes + {MIXED_PROMPTS[0]} x {MIXED_PROMPTS[1]}, {r['cache']:14s} one launch {r['one_launch_us']:7.1f} us, "
              f"split {r['split_us']:7.1f} us")
    for r in results.get("engine_decode", []):
        if "us" in r:
            print(f"engine decode ctx~{r['ctx']} {r['variant']:28s} {r['us']:8.1f} us {r['TBps']:5.2f} TB/s")
    for r in results.get("gemm", []):
        print(f"gemm m={r['m']:<5} {r['gemm']:8s} default {r['default_us']:8.1f} us tunable {r['tunable_us']:8.1f} us")
    for r in results.get("host", []):
        print("host", json.dumps({k: round(v, 1) for k, v in r.items()}))
    for r in results.get("kv_write", []):
        print("kv_write", json.dumps({k: round(v, 1) for k, v in r.items()}))
    for e in results["errors"]:
        print("ERROR", e.splitlines()[-1])


def bench_host(results: dict, quick: bool) -> None:
    """Eager cost of one layer's decode attention call (host launch included), batch 1 and 64 at 512."""
    from podium_cuda.attention import TritonAttentionBackend
    from podium_plugin_api import AttentionLayerSpec, AttentionMetadata

    backend = TritonAttentionBackend()
    layer = AttentionLayerSpec(HEADS, KV_HEADS, HEAD, HEAD**-0.5)
    for batch in (1, 64):
        sets = PagedSets(batch, 512, 1, rotate=False)
        meta = AttentionMetadata(sets.qsl, sets.seq_lens, sets.tables[0], torch.zeros(batch, dtype=torch.int64, device=DEV),
                                 max_query_len=1, max_seq_len=512)
        q = sets.queries[0]
        k = torch.randn(batch, KV_HEADS, HEAD, device=DEV, dtype=DTYPE)
        cache = sets.cache.view(2, -1, BLOCK, KV_HEADS, HEAD)
        row = {"batch": batch, "ctx": 512,
               "attend_eager_us": eager_ms(functools.partial(backend.attend, layer, q, cache, meta)) * 1e3,
               "forward_eager_us": eager_ms(functools.partial(backend.forward, layer, q, k, k, cache, meta)) * 1e3,
               "forward_graph_us": graph_ms([functools.partial(backend.forward, layer, q, k, k, cache, meta)] * 20) * 1e3}
        results.setdefault("host", []).append(row)
        print("host", json.dumps({key: round(v, 1) for key, v in row.items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_kernels.json")
    parser.add_argument("--quick", action="store_true", help="default tilings only")
    parser.add_argument("--only", nargs="*", default=["ceilings", "decode", "prefill", "host", "ops", "kv_write"],
                        help="sections; also decode_sweep (tilings at the 8B runs' decode shapes), fp8 (fp8 caches' "
                             "convert modes and tilings against bf16), mixed (mixed-step attention, split or not), "
                             "engine_decode (the 8B engine's batch-256 decode launch and its options), gemm (cuBLAS "
                             "against TunableOp at the 8B linears)")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "errors": []}
    sections = {"ceilings": lambda r, q: r.update(ceilings=ceilings()), "decode": bench_decode,
                "decode_sweep": bench_decode_sweep, "fp8": bench_fp8, "mixed": bench_mixed, "prefill": bench_prefill,
                "host": bench_host, "ops": bench_ops, "kv_write": bench_kv_write, "engine_decode": bench_engine_decode,
                "gemm": bench_gemm}
    for name in args.only:
        start = time.time()
        try:
            sections[name](results, args.quick)
        except Exception:  # keep the other sections' numbers
            results["errors"].append(f"{name}: {traceback.format_exc()}")
            print(f"section {name} failed:\n{traceback.format_exc()}", flush=True)
        print(f"-- {name}: {time.time() - start:.1f} s", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if "prefill_best" in results:
        with open(os.path.join(os.path.dirname(os.path.abspath(args.out)), "best_prefill_env"), "w") as f:
            f.write(results["prefill_best"]["env"])
    if "engine_decode_best" in results:
        with open(os.path.join(os.path.dirname(os.path.abspath(args.out)), "best_engine_decode_env"), "w") as f:
            f.write(results["engine_decode_best"]["env"])
    summarize(results)


if __name__ == "__main__":
    main()
