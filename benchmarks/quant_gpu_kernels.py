"""Quantized linear kernels on the device against their references, then timed at Llama-3.1-8B's shapes:

    python benchmarks/quant_gpu_kernels.py [--device cuda|cpu] [--rows 1 4 16 256 4096] [--no-sweep]

check (PASS / FAIL lines, relative max error against float64 references on random data, bf16 rows):
the one-launch FP8 quantization with each prologue (bytes equal to the contract's quantize_per_token
after the separate kernel: "differing bytes 0"), the FP8 GEMV (tensor-core steps at 1 / 4 / 16 rows with and
without a prologue, CUDA-core steps at one row and plain), _scaled_mm after the new quantization, the INT4 GEMVs
(AWQ one row, AWQ and GPTQ 4 rows) with prologues, the old INT4 kernels.
time: microseconds per call (CUDA events over a CUDA graph of 20 calls, as the engine replays a step;
median of 7) per 8B projection and row count, each with its ratio to bf16 cuBLAS: bf16 cuBLAS,
bf16 GEMV (1 row), FP8 old (contract quantization + _scaled_mm), FP8 new quantization + _scaled_mm,
_scaled_mm alone (rows quantized beforehand), FP8 GEMV on tensor / CUDA cores (<= 16 rows), INT4 old
(int4.py's GEMV / GEMM), INT4 new GEMV (<= 16 rows). Then the same with the projection's prologue
(qkv, gate_up: add-RMSNorm; down: SiLU-and-mul): what the decoder runs. The rules the plain
timings imply come right after them, as KernelTuning values and one ``PODIUM_CUDA_TUNING=...``
line ("tuning: ..."); last a sweep of the new GEMVs' tiles at one row. ``--device cpu`` is a dry run of the checks at
small shapes (under TRITON_INTERPRET=1, float32 rows).
"""

# ruff: noqa: B023  (the lambdas are timed where they are made, inside the loop)
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import torch.nn.functional as F

from podium_plugin_api.fp8 import FP8, quantize_per_token
from podium_plugin_api.int4 import AWQ, AWQ_MMA, GPTQ, awq_to_mma, dequantize, quantize_awq, random_packed

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
PROLOGUE_OF = {"qkv": "add_rms_norm", "o": None, "gate_up": "add_rms_norm", "down": "silu_and_mul"}
FUSED_SHAPES = [name for name, prologue in PROLOGUE_OF.items() if prologue]
GEMV_ROWS = 16  # the GEMVs' largest row count (fp8_gemv.MAX_ROWS, int4_gemv.MAX_ROWS)
DEVICE, DTYPE = "cuda", torch.bfloat16  # of the timed calls


def tuning(**changes):
    from podium_cuda.tuning import CUDA_TUNING

    return dataclasses.replace(CUDA_TUNING, **changes)


_MMA_COPIES: dict[int, torch.Tensor] = {}


def awq_weight(qweight: torch.Tensor, t) -> tuple[torch.Tensor, str]:
    """(qweight, format) that tuning ``t`` runs an AWQ weight as: converted to AWQ_MMA (once a weight) where
    ``int4_gemv_mma`` is on, as the CUDA platform converts a model's weights, else as it is."""
    if not t.int4_gemv_mma:
        return qweight, AWQ
    if qweight.data_ptr() not in _MMA_COPIES:
        _MMA_COPIES[qweight.data_ptr()] = awq_to_mma(qweight)
    return _MMA_COPIES[qweight.data_ptr()], AWQ_MMA


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want.double().cpu()).abs().max() / want.double().cpu().abs().max()).item()


def verdict(what: str, err: float, bound: float) -> str:
    return f"check {'PASS' if err <= bound else 'FAIL'} {what}: rel max error {err:.2e} (bound {bound:.0e})"


def prologue_inputs(prologue, rows, k, dtype, device, gen):
    """(x, residual, norm weight) for ``prologue``; x is [rows, 2k] for SiLU-and-mul."""
    width = 2 * k if prologue == "silu_and_mul" else k
    x = torch.randn(rows, width, generator=gen).to(device, dtype)
    residual = torch.randn(rows, k, generator=gen).to(device, dtype)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(device, dtype)
    return x, residual, g


