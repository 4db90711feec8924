"""The one-row (batch-1 decode) variants of the quantized GEMVs on the device: checked, timed against the
current default in the same run, and the tuning they imply; ``bash benchmarks/quant_gpu.sh`` runs it:

    python benchmarks/quant_gpu_one_row.py [--device cuda|cpu] [--no-sweep]

check (PASS / FAIL, relative max error against float64 references, bf16 rows): every FP8 GEMV variant
(the default, packed, packed converting by integer instructions ("bits"), each with the row quantized
first, tensor cores) with each prologue at the qkv shape, the default and the packed ones at down's K
(14336: several slices) too; the AWQ GEMV in float32, packed and on the warp MMA (awq_mma_gemv.py), each
prologue.

time1: microseconds a call per 8B projection with the prologue the decoder gives it (qkv / gate_up:
add-RMSNorm, down: SiLU-and-mul, o: none): bf16's fused GEMV, then each FP8 variant with its ratio to
the FP8 default, each AWQ variant with its ratio to the AWQ default, and the default timed again last
(the spread of two timings of one kernel: differences below it are noise). TB/s: the weight's bytes
over the time. Each call is timed in a CUDA graph that cycles over copies of the weight, enough copies
(~192 MB, at most 20) that the 60 MB L2 does not hold them from one call of a copy to its next: as in a
decode step, where every layer reads other weights. "layer1" sums a variant over the four projections
(x32: the 8B's decode step in linears).

sweep (not with --no-sweep): the fastest FP8 variant at each global slice width
(``fp8_gemv_block_k``: fewer columns a program, more splits of K), then at the best of those with 2 and
8 programs a multiprocessor instead of 4 (``fp8_gemv_programs``), and the fastest AWQ variant at each
column block (``int4_gemv_block_n``) and split count (``int4_gemv_split_k``), summed over a layer.
The last line, "tuning: PODIUM_CUDA_TUNING=...", is the fastest setting found (a change from the
default only where it saves at least 2% of a layer). Where a warp-MMA GEMV wins (FP8 or AWQ), its own
settings are swept instead (warps, steps in flight, programs a multiprocessor); ``--mma-only-sweep``
sweeps both MMA GEMVs' settings whatever won. ``--device cpu``: the checks at small shapes
under TRITON_INTERPRET=1 (float32 rows).
"""

# ruff: noqa: B023  (the lambdas are timed where they are made, inside the loop)
from __future__ import annotations

import argparse
import itertools
import math

import quant_gpu_kernels as kernels
import torch
from quant_gpu_kernels import (
    PROLOGUE_OF,
    SHAPES,
    Projection,
    attempt,
    awq_weight,
    code,
    prologue_inputs,
    rel_error,
    separate,
    tuning,
    verdict,
)

from podium_plugin_api.fp8 import FP8, quantize_per_token
from podium_plugin_api.int4 import AWQ, dequantize, random_packed

ONE_ROW_FIELDS = ("fp8_gemv_dot", "fp8_gemv_packed", "fp8_gemv_bits", "fp8_gemv_quantize_first", "fp8_gemv_mma")
MMA_FIELDS = ("fp8_mma_warps", "fp8_mma_unroll", "fp8_mma_programs", "fp8_mma_prefetch", "fp8_mma_bulk_prefetch",
              "fp8_mma_maxnreg")
AWQ_MMA_FIELDS = ("int4_mma_warps", "int4_mma_programs", "int4_mma_groups", "int4_mma_prefetch", "int4_mma_maxnreg",
                  "int4_mma_ahead")


def _fp8(dot=False, packed=False, bits=False, first=False) -> dict:
    """A variant of the CUDA-core / tensor-core GEMV (the warp MMA, the default, off: it would take the call)."""
    return {"fp8_gemv_dot": dot, "fp8_gemv_packed": packed, "fp8_gemv_bits": bits, "fp8_gemv_quantize_first": first,
            "fp8_gemv_mma": False}


