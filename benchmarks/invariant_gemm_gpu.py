"""The batch-invariant GEMM's kernels and tilings measured on one GPU; prints the plan to run there.

    python3 benchmarks/invariant_gemm_gpu.py [--out DIR] [--budget 150] [--no-throughput]

For every candidate (``podium_cuda.gemm_plan.CANDIDATES``: the pointer kernel's tilings and the
persistent TMA kernel's) at each Llama-3.1-8B and 3.2-1B projection (qkv, o, gate_up, down, and the
LM heads, 128256 x 4096 / 2048) in bf16, one process:
- correctness: 300 rows against torch.matmul in float64 (relative error of the whole output);
- invariance: rows 0, 5, 63, 64, 299 alone, and batches of 7, 256 and the largest M, against the
  same rows of the 300-row batch, bit for bit; and how many variants Triton compiled (one a
  tiling: M is not specialized on);
- time at M = 1, 64, 256, 2048, 8192 (the LM heads only to 256: they see the sampled rows alone)
  against cuBLAS (F.linear, as the default mode runs it): each a CUDA graph of back-to-back calls
  cycling over weight copies that together exceed the L2 (a layer's weight is not in L2 when it
  runs), CUDA-event timed, the median of 5 replays; cuBLAS timed before and after the candidates.
A shape's winner is the candidate, correct and invariant, with the least time over the 8B
``256 x 512/256`` workload's steps: WEIGHTS (256 decode steps of 256 rows, 64 prefill steps of
2048 under the default 2048-token budget, a little of the other sizes so none is left far behind).
The default (for shapes not listed) is the candidate best over every shape (geometric mean).
The table goes to stdout and DIR/summary.txt, the plan to DIR/invariant_gemm_plan.txt as
``invariant_gemm=...`` (the ``tuning`` option; paste its value into tuning.INVARIANT_GEMM_PLAN).
Then, while the budget lasts, the 8B shape's 256 x 512/256 throughput (invariant_gpu.throughput)
with the mode on under that plan and in the default mode, and their ratio. Every step's time is
checked against --budget (seconds); the last line printed is the plan.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # what the CUDA platform sets (platform.py)

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from podium_cuda import invariant_gemm, invariant_gemm_tma  # noqa: E402
from podium_cuda.gemm_plan import CANDIDATES, GemmPlan, GemmTiling  # noqa: E402
from podium_cuda.tuning import CUDA_TUNING  # noqa: E402

SHAPES = {  # name: (N, K)
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (28672, 4096), "8B down": (4096, 14336),
    "8B lm_head": (128256, 4096), "1B qkv": (3072, 2048), "1B o": (2048, 2048), "1B gate_up": (16384, 2048),
    "1B down": (2048, 8192), "1B lm_head": (128256, 2048),
}
ROWS = (1, 64, 256, 2048, 8192)
HEAD_ROWS = (1, 64, 256)
WEIGHTS = {1: 1, 64: 2, 256: 256, 2048: 64, 8192: 4}
ALONE, BATCHES, CHECK_ROWS = (0, 5, 63, 64, 299), (7, 256), 300
ORDER = ("tma", "tiles", "tma_ws")  # measured in this order: if the budget ends early the TMA ones are in
DEVICE, DTYPE, REPS, GRAPH_SECONDS = "cuda", torch.bfloat16, 5, 0.002
SWEEP_SHARE = 0.4  # of the budget, for the candidates (the throughput runs need the rest)


class Report:
    def __init__(self, out: Path) -> None:
        self.out, self.record = out, {"candidates": {}, "cublas": {}}
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.txt").write_text("")

    def line(self, text: str) -> None:
        print(text, flush=True)
        with open(self.out / "summary.txt", "a") as f:
            f.write(text + "\n")

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.record, indent=1, default=str))


class Shape:
    """A projection's weight copies (over 2x the L2 together, cycled by the timed graphs), inputs
    and float64 reference of the first CHECK_ROWS rows."""

    def __init__(self, name: str, n: int, k: int, l2_bytes: int) -> None:
        self.name, self.n, self.k = name, n, k
        self.rows = HEAD_ROWS if "lm_head" in name else ROWS
        gen = torch.Generator(device=DEVICE).manual_seed(n + k)
        w = torch.randn(n, k, device=DEVICE, dtype=DTYPE, generator=gen) / k**0.5
        copies = max(1, min(8, math.ceil(2 * l2_bytes / (w.numel() * w.element_size()))))
        self.weights = [w] + [w.clone() for _ in range(copies - 1)]
        self.x = torch.randn(max(*self.rows, CHECK_ROWS), k, device=DEVICE, dtype=DTYPE, generator=gen)
        self.ref = self.x[:CHECK_ROWS].double() @ w.double().T


def graph_seconds(calls) -> float:
    """Seconds a call: ``calls`` (one per weight copy) cycled in a CUDA graph of ~GRAPH_SECONDS."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    end.synchronize()
    each = start.elapsed_time(end) / 1e3 / len(calls)
    count = len(calls) * max(1, min(200 // len(calls), round(GRAPH_SECONDS / each / len(calls))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(count):
            calls[i % len(calls)]()
    graph.replay()
    times = []
    for _ in range(REPS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / count)
    del graph
    return statistics.median(times)


def run_tiling(t: GemmTiling, x: torch.Tensor, w: torch.Tensor):
    """(output, the compiled kernel) of one exact tiling."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return out, invariant_gemm.linear_with(t, x, w, None, out)


def cublas_times(shapes: list[Shape]) -> dict:
    return {s.name: {m: graph_seconds([lambda w=w, m=m, s=s: F.linear(s.x[:m], w) for w in s.weights])
                     for m in s.rows} for s in shapes}


def compiled_variants() -> int:
    """Kernel variants Triton holds for the two GEMM kernels (0 where its cache layout is unknown)."""
    total = 0
    for fn in (invariant_gemm._gemm_kernel, invariant_gemm_tma._tma_gemm_kernel):
        try:
            total += sum(len(entry[0]) for entry in fn.device_caches.values())
        except (AttributeError, TypeError, IndexError):
            return 0
    return total


def check(t: GemmTiling, s: Shape) -> dict:
    """Correctness and invariance of one tiling at one shape (module docstring)."""
    w = s.weights[0]
    full, _ = run_tiling(t, s.x[:CHECK_ROWS], w)
    differ = sum(not torch.equal(run_tiling(t, s.x[i:i + 1], w)[0], full[i:i + 1]) for i in ALONE)
    for m in (*BATCHES, max(s.rows)):
        differ += int(not torch.equal(run_tiling(t, s.x[:m], w)[0][:CHECK_ROWS], full[:min(m, CHECK_ROWS)]))
    err = ((full.double() - s.ref).norm() / s.ref.norm()).item()
    return {"differ": differ, "rel_err": err, "ok": differ == 0 and err < 1e-2}


def same_code_as_tma(t: GemmTiling, s: Shape) -> bool:
    """Whether the warp-specialized kernel compiled to the plain TMA kernel's PTX (seen with Triton
    3.6 on sm90: its Hopper pass leaves this loop as it is)."""
    def ptx(kernel) -> str | None:  # None: no compiled kernel (the interpreter)
        text = getattr(kernel, "asm", {}).get("ptx")
        return text and "\n".join(line for line in text.splitlines() if not line.lstrip().startswith((".loc", "//")))

    plain = GemmTiling(t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages, kernel="tma")
    x, w = s.x[:64], s.weights[0]
    code = ptx(run_tiling(t, x, w)[1])
    return code is not None and code == ptx(run_tiling(plain, x, w)[1])


def measure(t: GemmTiling, shapes: list[Shape], cublas: dict, report: Report) -> dict:
    before, begin = compiled_variants(), time.perf_counter()
    run_tiling(t, shapes[0].x[:1], shapes[0].weights[0])  # compile
    result = {"compile_s": time.perf_counter() - begin, "shapes": {}}
    if t.kernel == "tma_ws" and same_code_as_tma(t, shapes[0]):
        result["skipped"] = "same PTX as the tma kernel of these tiles (warp specialization did nothing)"
        report.line(f"{t.text():22s} {result['skipped']}")
        return result
    for s in shapes:
        entry = check(t, s)
        entry["seconds"] = {m: graph_seconds([lambda w=w, m=m, s=s: run_tiling(t, s.x[:m], w)
                                              for w in s.weights]) for m in s.rows}
        result["shapes"][s.name] = entry
        speed = "  ".join(f"M={m} {cublas[s.name][m] / sec:.2f}x ({sec * 1e6:.0f} us)"
                          for m, sec in entry["seconds"].items())
        report.line(f"{t.text():22s} {s.name:10s} {speed}  rel err {entry['rel_err']:.1e}, "
                    f"{entry['differ']} differ{'' if entry['ok'] else '  FAILED'}")
    result["variants"] = compiled_variants() - before
    report.line(f"{t.text():22s} compiled {result['variants']} variant(s) in all "
                f"(first call {result['compile_s']:.1f} s), {time.perf_counter() - begin:.1f} s")
    return result


def workload_seconds(seconds: dict) -> float:
    return sum(WEIGHTS[m] * sec for m, sec in seconds.items())


def workload_speeds(results: dict, cublas: dict) -> dict[str, dict[str, float]]:
    """tiling text -> shape -> its workload time's speed as a fraction of cuBLAS's, for the shapes
    where it was correct, invariant and timed at every M."""
    speeds: dict[str, dict[str, float]] = {}
    for text, result in results.items():
        for name, entry in result.get("shapes", {}).items():
            if entry["ok"] and len(entry["seconds"]) == len(cublas[name]):
                speeds.setdefault(text, {})[name] = workload_seconds(cublas[name]) / workload_seconds(entry["seconds"])
    return speeds


def choose(speeds: dict[str, dict[str, float]], shapes: list[Shape]) -> GemmPlan:
    """Each shape's fastest tiling; the default: the fastest over every shape (geometric mean)."""
    if not speeds:
        return CUDA_TUNING.invariant_gemm
    best = {s.name: max(speeds, key=lambda text: speeds[text].get(s.name, 0.0)) for s in shapes}
    everywhere = [text for text, v in speeds.items() if len(v) == len(shapes)]
    default = max(everywhere, key=lambda text: sum(math.log(r) for r in speeds[text].values()), default=None)
    return GemmPlan(GemmTiling.parse(default) if default else CUDA_TUNING.invariant_gemm.default,
                    tuple((s.n, s.k, GemmTiling.parse(best[s.name])) for s in shapes
                          if s.name in speeds.get(best[s.name], {})))


def summarize(plan: GemmPlan, speeds: dict, shapes: list[Shape], report: Report) -> None:
    report.line("\nper shape: the winner's speed over the workload's steps (WEIGHTS) against cuBLAS's, and "
                "the current plan's choice")
    for s in shapes:
        was = invariant_gemm.choose_tiling(s.n, s.k, DTYPE, s.x.device, CUDA_TUNING.invariant_gemm).text()
        before = speeds.get(was, {}).get(s.name)
        tiling = plan.entry(s.n, s.k)
        if tiling is None:
            report.line(f"{s.name:10s} no candidate was correct and invariant at every M: the default")
            continue
        picked = invariant_gemm.choose_tiling(s.n, s.k, DTYPE, s.x.device, plan)
        report.line(f"{s.name:10s} {tiling.text():22s} {speeds[tiling.text()][s.name]:.2f}x cuBLAS  (current "
                    f"{was}: {f'{before:.2f}x' if before else 'not measured'})"
                    f"{'' if picked == tiling else f'  BUT the platform would run {picked.text()}'}")
    report.line(f"default (shapes not listed): {plan.default.text()}")


def throughput_runs(plan: GemmPlan, begin: float, budget: float, report: Report) -> None:
    """The 8B shape's 256 x 512/256 out tok/s, the mode on under ``plan`` then the default mode."""
    sys.path.insert(0, str(Path(__file__).parent))
    from invariant_gpu import throughput

    from podium import LLM

    results = {}
    for mode, need in (("on", 45), ("off", 35)):
        left = budget - (time.perf_counter() - begin)
        if left < need:
            report.line(f"throughput, mode {mode}: skipped ({left:.0f} s of the budget left, {need} needed)")
            break
        start = time.perf_counter()
        options = {"tuning": f"invariant_gemm={plan.text()}"} if mode == "on" else {}
        llm = LLM("llama-3.1-8b-shape", dtype="bfloat16", device="cuda", batch_invariant=mode == "on",
                  max_model_len=1024, seed=0, enable_prefix_caching=False, max_num_seqs=256, num_kv_blocks=12800,
                  platform_options=options)
        results[mode] = throughput(llm)
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        report.line(f"throughput 8B 256 x 512/256, mode {mode}: {results[mode]['out_tok_s']:.0f} out tok/s "
                    f"({time.perf_counter() - start:.0f} s with the engine's start)")
    if len(results) == 2:
        report.line(f"throughput ratio, batch-invariant / default: "
                    f"{results['on']['out_tok_s'] / results['off']['out_tok_s']:.3f}x")
    report.record["throughput"] = results
    report.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "./invariant_gemm_out"))
    parser.add_argument("--budget", type=float, default=150.0, help="seconds for the whole run")
    parser.add_argument("--no-throughput", action="store_true")
    args = parser.parse_args()
    begin, report = time.perf_counter(), Report(Path(args.out))
    props = torch.cuda.get_device_properties(0)
    report.line(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, "
                f"torch {torch.__version__}, triton {__import__('triton').__version__}")
    shapes = [Shape(name, n, k, props.L2_cache_size) for name, (n, k) in SHAPES.items()]
    cublas = cublas_times(shapes)
    report.line(f"cuBLAS timed ({time.perf_counter() - begin:.0f} s in)")
    order = sorted(CANDIDATES, key=lambda t: ORDER.index(t.kernel))
    for t in order:
        if time.perf_counter() - begin > SWEEP_SHARE * args.budget:
            report.line(f"{t.text():22s} not measured (the sweep's share of the budget is spent)")
            continue
        try:
            report.record["candidates"][t.text()] = measure(t, shapes, cublas, report)
        except Exception as error:  # a tiling Triton cannot build or launch here: the others still run
            report.record["candidates"][t.text()] = {"error": f"{type(error).__name__}: {error}"[:500]}
            report.line(f"{t.text():22s} FAILED {type(error).__name__}: {str(error).splitlines()[0][:200]}")
        report.save()
    after = cublas_times(shapes)
    drift = max(abs(after[n][m] / cublas[n][m] - 1) for n in cublas for m in cublas[n])
    cublas = {n: {m: (cublas[n][m] + after[n][m]) / 2 for m in cublas[n]} for n in cublas}
    report.record["cublas"] = cublas
    report.line(f"cuBLAS before against after the candidates: at most {drift:.0%} apart (their mean is used)")
    speeds = workload_speeds(report.record["candidates"], cublas)
    plan = choose(speeds, shapes)
    summarize(plan, speeds, shapes, report)
    (Path(args.out) / "invariant_gemm_plan.txt").write_text(f"invariant_gemm={plan.text()}\n")
    report.record["plan"] = plan.text()
    report.save()
    del shapes
    gc.collect()
    torch.cuda.empty_cache()
    if not args.no_throughput:
        throughput_runs(plan, begin, args.budget, report)
    report.line(f"total {time.perf_counter() - begin:.0f} s\ninvariant_gemm={plan.text()}")


if __name__ == "__main__":
    main()
