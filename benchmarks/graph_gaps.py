"""How much of a decode step is idle GPU: inside the captured graph, and between the engine's steps.

    python3 benchmarks/graph_gaps.py --model llama-3.1-8b-shape --sizes 256 1 [--trace-dir DIR] [--kv-cache-dtype fp8]
        [--quantization fp8|awq]

For each batch size, ``size`` requests of ``--prompt-len`` tokens run until every one of them
decodes (so the captured graph's buffers hold a full step: lengths, block tables), then:
1. the graph's replay alone: wall time by CUDA events (median of ``--replays``), and one profiled
   replay's kernels (torch.profiler's Chrome trace): count, summed duration, the idle time between
   consecutive kernels totalled by the kernel that follows the gap, and the kernels' time by family;
2. ``--steps`` engine steps as the engine runs them (async scheduling where it is on), profiled:
   the GPU's span, its busy time (kernels, copies, memsets), and the largest idle gaps with the
   operations on either side: what the GPU waits for between steps (host work on the critical path).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import tempfile

import torch

from podium import LLM, SamplingParams


def replay_ms(replay, count: int) -> float:
    times = []
    for _ in range(count):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profiled(fn, trace_path: str) -> list[dict]:
    """The GPU operations (kernels, copies, memsets) ``fn`` ran, in time order."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    device_ops = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(device_ops, key=lambda e: e["ts"])


def idle_gaps(ops: list[dict]) -> list[tuple[float, str, str]]:
    """(idle microseconds, operation before, operation after) between consecutive GPU operations."""
    gaps, end = [], ops[0]["ts"]
    for before, after in zip(ops, ops[1:]):
        end = max(end, before["ts"] + before["dur"])
        gaps.append((max(after["ts"] - end, 0.0), short(before["name"]), short(after["name"])))
    return gaps


def short(name: str) -> str:
    """A kernel's family: cuBLAS GEMMs and split-K reduces grouped, others by their own name."""
    if name.startswith("Memcpy") or name.startswith("Memset"):
        return name.split(" (")[0] + (" " + name.split("(")[1].rstrip(")") if "(" in name else "")
    if "splitKreduce" in name:
        return "cublas splitK reduce"
    if name.startswith("nvjet") or "gemm" in name.lower():
        return "cublas gemm"
    return name.split("(")[0].split("<")[0].replace("void ", "")[:48]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b-shape")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1])
    parser.add_argument("--prompt-len", type=int, default=600)
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8, help="engine steps profiled after the replays")
    parser.add_argument("--trace-dir", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="e.g. fp8 or awq (online, as `podium bench` takes it)")
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=1024, kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    engine, runner = llm.engine, llm.engine.runner
    vocab = engine.source.hf_config.vocab_size
    rng = random.Random(0)
    if not runner.graphs:
        raise SystemExit("no captured graphs: this needs a platform with graph capture (a CUDA GPU)")
    trace_dir = args.trace_dir or tempfile.mkdtemp()
    os.makedirs(trace_dir, exist_ok=True)
    for size in args.sizes:
        params = SamplingParams(temperature=0, max_tokens=args.steps + 64, ignore_eos=True)
        ids = [f"{size}-{i}" for i in range(size)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(vocab) for _ in range(args.prompt_len)], params)
        full_steps = 0
        while full_steps < 3:  # every request decodes: the graph's buffers hold a full step
            engine.step()
            full_steps = full_steps + 1 if runner.last_used_graph and engine.stats().num_running == size else 0
        graph_size = runner.decode_graphs.size_for(size)
        replay, _ = runner.graphs[graph_size]
        wall = replay_ms(replay, args.replays)
        kernels = profiled(replay, os.path.join(trace_dir, f"graph_{graph_size}.json"))
        busy = sum(k["dur"] for k in kernels) / 1e3
        span = (kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]) / 1e3
        print(f"graph {graph_size} ({size} seqs, ~{args.prompt_len} context): replay {wall:.3f} ms (events), "
              f"profiled span {span:.3f} ms, {len(kernels)} operations summing {busy:.3f} ms, idle {span - busy:.3f} ms")
        by_next = collections.defaultdict(lambda: [0.0, 0])
        for gap, _, after in idle_gaps(kernels):
            by_next[after][0] += gap
            by_next[after][1] += 1
        for name, (total, count) in sorted(by_next.items(), key=lambda kv: -kv[1][0]):
            print(f"    idle before {name:48s} {total:8.1f} us over {count:4d} gaps ({total / count:5.2f} us each)")
        by_family = collections.defaultdict(lambda: [0.0, 0])
        for kernel in kernels:
            by_family[short(kernel["name"])][0] += kernel["dur"]
            by_family[short(kernel["name"])][1] += 1
        for name, (total, count) in sorted(by_family.items(), key=lambda kv: -kv[1][0]):
            print(f"    busy in {name:48s} {total:8.1f} us over {count:4d} operations ({total / count:6.2f} us each)")

        def steps():
            for _ in range(args.steps):
                engine.step()

        ops = profiled(steps, os.path.join(trace_dir, f"steps_{size}.json"))
        span = (ops[-1]["ts"] + ops[-1]["dur"] - ops[0]["ts"]) / 1e3
        busy = sum(op["dur"] for op in ops) / 1e3
        gaps = idle_gaps(ops)
        print(f"  {args.steps} engine steps: GPU span {span:.2f} ms ({span / args.steps:.2f} ms a step), "
              f"busy {busy:.2f} ms, idle {span - busy:.2f} ms ({(span - busy) / args.steps:.3f} ms a step)")
        for gap, before, after in sorted(gaps, reverse=True)[:12]:
            print(f"    idle {gap:8.1f} us  after {before:40s} before {after}")
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()


if __name__ == "__main__":
    main()