FP8_VARIANTS = {  # label -> KernelTuning changes; "fp8 default" is the tuning as committed
    "fp8 default": {},
    "fp8 cuda": _fp8(),
    "fp8 packed": _fp8(packed=True),
    "fp8 quantize-first": _fp8(first=True),
    "fp8 packed+first": _fp8(packed=True, first=True),
    "fp8 packed bits": _fp8(packed=True, bits=True),
    "fp8 packed bits+first": _fp8(packed=True, bits=True, first=True),
    "fp8 tensor": _fp8(dot=True),
    "fp8 mma": {"fp8_gemv_mma": True},
}
AWQ_VARIANTS = {"awq default": {}, "awq float32": {"int4_gemv_packed": False, "int4_gemv_mma": False},
                "awq packed": {"int4_gemv_packed": True, "int4_gemv_mma": False}, "awq mma": {"int4_gemv_mma": True}}
FP8_BLOCK_K = (0, 512, 1024, 2048, 4096)  # the sweep's global slice widths (0: fp8_gemv.config's rule)
FP8_PLAIN_BLOCK_K = (0, 256, 1024)
FP8_PROGRAMS = (0, 2, 8)  # ... and programs a multiprocessor (0: 4)
AWQ_BLOCK_N = (0, 128, 512)
AWQ_SPLITS = (0, 4, 8, 16)
ROTATION_BYTES = 192 << 20  # weight bytes a timing graph cycles over (> 3x the H200's L2)
MAX_COPIES = 20


def distinct(variants: dict[str, dict]) -> dict[str, dict]:
    """The variants whose tuning differs from every earlier one's (the default first): a variant that is
    the default under another name is timed once, as the default."""
    seen, kept = [], {}
    for label, changes in variants.items():
        t = tuning(**changes)
        if t not in seen:
            seen.append(t)
            kept[label] = changes
    return kept


def fp8_call(p_w8, p_s, x, prologue, residual, g, changes):
    from podium_cuda.fp8_gemv import fp8_gemv

    t = tuning(**changes)
    return lambda: fp8_gemv(x, p_w8, p_s, None, code(prologue), residual, g, 1e-5, t)[0]


def awq_call(qweight, qzeros, scales, x, prologue, residual, g, changes):
    from podium_cuda.int4_gemv import int4_gemv

    t = tuning(**changes)
    weight, fmt = awq_weight(qweight, t)
    return lambda: int4_gemv(x, weight, qzeros, scales, 128, fmt, None, code(prologue), residual, g, 1e-5, t)[0]


def check(device: str, wanted: set[str] | None = None) -> list[str]:
    """PASS / FAIL lines of every variant (or those ``wanted``) against the float64 references."""
    lines = []
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    bound = 5e-3 if device == "cpu" else 1e-2  # packed f16 sums: ~1e-3 of the max
    gen = torch.Generator().manual_seed(1)
    shapes = [(192, 512), (64, 1536)] if device == "cpu" else [(6144, 4096), (4096, 14336)]
    for index, (n, k) in enumerate(shapes):
        weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8).to(device)
        scale = (torch.rand(n, 1, generator=gen) / 1000 + 1e-4).to(device)
        for prologue in (None, "add_rms_norm", "silu_and_mul") if index == 0 else (None, "silu_and_mul"):
            x, residual, g = prologue_inputs(prologue, 1, k, dtype, device, gen)
            q, s = quantize_per_token(separate(prologue, x, residual, g))
            want = (q.double() @ weight.double().t()) * s.double() * scale.double().t()
            for label, changes in distinct(FP8_VARIANTS).items():
                if (index and "packed" not in label and label not in ("fp8 default", "fp8 mma")) or \
                        (wanted and label not in wanted):
                    continue
                err = rel_error(fp8_call(weight, scale, x, prologue, residual, g, changes)(), want)
                lines.append(verdict(f"{label} {prologue or 'plain'} {n} x {k}", err, bound))
    n, k = shapes[0]
    packed = random_packed(AWQ, k, n, 128, False, gen)
    w = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], None, 128, AWQ).double()
    on = [packed[t].to(device) for t in ("qweight", "qzeros", "scales")]
    for prologue in (None, "add_rms_norm", "silu_and_mul"):
        x, residual, g = prologue_inputs(prologue, 1, k, dtype, device, gen)
        want = separate(prologue, x, residual, g).double().cpu() @ w
        for label, changes in distinct(AWQ_VARIANTS).items():
            if wanted and label not in wanted:
                continue
            err = rel_error(awq_call(*on, x, prologue, residual, g, changes)(), want)
            lines.append(verdict(f"{label} {prologue or 'plain'} {n} x {k}", err, bound))
    return lines


