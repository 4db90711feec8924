"""Which kernel multiplies a CPU linear layer, and why: one rule per dtype, stated here, applied at
load (``linear_packing.pack_linear_layers``), reported by ``podium platforms --verbose`` and asked by
the tests (``CpuPlatform.linear_kernel``).

    bfloat16  AMX tiles (amx_linear.c) up to AMX_MAX_ROWS rows, oneDNN above; else AVX512-BF16
              dot products (dpbf16_linear.c) for every batch; else oneDNN's packed matmul where it
              has a bf16 matmul; else the FMA units with bf16 weights widened in registers
              (fma_linear.c), for every batch (AVX2 without AVX-512, where oneDNN has none)
    float32   the FMA units (fma_linear.c: AVX-512 or AVX2) for every batch, except on a CPU with AMX
              (Sapphire Rapids and later): up to F32_MAX_ROWS rows, oneDNN above; else oneDNN packed
    other     F.linear

Kernels:  ``amx``, ``avx512-bf16``, ``fma`` (native: a decode step whose every op is native replays
as a CPU graph, graphs.py), ``onednn`` (a torch op: such a step runs eagerly), ``torch``.

The rule is fixed from measurements, not measured at startup: a startup micro-benchmark would cost
part of the 3 s startup, and on a busy machine its noisy timings could pick another kernel from
run to run, so a model's output bits and whether its decode steps are captured would change with
the load. The measurements (``benchmarks/cpu_kernels.py --only linear`` prints each kernel's time
against oneDNN's packed matmul at SmolLM2's shapes and 1-512 rows):

- AMX (Sapphire Rapids): ~20 us less fixed cost per call than oneDNN's packed path at decode
  sizes, so AMX up to 256 rows. Above, oneDNN: the AMX kernel takes any batch, but in one thread's
  CPU time it ran 1.0-1.4x oneDNN's time at 256 rows, 1.2-1.4x at 512, 1.4-1.8x at 2048 across the
  four layer shapes (its 2x2 tile blocking reloads x's tiles from L2 for every 32 outputs). oneDNN
  multiplies the plain weight unpacked from the tiles for the call (``unpacked_linear``: ~0.13 ms
  for SmolLM2's largest layer against ~2.4 ms for its 2,048-row matmul; a 4 x 512-token prefill
  measured alike with and without it), so the model holds one copy of its weights; the platform
  option ``amx_plain_weights`` keeps the plain copy resident instead (256 MiB more for SmolLM2-135M).
- float32 FMA on the AMX Xeon (two threads, a quiet machine): 0.94-1.06x oneDNN's packed matmul's
  time at 32 rows, 1.21-1.42x at 128, 1.11-1.33x at 256-2048 across the five shapes (the prefill
  of 32 x 48 tokens: 1.43 s against 1.23 s on oneDNN). So oneDNN above F32_MAX_ROWS there, on the
  weight unpacked from the panels for the call (``unpacked_linear``); the steps above it are never
  captured anyway. Unmeasured elsewhere, so every batch stays on the FMA kernel on other CPUs.
- AVX512-BF16 and float32 FMA (AMD Zen 4, one thread, CPU time on a loaded machine): 1.5-2.3x
  oneDNN's speed at 1 row, 0.9-1.15x its time at 32-512 rows across the five shapes. Equal within
  the noise where not faster, and then the graphs decide: a step of native calls replays without
  the model's Python, ~140 us a layer. So every batch, with no second packed copy of the weights.
- bf16 FMA (AMD Zen 3, no oneDNN bf16 matmul): torch's bf16 F.linear ran ~5x slower than float32.
  There the FMA kernels reach 150-187 GF/s on two cores at 32-512 rows, bf16 and float32, against
  oneDNN's float32 packed matmul at 112-172: 0.68-0.95x its time (the LM head at 512 rows 1.05x).

Nothing here depends on a layer's shape: every shape measured alike. ``choose`` takes the shape
anyway, so a rule that does needs no new callers, and names it in its answer.

The platform option ``linears`` (``forced_rules``) replaces the rule of every dtype a named kernel
computes: to measure one kernel against another in whole runs, or to run this CPU as a kind without
AMX (``avx512-bf16``) as far as the linears go.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .linear_packing import NativeKernel, amx_tiles, f32_panels, fma_panels
from .native_kernels import NativeKernels
from .onednn_linear import packing_unavailable

AMX_MAX_ROWS = 256  # AMX's kernel up to this many rows, oneDNN above (measured alike at 256-512)
# float32 on the FMA kernel up to this many rows where measured slower above (the AMX Xeon), oneDNN
# above: the largest decode step captured as a CPU graph (graphs.MAX_GRAPH_BATCH), so every captured
# step stays native
F32_MAX_ROWS = 64
NATIVE = ("amx", "avx512-bf16", "fma")
LINEAR_CHOICES = ("auto", *NATIVE, "onednn")  # the platform option ``linears``


@dataclass(frozen=True)
class LinearChoice:
    """The kernel one linear call runs on, and why."""

    kernel: str  # "amx", "avx512-bf16", "fma", "onednn" or "torch"
    reason: str

    @property
    def native(self) -> bool:
        """A native kernel: a decode step made only of native calls is captured as a CPU graph."""
        return self.kernel in NATIVE


@dataclass(frozen=True)
class LinearRule:
    """How one dtype's linears run: ``native`` up to its ``max_rows`` (if any), ``kernel`` otherwise."""

    kernel: str  # what runs without the native kernel (or above its rows): "onednn" or "torch"
    reason: str
    native: NativeKernel | None = None

    def summary(self) -> str:
        if self.native is None:
            return f"{self.kernel}: {self.reason}"
        if self.native.max_rows is None:
            return f"{self.native.name} for every batch: {self.reason}"
        above = f"{self.kernel} above" + (" (on the weight unpacked for the call)" if self.native.unpack else "")
        return f"{self.native.name} up to {self.native.max_rows} rows, {above}: {self.reason}"