def separate(prologue, x, residual, g):
    """The separate fused_ops kernel's output (what the fused kernels must equal)."""
    from podium_cuda import fused_ops

    if prologue == "add_rms_norm":
        return fused_ops.fused_add_rms_norm(x, residual, g, 1e-5)[0]
    if prologue == "silu_and_mul":
        return fused_ops.silu_and_mul(x)
    return x


def code(prologue) -> int:
    from podium_cuda import prologue as p

    return {None: p.PLAIN, "add_rms_norm": p.ADD_RMSNORM, "silu_and_mul": p.SILU}[prologue]


def check(device: str) -> list[str]:
    from podium_cuda import fp8_quant
    from podium_cuda.fp8_gemv import fp8_gemv
    from podium_cuda.fp8_linear import scaled_mm_linear
    from podium_cuda.int4 import int4_linear
    from podium_cuda.int4_gemv import int4_gemv

    lines = []
    n, k = (192, 512) if device == "cpu" else (6144, 4096)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    bound = 1e-5 if device == "cpu" else 1e-2
    gen = torch.Generator().manual_seed(0)
    for prologue in (None, "add_rms_norm", "silu_and_mul"):
        for rows in (1, 37):
            x, residual, g = prologue_inputs(prologue, rows, k, dtype, device, gen)
            q, s, _ = fp8_quant.quantize(x, code(prologue), residual, g, 1e-5)
            want_q, want_s = quantize_per_token(separate(prologue, x, residual, g))
            differ = int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
            steps = int((q.view(torch.int8).int() - want_q.view(torch.int8).int()).abs().max())
            scales = int((s != want_s).sum())
            # after a norm a last-bit rstd (another summation order than fused_ops') may move a value
            # across an e4m3 rounding boundary: one step, rarely
            ok = differ == scales == 0 if prologue != "add_rms_norm" else steps <= 1 and differ <= q.numel() // 1000
            lines.append(f"check {'PASS' if ok else 'FAIL'} fp8 quantize {prologue or 'plain'} rows {rows}: "
                         f"differing bytes {differ} (at most {steps} e4m3 steps apart), differing scales {scales}")
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8).to(device)
    scale = (torch.rand(n, 1, generator=gen) / 1000 + 1e-4).to(device)
    for prologue in (None, "add_rms_norm", "silu_and_mul"):
        for rows in (1, 4, 16):
            x, residual, g = prologue_inputs(prologue, rows, k, dtype, device, gen)
            q, s = quantize_per_token(separate(prologue, x, residual, g))
            want = (q.double() @ weight.double().t()) * s.double() * scale.double().t()
            for dot in (True, False) if rows == 1 or prologue is None else (True,):
                got, _ = fp8_gemv(x, weight, scale, None, code(prologue), residual, g, 1e-5, tuning(fp8_gemv_dot=dot, fp8_gemv_mma=False))
                lines.append(verdict(f"fp8 gemv {'tensor' if dot else 'cuda'}-cores {prologue or 'plain'} rows {rows}",
                                     rel_error(got, want), bound))
            if device != "cpu" and prologue is None:
                err = rel_error(scaled_mm_linear(x, weight, scale), want)
                lines.append(verdict(f"fp8 new quantize + _scaled_mm rows {rows}", err, bound))
    for fmt, rows, prologue in ((AWQ, 1, None), (AWQ, 1, "add_rms_norm"), (AWQ, 1, "silu_and_mul"), (AWQ, 4, None),
                                (AWQ, 4, "add_rms_norm"), (GPTQ, 1, "add_rms_norm"), (GPTQ, 4, None)):
        packed = random_packed(fmt, k, n, 128, False, gen)
        w = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], packed.get("g_idx"), 128, fmt).double()
        on = {name: t.to(device) for name, t in packed.items()}
        x, residual, g = prologue_inputs(prologue, rows, k, dtype, device, gen)
        want = separate(prologue, x, residual, g).double().cpu() @ w
        got, _ = int4_gemv(x, on["qweight"], on["qzeros"], on["scales"], 128, fmt, None, code(prologue), residual, g,
                           1e-5)
        lines.append(verdict(f"int4 gemv {fmt} {prologue or 'plain'} rows {rows}", rel_error(got, want), bound))
        if prologue is None:
            old = int4_linear(x, on["qweight"], on["qzeros"], on["scales"], on.get("g_idx"), 128, fmt,
                              tuning=tuning(int4_gemv_max_rows=0))
            lines.append(verdict(f"int4 old kernels {fmt} rows {rows}", rel_error(old, x.double().cpu() @ w), bound))
    return lines