class Copies:
    """A projection's weights in each format, with enough distinct copies of each for ROTATION_BYTES."""

    def __init__(self, p: Projection) -> None:
        self.p = p
        self.bytes = {"bf16": 2 * p.n * p.k, "fp8": p.n * p.k,
                      "awq": sum(t.numel() * t.element_size() for t in p.awq)}
        self.linears = [p.linear] + [self._linear() for _ in range(self.count("bf16") - 1)]
        self.fp8 = [(p.w8, p.s_w)] + [(p.w8.clone(), p.s_w.clone()) for _ in range(self.count("fp8") - 1)]
        self.awq = [p.awq] + [tuple(t.clone() for t in p.awq) for _ in range(self.count("awq") - 1)]

    def count(self, fmt: str) -> int:
        return max(1, min(MAX_COPIES, math.ceil(ROTATION_BYTES / self.bytes[fmt])))

    def _linear(self) -> torch.nn.Linear:
        p = self.p
        linear = torch.nn.Linear(p.k, p.n, bias=False, device=p.w.device, dtype=p.w.dtype).requires_grad_(False)
        linear.weight.copy_(p.w)
        return linear

    def tb_per_s(self, fmt: str, us: float | None) -> str:
        return "" if not us else f", {self.bytes[fmt] / us / 1e6:.2f} TB/s"


def rotated(calls: list) -> float | None:
    """Microseconds a call, the graph cycling over ``calls`` (one per weight copy), or None if it fails."""
    cycle = itertools.cycle(calls)
    per_graph = len(calls) * max(1, math.ceil(20 / len(calls)))
    return attempt(lambda: next(cycle)(), calls=per_graph)


def bf16_call(linear, x, prologue, residual, g):
    from podium_cuda import gemv

    if prologue == "silu_and_mul":
        return lambda: gemv.silu_and_mul_linear(x, linear)
    if prologue == "add_rms_norm":
        return lambda: gemv.rms_norm_linear(x, residual, g, 1e-5, linear)[0]
    return lambda: gemv.gemv(x, linear)


def inputs(p: Projection, prologue):
    return prologue_inputs(prologue, 1, p.k, kernels.DTYPE, kernels.DEVICE, torch.Generator().manual_seed(p.n))


def time_fp8(c: Copies, prologue, changes) -> float | None:
    x, residual, g = inputs(c.p, prologue)
    return rotated([fp8_call(w8, s_w, x, prologue, residual, g, changes) for w8, s_w in c.fp8])


def time_awq(c: Copies, prologue, changes) -> float | None:
    x, residual, g = inputs(c.p, prologue)
    return rotated([awq_call(*awq, x, prologue, residual, g, changes) for awq in c.awq])


def timings(c: Copies, prologue, fp8: dict, awq: dict) -> dict[str, float | None]:
    x, residual, g = inputs(c.p, prologue)
    t = {"bf16 gemv": rotated([bf16_call(linear, x, prologue, residual, g) for linear in c.linears])}
    for label, changes in fp8.items():
        t[label] = time_fp8(c, prologue, changes)
    for label, changes in awq.items():
        t[label] = time_awq(c, prologue, changes)
    t["fp8 default again"] = time_fp8(c, prologue, {})
    t["awq default again"] = time_awq(c, prologue, {})
    return t


def ratio(us: float | None, base: float | None) -> str:
    return f" (x{us / base:.2f})" if us and base else ""