def linear_rules(kernels: NativeKernels | None, why_not: str = "") -> dict[torch.dtype, LinearRule]:
    """The rule of each dtype the platform runs, given the loaded kernels (None: ``why_not``)."""
    return {torch.bfloat16: _bf16_rule(kernels, why_not), torch.float32: _f32_rule(kernels, why_not),
            torch.float16: LinearRule("torch", "no native or oneDNN float16 linear on the CPU platform")}


def choose(rules: dict[torch.dtype, LinearRule], dtype: torch.dtype, out_features: int, in_features: int,
           rows: int) -> LinearChoice:
    """The kernel a [rows, in_features] x [out_features, in_features]^T linear of ``dtype`` runs on."""
    if min(out_features, in_features, rows) < 1:
        raise ValueError(f"a linear needs positive sizes, got {rows} rows of {in_features} -> {out_features}")
    shape = f"{str(dtype).removeprefix('torch.')} {in_features} -> {out_features} at {rows} rows"
    rule = rules.get(dtype)
    if rule is None:
        return LinearChoice("torch", f"{shape}: no CPU linear kernel for this dtype")
    if rule.native is not None and rule.native.takes(rows):
        return LinearChoice(rule.native.name, f"{shape}: {rule.reason}")
    if rule.native is not None:
        return LinearChoice(rule.kernel, f"{shape}: above the {rule.native.name} kernel's {rule.native.max_rows} "
                                         f"rows, where {rule.kernel} measured alike")
    return LinearChoice(rule.kernel, f"{shape}: {rule.reason}")


# kernel name -> (NativeKernels attribute prefix, {dtype: layout})
_KERNELS = {
    "amx": ("amx", {torch.bfloat16: amx_tiles}),
    "avx512-bf16": ("dpbf16", {torch.bfloat16: amx_tiles}),
    "fma": ("fma", {torch.bfloat16: fma_panels, torch.float32: f32_panels}),
}


def _native(kernels: NativeKernels, name: str, dtype: torch.dtype) -> NativeKernel:
    prefix, layouts = _KERNELS[name]
    tiles = layouts[dtype] is amx_tiles
    pack = kernels.amx_pack if tiles else kernels.fma_pack
    rows = kernels.tile_rows if tiles else kernels.panel_rows
    max_rows = AMX_MAX_ROWS if name == "amx" else \
        F32_MAX_ROWS if name == "fma" and dtype == torch.float32 and kernels.amx_linear else None
    unpack = (kernels.tile_unpack if tiles else kernels.panel_unpack).get(dtype) if max_rows else None
    return NativeKernel(name, dtype, getattr(kernels, f"{prefix}_linear")[dtype],
                        getattr(kernels, f"{prefix}_fused_linear")[dtype], pack.get(dtype), layouts[dtype],
                        max_rows, rows.get(dtype), unpack)


def runnable_native_kernels(kernels: NativeKernels) -> list[NativeKernel]:
    """Every (native kernel, dtype) this build and CPU can run, chosen by the rules or not (the tests
    check each one)."""
    return [_native(kernels, name, dtype) for name, (prefix, layouts) in _KERNELS.items() for dtype in layouts
            if dtype in getattr(kernels, f"{prefix}_linear")]