def timed(fn, repeat: int = 7, calls: int = 20) -> float:
    """Median microseconds a call of ``fn()`` takes, replayed from a CUDA graph of ``calls`` calls."""
    for _ in range(3):
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


class Projection:
    """One 8B projection's weights in every format, random, on the GPU."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        self.w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k**0.5
        self.linear = torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=DTYPE).requires_grad_(False)
        self.linear.weight.copy_(self.w)
        self.s_w = (self.w.float().abs().amax(dim=1, keepdim=True) / 448).contiguous()
        self.w8 = (self.w.float() / self.s_w).to(FP8)
        awq = quantize_awq(self.w, 128)
        self.awq = (awq["qweight"].contiguous(), awq["qzeros"].contiguous(), awq["scales"].contiguous())


def plain_timings(p: Projection, rows: int) -> dict[str, float]:
    from podium_cuda import gemv
    from podium_cuda.fp8_gemv import fp8_gemv
    from podium_cuda.fp8_linear import scaled_mm, scaled_mm_linear
    from podium_cuda.int4 import int4_linear
    from podium_cuda.int4_gemv import int4_gemv

    x = torch.randn(rows, p.k, device=DEVICE, dtype=DTYPE)
    q, s = quantize_per_token(x)
    old_int4 = tuning(int4_gemv_max_rows=0)
    t = {"bf16 cublas": timed(lambda: F.linear(x, p.w))}
    if rows == 1:
        t["bf16 gemv"] = timed(lambda: gemv.gemv(x, p.linear))
    t["fp8 old quant+mm"] = timed(lambda: scaled_mm_linear(x, p.w8, p.s_w, fused_quant=False))
    t["fp8 new quant+mm"] = timed(lambda: scaled_mm_linear(x, p.w8, p.s_w))
    t["fp8 _scaled_mm alone"] = timed(lambda: scaled_mm(q, s, p.w8, p.s_w))
    if rows <= GEMV_ROWS:
        t["fp8 gemv tensor"] = timed(lambda: fp8_gemv(x, p.w8, p.s_w, tuning=tuning(fp8_gemv_dot=True, fp8_gemv_mma=False)))
        t["fp8 gemv cuda"] = timed(lambda: fp8_gemv(x, p.w8, p.s_w, tuning=tuning(fp8_gemv_dot=False, fp8_gemv_mma=False)))
    t["int4 old"] = timed(lambda: int4_linear(x, *p.awq, None, 128, AWQ, tuning=old_int4))
    if rows <= GEMV_ROWS:
        t["int4 new gemv"] = timed(lambda: int4_gemv(x, *p.awq, 128, AWQ))
    return t


def prologue_timings(p: Projection, prologue: str, rows: int) -> dict[str, float]:
    """The decoder's pairs: the separate kernel then the layer, against the fused kernels."""
    from podium_cuda import fp8_quant, fused_ops, gemv
    from podium_cuda.fp8_gemv import fp8_gemv
    from podium_cuda.fp8_linear import scaled_mm, scaled_mm_linear
    from podium_cuda.int4 import int4_linear
    from podium_cuda.int4_gemv import int4_gemv

    gen = torch.Generator().manual_seed(rows)
    x, residual, g = prologue_inputs(prologue, rows, p.k, DTYPE, DEVICE, gen)
    c = code(prologue)

    def elementwise():
        if prologue == "silu_and_mul":
            return fused_ops.silu_and_mul(x)
        return fused_ops.fused_add_rms_norm(x, residual, g, 1e-5)[0]

    t = {"bf16 kernel+cublas": timed(lambda: F.linear(elementwise(), p.w))}
    if rows == 1:
        gemv_op = gemv.silu_and_mul_linear if prologue == "silu_and_mul" else None
        t["bf16 gemv fused"] = timed(lambda: gemv_op(x, p.linear) if gemv_op else
                                     gemv.rms_norm_linear(x, residual, g, 1e-5, p.linear)[0])
    t["fp8 kernel+old quant+mm"] = timed(lambda: scaled_mm_linear(elementwise(), p.w8, p.s_w, fused_quant=False))

    def fused_quant_mm():
        q, s, _ = fp8_quant.quantize(x, c, residual, g, 1e-5)
        return scaled_mm(q, s, p.w8, p.s_w)

    t["fp8 fused quant+mm"] = timed(fused_quant_mm)
    if rows <= GEMV_ROWS:
        t["fp8 gemv fused"] = timed(lambda: fp8_gemv(x, p.w8, p.s_w, None, c, residual, g, 1e-5))
    t["int4 kernel+old"] = timed(lambda: int4_linear(elementwise(), *p.awq, None, 128, AWQ,
                                                     tuning=tuning(int4_gemv_max_rows=0)))
    if rows <= GEMV_ROWS:
        t["int4 gemv fused"] = timed(lambda: int4_gemv(x, *p.awq, 128, AWQ, None, c, residual, g, 1e-5))
    return t