def time_line(name: str, c: Copies, t: dict) -> str:
    parts = []
    for label, us in t.items():
        fmt = "bf16" if label.startswith("bf16") else label.split()[0]
        base = t.get(f"{fmt} default") if fmt != "bf16" else None
        parts.append(f"{label} {'failed' if us is None else f'{us:.1f} us'}{ratio(us, base)}{c.tb_per_s(fmt, us)}")
    copies = ", ".join(f"{fmt} x{c.count(fmt)}" for fmt in ("bf16", "fp8", "awq"))
    return (f"time1 {name + ('+' if PROLOGUE_OF[name] else ''):8s} N={c.p.n:5d} K={c.p.k:5d} (copies {copies}): "
            + "; ".join(parts))


def layer_totals(per_shape: dict[str, dict]) -> dict[str, float | None]:
    labels = next(iter(per_shape.values())).keys()
    totals = {}
    for label in labels:
        parts = [t[label] for t in per_shape.values()]
        totals[label] = None if None in parts else sum(parts)
    return totals


def layer_line(what: str, totals: dict, bytes_: dict[str, int]) -> str:
    parts = []
    for label, us in totals.items():
        fmt = "bf16" if label.startswith("bf16") else label.split()[0]
        base = totals.get(f"{fmt} default") if fmt != "bf16" else None
        rate = f", {bytes_[fmt] / us / 1e6:.2f} TB/s" if us else ""
        parts.append(f"{label} {'failed' if us is None else f'{us:.1f} us (x32 {us * 32 / 1000:.2f} ms)'}"
                     f"{ratio(us, base)}{rate}")
    return f"{what} " + "; ".join(parts)


def fastest(totals: dict[str, float | None], labels, default: str) -> str:
    """The label of the smallest total among ``labels``; the default unless another saves >= 2% of it."""
    timed = {label: totals[label] for label in labels if totals.get(label) is not None}
    if not timed:
        return default
    best = min(timed, key=timed.get)
    if timed.get(default) is not None and timed[best] > 0.98 * timed[default]:
        return default
    return best


def layer_sum(copies: dict[str, Copies], time_one) -> float | None:
    """A layer's four projections (each with its prologue) timed by ``time_one(copies, prologue)``, summed."""
    parts = [time_one(c, PROLOGUE_OF[name]) for name, c in copies.items()]
    return None if None in parts else sum(parts)


def shown(results: dict) -> str:
    return "; ".join(f"{k} {'failed' if v is None else f'{v:.1f} us'}" for k, v in results.items())


def sweep(copies: dict[str, Copies], fp8_changes: dict, awq_changes: dict) -> tuple[dict, dict]:
    """The chosen variants' tiles over a layer, each sweep's line printed as it ends: (FP8 changes, AWQ
    changes) with the fastest tiles."""
    fp8 = {}
    # the plain / tensor-core steps hold [16 or 128, BLOCK_K] tiles: wide slices only for the packed steps
    for block_k in FP8_BLOCK_K if tuning(**fp8_changes).fp8_gemv_packed else FP8_PLAIN_BLOCK_K:
        changes = dict(fp8_changes, fp8_gemv_block_k=block_k)
        fp8[block_k] = layer_sum(copies, lambda c, prologue: time_fp8(c, prologue, changes))
    best_k = int(fastest({str(k): v for k, v in fp8.items()}, [str(k) for k in fp8], "0"))
    print(f"sweep fp8 layer by fp8_gemv_block_k (0: the rule), {fp8_changes or 'default'}: {shown(fp8)} -> {best_k}",
          flush=True)
    programs = {0: fp8[best_k]}
    for count in FP8_PROGRAMS[1:]:
        changes = dict(fp8_changes, fp8_gemv_block_k=best_k, fp8_gemv_programs=count)
        programs[count] = layer_sum(copies, lambda c, prologue: time_fp8(c, prologue, changes))
    best_p = int(fastest({str(n): v for n, v in programs.items()}, [str(n) for n in programs], "0"))
    print(f"sweep fp8 layer by fp8_gemv_programs (0: 4 a multiprocessor) at block_k {best_k}: {shown(programs)} "
          f"-> {best_p}", flush=True)
    awq = {}
    for block_n in AWQ_BLOCK_N:
        changes = dict(awq_changes, int4_gemv_block_n=block_n)
        awq[block_n, 0] = layer_sum(copies, lambda c, prologue: time_awq(c, prologue, changes))
    best_n = int(fastest({str(n): awq[n, 0] for n in AWQ_BLOCK_N}, [str(n) for n in AWQ_BLOCK_N], "0"))
    for splits in AWQ_SPLITS[1:]:
        changes = dict(awq_changes, int4_gemv_block_n=best_n, int4_gemv_split_k=splits)
        awq[best_n, splits] = layer_sum(copies, lambda c, prologue: time_awq(c, prologue, changes))
    keyed = {f"{n}/{s}": v for (n, s), v in awq.items()}
    best_ns = fastest(keyed, list(keyed), f"{best_n}/0")
    best_n, best_s = map(int, best_ns.split("/"))
    print(f"sweep awq layer by int4_gemv_block_n/int4_gemv_split_k (0: the rule), {awq_changes or 'default'}: "
          f"{shown(keyed)} -> {best_n}/{best_s}", flush=True)
    return (dict(fp8_changes, fp8_gemv_block_k=best_k, fp8_gemv_programs=best_p),
            dict(awq_changes, int4_gemv_block_n=best_n, int4_gemv_split_k=best_s))