def forced_rules(rules: dict[torch.dtype, LinearRule], forced: str, kernels: NativeKernels | None,
                 why_not: str = "") -> dict[torch.dtype, LinearRule]:
    """``rules`` with the kernel ``forced`` (one of ``LINEAR_CHOICES``) for every dtype it computes
    here: ``amx`` and ``avx512-bf16`` bf16, ``fma`` bf16 and float32, ``onednn`` both where it packs;
    the other dtypes keep their rule. ``auto``: ``rules`` as they are. ValueError when the kernel
    computes no dtype on this CPU (a forced choice is never silently another kernel)."""
    if forced == "auto":
        return rules
    if forced not in LINEAR_CHOICES:
        raise ValueError(f"unknown linear kernel {forced!r}; choose one of {', '.join(LINEAR_CHOICES)}")
    reason = f"forced by the linears option ({forced})"
    changed = {}
    for dtype in (torch.bfloat16, torch.float32):
        fallback = "onednn" if not packing_unavailable(dtype) else "torch"
        if forced == "onednn":
            if fallback == "onednn":
                changed[dtype] = LinearRule("onednn", f"{reason}; decode steps are not captured")
            continue
        prefix, layouts = _KERNELS[forced]
        if kernels is not None and dtype in layouts and dtype in getattr(kernels, f"{prefix}_linear"):
            changed[dtype] = LinearRule(fallback, reason, _native(kernels, forced, dtype))
    if not changed:
        why = why_not or ("oneDNN cannot pack a matmul in this torch build" if forced == "onednn"
                          else "this CPU or build lacks its instructions")
        raise ValueError(f"the cpu platform's linears option is {forced}, which runs no dtype here ({why}); "
                         f"choose auto or one of {', '.join(c for c in LINEAR_CHOICES if c not in ('auto', forced))}")
    return {**rules, **changed}


def _bf16_rule(kernels: NativeKernels | None, why_not: str) -> LinearRule:
    bf16 = torch.bfloat16
    onednn_why = packing_unavailable(bf16)
    if kernels is not None and bf16 in kernels.amx_linear:
        return LinearRule("onednn", "AMX tiles (amx_linear.c): less fixed cost per call than oneDNN's at decode sizes",
                          _native(kernels, "amx", bf16))
    if kernels is not None and bf16 in kernels.dpbf16_linear:
        return LinearRule("onednn", "AVX512-BF16 dot products (dpbf16_linear.c): as fast as oneDNN's packed "
                          "matmul or faster, and captured in CPU graphs", _native(kernels, "avx512-bf16", bf16))
    if not onednn_why:
        no_native = why_not or "this CPU has neither AMX nor AVX512-BF16"
        return LinearRule("onednn", f"oneDNN's packed bf16 matmul ({no_native}; decode steps are not captured)")
    if kernels is not None and bf16 in kernels.fma_linear:
        return LinearRule("torch", f"FMA units with bf16 weights widened in registers (fma_linear.c): {onednn_why}",
                          _native(kernels, "fma", bf16))
    return LinearRule("torch", "; ".join(x for x in (why_not or "no AVX2 + FMA in the native build", onednn_why) if x))


def _f32_rule(kernels: NativeKernels | None, why_not: str) -> LinearRule:
    f32 = torch.float32
    onednn_why = packing_unavailable(f32)
    fallback = "onednn" if not onednn_why else "torch"
    if kernels is not None and f32 in kernels.fma_linear:
        return LinearRule(fallback, "FMA units (fma_linear.c): as fast as oneDNN's packed matmul or faster, and "
                                    "captured in CPU graphs", _native(kernels, "fma", f32))
    no_native = why_not or "no AVX2 + FMA in the native build"
    if fallback == "onednn":
        return LinearRule("onednn", f"oneDNN's packed float32 matmul ({no_native}; decode steps are not captured)")
    return LinearRule("torch", f"{no_native}; {onednn_why}")


# the batch-invariant mode's native kernel per dtype, in order of preference: each sums an output
# element's K products in one order whatever the number of rows (amx_linear.c, dpbf16_linear.c and
# fma_linear.c walk K the same way for every row block), so it runs for every batch; oneDNN and
# F.linear pick their blocking from M and are never used in the mode
_INVARIANT = {torch.bfloat16: ("amx", "avx512-bf16", "fma"), torch.float32: ("fma",)}


def batch_invariant_rules(kernels: NativeKernels | None, why_not: str = "",
                          forced: str = "auto") -> dict[torch.dtype, LinearRule]:
    """The batch-invariant mode's rule of each dtype that has a native kernel here (a dtype missing
    from the answer cannot run in the mode). ``forced``: the linears option; a native kernel named
    there comes first for the dtypes it computes, oneDNN is refused (its blocking follows M)."""
    if forced == "onednn":
        raise ValueError("the cpu platform's batch-invariant mode runs native linears only; the linears option "
                         "onednn cannot be used with it")
    if kernels is None:
        return {}
    rules = {}
    for dtype, names in _INVARIANT.items():
        names = ((forced,) if forced in names else ()) + names
        for name in names:
            prefix, _ = _KERNELS[name]
            if dtype in getattr(kernels, f"{prefix}_linear"):
                native = replace(_native(kernels, name, dtype), max_rows=None)
                rules[dtype] = LinearRule("none", "batch-invariant mode: one native kernel and one reduction "
                                                  "order for every batch", native)
                break
    return rules
