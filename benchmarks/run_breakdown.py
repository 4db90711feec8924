"""Where a whole ``podium bench throughput`` run's time goes, step by step (wall-clock wrappers).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/run_breakdown.py [--num-prompts 32 --input-len 48 --output-len 128]

Builds the benchmark's Podium backend and requests exactly as ``podium bench throughput`` does
(same dataset, warm-up, greedy, EOS ignored), then times the run with every engine step wrapped:
the scheduler, the model forward, compute_logits (or, for decode steps on a captured graph, the
graph replay, which holds both), the sampler, and the rest of the step (batch building, output
processing, detokenizing). Steps are grouped by kind: ``prefill`` (any sequence
computes more than one token), ``decode``. Prints per-kind totals and per-step medians in ms, the
run's wall and process CPU time, and how much of the run no step accounts for (the bench's loop).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from decode_breakdown import wrap  # benchmarks/ is the script's folder, first on sys.path

from podium_bench.backends import EngineOptions, podium_backend, target_of
from podium_bench.datasets import DatasetSpec, build_requests


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--onednn", action="store_true", help="pack linears for oneDNN even where a native kernel runs")
    args = parser.parse_args()
    if args.onednn:
        from podium_cpu import CpuPlatform
        from podium_cpu.linear_choice import LinearRule

        forced = {dtype: LinearRule("onednn", "forced by --onednn") for dtype in (torch.bfloat16, torch.float32)}
        CpuPlatform.linear_rules = lambda self: forced
    given = {"model": args.model, "dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens}
    options = EngineOptions({k: v for k, v in given.items() if v is not None})
    backend = podium_backend(options)
    spec = DatasetSpec(name="random", num_prompts=args.num_prompts, input_len=args.input_len,
                       output_len=args.output_len)
    requests = build_requests(spec, target_of(backend).space)
    backend.warmup(requests)

    engine = backend.engine
    acc: dict = collections.defaultdict(float)
    for obj, attr, key in ((engine.scheduler, "schedule", "schedule"), (engine.model, "forward", "model forward"),
                           (engine.model, "compute_logits", "compute_logits"), (engine.sampler, "sample", "sample"),
                           (engine.sampler, "sample_device", "sample"), (engine.runner, "execute", "execute"),
                           (engine.runner.decode_graphs, "replay", "graph replay")):
        wrap(obj, attr, key, acc)
    steps: list[tuple[str, dict]] = []
    step = engine.step

    def timed_step():
        acc.clear()
        plan_kind = "decode"
        original = engine.scheduler.schedule

        def schedule():
            nonlocal plan_kind
            plan = original()
            if any(s.num_new_tokens > 1 for s in plan.scheduled):
                plan_kind = "prefill"
            return plan

        engine.scheduler.schedule = schedule
        wall, cpu = time.perf_counter(), time.process_time()
        out = step()
        acc["step"], acc["step cpu"] = time.perf_counter() - wall, time.process_time() - cpu
        engine.scheduler.schedule = original
        steps.append((plan_kind, dict(acc)))
        return out

    engine.step = timed_step
    wall, cpu = time.perf_counter(), time.process_time()
    backend.generate(requests)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"run: wall {wall * 1e3:.0f} ms, process CPU {cpu * 1e3:.0f} ms, {len(steps)} steps")
    keys = ["step", "step cpu", "execute", "model forward", "compute_logits", "graph replay", "sample", "schedule"]
    for kind in ("prefill", "decode"):
        chosen = [a for k, a in steps if k == kind]
        if not chosen:
            continue
        print(f"{kind}: {len(chosen)} steps")
        for key in keys:
            values = [a.get(key, 0.0) * 1e3 for a in chosen]
            print(f"  {key:16s} total {sum(values):8.1f}  median {statistics.median(values):7.2f}  "
                  f"max {max(values):7.2f}")
        rest = [(a["step"] - a.get("execute", 0) - a.get("schedule", 0)) * 1e3 for a in chosen]
        print(f"  {'step - execute - schedule':16s} total {sum(rest):8.1f}  median {statistics.median(rest):7.2f}")
    in_steps = sum(a["step"] for _, a in steps)
    print(f"outside steps (bench/LLM loop): {(wall - in_steps) * 1e3:.1f} ms")
    decode = [a for k, a in steps if k == "decode"]
    tenth = max(1, len(decode) // 8)
    print("decode steps by eighths of the run (median step / forward or graph replay / logits ms):",
          [(round(statistics.median(a["step"] for a in decode[i:i + tenth]) * 1e3, 1),
            round(statistics.median(a.get("model forward", 0) + a.get("graph replay", 0)
                                    for a in decode[i:i + tenth]) * 1e3, 1),
            round(statistics.median(a.get("compute_logits", 0) for a in decode[i:i + tenth]) * 1e3, 1))
           for i in range(0, len(decode), tenth)])
    print("first 6 steps (kind, step ms, forward ms):",
          [(k, round(a["step"] * 1e3, 1), round(a.get("model forward", 0) * 1e3, 1)) for k, a in steps[:6]])


if __name__ == "__main__":
    main()