# the warp-MMA GEMVs' settings a sweep times, the current default first
MMA_SETTINGS = [dict(zip(MMA_FIELDS, values)) for values in
                [(4, 4, 0, False, False, 0), (4, 4, 0, False, True, 0), (4, 2, 0, False, True, 0),
                 (4, 1, 0, False, True, 0), (8, 2, 0, False, True, 0), (4, 2, 0, False, False, 0),
                 (4, 4, 0, True, False, 0)]]
AWQ_MMA_SETTINGS = [dict(zip(AWQ_MMA_FIELDS, values)) for values in
                    [(8, 0, 1, False, 0, True), (8, 0, 1, True, 0, True), (8, 0, 1, False, 0, False),
                     (8, 0, 1, True, 64, False), (4, 0, 1, True, 0, False), (4, 0, 1, False, 0, False),
                     (2, 0, 1, True, 0, False)]]


def sweep_settings(what: str, copies: dict[str, Copies], base: dict, settings: list[dict], time_one) -> dict:
    """``settings`` (each a dict of tuning changes on top of ``base``) over a layer, each per-shape and summed
    (``time_one(copies, prologue, changes)``), a line each: the fastest as changes (the first's unless 2%
    faster)."""
    totals = {}
    for index, changes in enumerate(settings):
        merged = dict(base, **changes)
        parts = {name: time_one(c, PROLOGUE_OF[name], merged) for name, c in copies.items()}
        total = None if None in parts.values() else sum(parts.values())
        totals[str(index)] = total
        shown_parts = ", ".join(f"{name} {'failed' if v is None else f'{v:.1f}'}" for name, v in parts.items())
        print(f"sweep {what} {changes}: layer {'failed' if total is None else f'{total:.1f} us'} ({shown_parts})",
              flush=True)
    return dict(base, **settings[int(fastest(totals, list(totals), "0"))])


def sweep_mma(copies: dict[str, Copies], fp8_changes: dict) -> dict:
    """The FP8 warp-MMA GEMV's warps / unroll / programs / prefetch over a layer."""
    return sweep_settings("mma", copies, dict(fp8_changes, fp8_gemv_mma=True), MMA_SETTINGS, time_fp8)


def sweep_awq_mma(copies: dict[str, Copies], awq_changes: dict) -> dict:
    """The AWQ warp-MMA GEMV's warps / programs a multiprocessor / groups a warp loads at once over a layer."""
    return sweep_settings("awq mma", copies, dict(awq_changes, int4_gemv_mma=True), AWQ_MMA_SETTINGS, time_awq)