def line(name: str, p: Projection, rows: int, results: dict[str, float], base: str) -> str:
    ref = results[base]
    return (f"time {name:8s} N={p.n:5d} K={p.k:5d} rows {rows:4d}: "
            + "; ".join(f"{label} {us:7.1f} us (x{us / ref:.2f})" for label, us in results.items()))


def attempt(fn, **options) -> float | None:
    """timed(fn, **options), or None with the failure printed: a configuration that cannot build or run on
    this device (a tile whose buffers exceed shared memory, say) is reported and the rest still timed."""
    try:
        return timed(fn, **options)
    except Exception as error:  # noqa: BLE001  (any build or launch failure)
        print(f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}", flush=True)
        return None


def sweep_line(what: str, results: dict[str, float | None]) -> str:
    ok = {k: v for k, v in results.items() if v is not None}
    return (f"sweep {what}: " + "; ".join(f"{k} {'failed' if v is None else f'{v:.1f} us'}" for k, v in results.items())
            + (f" -> best {min(ok, key=ok.get)}" if ok else ""))


def sweep(p: Projection) -> list[str]:
    """The GEMVs' tiles at one row: FP8 slice widths on the tensor and CUDA cores, INT4 column blocks x
    split counts. The tensor cores' 1024-wide slices need more shared memory than an H200 has
    (303104 > 232448 bytes at three stages): reported as failed."""
    from podium_cuda.fp8_gemv import fp8_gemv
    from podium_cuda.gemv import _multiprocessors
    from podium_cuda.int4_gemv import config, int4_gemv

    x = torch.randn(1, p.k, device=DEVICE, dtype=DTYPE)
    fp8 = {f"{'tensor' if dot else 'cuda'} block_k {bk}":
           attempt(lambda: fp8_gemv(x, p.w8, p.s_w, tuning=tuning(fp8_gemv_block_k=bk, fp8_gemv_dot=dot, fp8_gemv_mma=False)))
           for dot in (False, True) for bk in (256, 512, 1024)}
    base_splits = config(1, p.n, p.k, 128, _multiprocessors(x.device), tuning())[2]
    int4 = {}
    for block_n in (128, 256):
        for splits in sorted({max(1, base_splits // 2), base_splits, 2 * base_splits}):
            t = tuning(int4_gemv_block_n=block_n, int4_gemv_split_k=splits)
            int4[f"block_n {block_n} splits {splits}"] = attempt(lambda: int4_gemv(x, *p.awq, 128, AWQ, tuning=t))
    return [sweep_line(f"fp8 gemv N={p.n} K={p.k}", fp8), sweep_line(f"int4 gemv N={p.n} K={p.k}", int4)]


def rules(plain: dict) -> list[str]:
    """The thresholds the plain timings imply, as KernelTuning values: a path is taken up to the largest
    row count at which it is faster summed over the four projections (one decoder layer's linears)."""
    rows_list = sorted({rows for _, rows in plain})
    shapes = sorted({name for name, _ in plain})

    def total(rows, key) -> float:
        return sum(key(plain[name, rows]) for name in shapes)

    def largest(path, other) -> int:
        best = 0
        for rows in rows_list:  # a threshold: up to the first row count it loses at
            if total(rows, path) >= total(rows, other):
                break
            best = rows
        return best

    def gemv(t):
        return min(t.get("fp8 gemv tensor", 1e9), t.get("fp8 gemv cuda", 1e9))

    fp8_rows = largest(gemv, lambda t: t["fp8 new quant+mm"])
    int4_rows = largest(lambda t: t.get("int4 new gemv", 1e9), lambda t: t["int4 old"])
    dot = total(1, lambda t: t["fp8 gemv tensor"]) <= total(1, lambda t: t["fp8 gemv cuda"]) if 1 in rows_list else True
    fused = all(total(rows, lambda t: t["fp8 new quant+mm"]) <= total(rows, lambda t: t["fp8 old quant+mm"])
                for rows in rows_list)
    setting = (f"fp8_gemv_max_rows={fp8_rows},fp8_gemv_dot={int(dot)},fp8_fused_quant={int(fused)},"
               f"int4_gemv_max_rows={int4_rows}")
    return [f"fp8 gemv rule: the FP8 GEMV beats quantize + _scaled_mm (summed over the projections) up to "
            f"{fp8_rows} rows -> KernelTuning.fp8_gemv_max_rows = {fp8_rows}; at one row the "
            f"{'tensor' if dot else 'CUDA'}-core steps are faster -> fp8_gemv_dot = {dot}",
            f"fp8 quantize rule: the one-launch quantization beats the contract's at every row count: {fused} "
            f"-> fp8_fused_quant = {fused}",
            f"int4 gemv rule: the new INT4 GEMV beats int4.py's kernels up to {int4_rows} rows "
            f"-> KernelTuning.int4_gemv_max_rows = {int4_rows}",
            f"tuning: PODIUM_CUDA_TUNING={setting}"]


def layer_lines(plain: dict, fused: dict) -> list[str]:
    """One decoder layer's four linears with their prologues, per path (the best variant of each new
    kernel family), and x32 layers (8B): what a decode step spends in linears."""
    lines = []
    for rows in sorted({rows for (_, rows) in fused}):
        one = rows == 1
        o = plain["o", rows]
        parts = {
            "bf16": o["bf16 gemv" if one else "bf16 cublas"]
            + sum(fused[name, rows]["bf16 gemv fused" if one else "bf16 kernel+cublas"] for name in FUSED_SHAPES),
            "fp8 old": o["fp8 old quant+mm"] + sum(fused[name, rows]["fp8 kernel+old quant+mm"] for name in FUSED_SHAPES),
            "fp8 new": min(o["fp8 new quant+mm"], o.get("fp8 gemv tensor", 1e9), o.get("fp8 gemv cuda", 1e9))
            + sum(min(fused[name, rows]["fp8 fused quant+mm"], fused[name, rows].get("fp8 gemv fused", 1e9))
                  for name in FUSED_SHAPES),
            "int4 old": o["int4 old"] + sum(fused[name, rows]["int4 kernel+old"] for name in FUSED_SHAPES),
            "int4 new": min(o["int4 old"], o.get("int4 new gemv", 1e9))
            + sum(min(fused[name, rows]["int4 kernel+old"], fused[name, rows].get("int4 gemv fused", 1e9))
                  for name in FUSED_SHAPES),
        }
        lines.append(f"layer rows {rows:4d}: " + "; ".join(f"{k} {v:7.1f} us (x32 {v * 32 / 1000:.2f} ms)"
                                                          for k, v in parts.items()))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 256, 4096])
    parser.add_argument("--no-sweep", action="store_true", help="skip the one-row tile sweep")
    args = parser.parse_args()
    for text in check(args.device):
        print(text, flush=True)
    if args.device != "cuda":
        return
    plain = {}
    projections = {name: Projection(n, k) for name, (n, k) in SHAPES.items()}
    for name, p in projections.items():
        for rows in args.rows:
            plain[name, rows] = plain_timings(p, rows)
            print(line(name, p, rows, plain[name, rows], "bf16 cublas"), flush=True)
    for text in rules(plain):  # first: what the rest of the run may not reach
        print(text, flush=True)
    fused = {}
    for name in FUSED_SHAPES:
        p = projections[name]
        for rows in [r for r in args.rows if r <= 256]:
            fused[name, rows] = prologue_timings(p, PROLOGUE_OF[name], rows)
            print(line(f"{name}+", p, rows, fused[name, rows], "bf16 kernel+cublas"), flush=True)
    for text in layer_lines(plain, fused):
        print(text, flush=True)
    if not args.no_sweep:
        for p in projections.values():
            for text in sweep(p):
                print(text, flush=True)


if __name__ == "__main__":
    main()