def setting(changes: dict) -> str:
    """PODIUM_CUDA_TUNING's text for the one-row fields (every one, so the line says the whole choice)."""
    t = tuning(**changes)
    fields = ONE_ROW_FIELDS + ("fp8_gemv_block_k", "fp8_gemv_programs", "int4_gemv_packed", "int4_gemv_block_n",
                               "int4_gemv_split_k", "int4_gemv_mma") + (MMA_FIELDS if t.fp8_gemv_mma else ()) \
        + (AWQ_MMA_FIELDS if t.int4_gemv_mma else ())
    return ",".join(f"{name}={int(getattr(t, name))}" for name in fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--variants", default="",
                        help="comma-separated labels to time (e.g. 'fp8 default,fp8 mma,awq default'); all by default")
    parser.add_argument("--mma-only-sweep", action="store_true",
                        help="sweep only the warp-MMA GEMV's settings (not the other variants' tiles)")
    parser.add_argument("--mma-sweeps", default="fp8,awq", help="with --mma-only-sweep: which MMA GEMVs' settings")
    args = parser.parse_args()
    wanted = {label.strip() for label in args.variants.split(",")} | {"fp8 default", "awq default"} \
        if args.variants else None
    for text in check(args.device, wanted):
        print(text, flush=True)
    if args.device != "cuda":
        return
    fp8, awq = distinct(FP8_VARIANTS), distinct(AWQ_VARIANTS)
    if wanted:
        fp8 = {label: changes for label, changes in fp8.items() if label in wanted}
        awq = {label: changes for label, changes in awq.items() if label in wanted}
    default = tuning()
    print("default: " + setting({}) + f" (fp8_gemv_max_rows={default.fp8_gemv_max_rows}, "
          f"int4_gemv_max_rows={default.int4_gemv_max_rows}); variants timed: {', '.join([*fp8, *awq])}", flush=True)
    copies = {name: Copies(Projection(n, k)) for name, (n, k) in SHAPES.items()}
    per_shape = {}
    for name, c in copies.items():
        per_shape[name] = timings(c, PROLOGUE_OF[name], fp8, awq)
        print(time_line(name, c, per_shape[name]), flush=True)
    totals = layer_totals(per_shape)
    layer_bytes = {fmt: sum(c.bytes[fmt] for c in copies.values()) for fmt in ("bf16", "fp8", "awq")}
    print(layer_line("layer1", totals, layer_bytes), flush=True)
    best_fp8 = fastest(totals, fp8, "fp8 default")
    best_awq = fastest(totals, awq, "awq default")
    print(f"one-row rule: FP8 {best_fp8} ({totals.get(best_fp8) or 0:.1f} us a layer's linears against the "
          f"default's {totals.get('fp8 default') or 0:.1f}), AWQ {best_awq} ({totals.get(best_awq) or 0:.1f} against "
          f"{totals.get('awq default') or 0:.1f}); bf16 GEMV {totals.get('bf16 gemv') or 0:.1f} us", flush=True)
    fp8_changes, awq_changes = fp8[best_fp8], awq[best_awq]
    # the variants' choice now, in case the sweep does not finish; quant_gpu.sh takes the last tuning line
    print(f"tuning: PODIUM_CUDA_TUNING={setting(fp8_changes | awq_changes)}", flush=True)
    if args.mma_only_sweep:
        sweeps = {name.strip() for name in args.mma_sweeps.split(",")}
        mma = sweep_mma(copies, {}) if "fp8" in sweeps else dict(fp8_gemv_mma=True)
        awq_mma = sweep_awq_mma(copies, {}) if "awq" in sweeps else dict(int4_gemv_mma=True)
        print(f"mma: PODIUM_CUDA_TUNING={setting(mma | awq_mma)}", flush=True)
        if tuning(**fp8_changes).fp8_gemv_mma:
            fp8_changes = mma
        if tuning(**awq_changes).int4_gemv_mma:
            awq_changes = awq_mma
    elif not args.no_sweep:
        if tuning(**fp8_changes).fp8_gemv_mma or tuning(**awq_changes).int4_gemv_mma:
            fp8_changes = sweep_mma(copies, fp8_changes) if tuning(**fp8_changes).fp8_gemv_mma else fp8_changes
            awq_changes = sweep_awq_mma(copies, awq_changes) if tuning(**awq_changes).int4_gemv_mma else awq_changes
        else:
            fp8_changes, awq_changes = sweep(copies, fp8_changes, awq_changes)
    print(f"tuning: PODIUM_CUDA_TUNING={setting(fp8_changes | awq_changes)}", flush=True)


if __name__ == "__main__":
    main()
