"""torch.compile of the CPU decode step against eager and CPU graphs (issue 9's candidate list).

    python benchmarks/cpu_torch_compile.py [--num-seqs 32] [--prompt-len 112] [--steps 30]

Three engines in turn, bf16 SmolLM2, ``--num-seqs`` greedy requests of ``--prompt-len`` random tokens:
eager (``enforce_eager=True``), eager with ``torch.compile(model.forward, dynamic=True)`` (what
compiling the decode step means when the platform's kernels are native calls: Dynamo traces the
model's Python and the ops' glue, and breaks the graph at each ctypes call), and the CPU graphs
(the default). Prints each one's first-step time (compilation included) and the median of the
next ``--steps`` decode steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from podium import LLM, SamplingParams


def run(label: str, llm: LLM, prompts: list[list[int]], steps: int) -> None:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{label}-{i}", prompt, SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True))
    engine.step()  # the prefill
    start = time.perf_counter()
    engine.step()  # the first decode step: compiles, where anything compiles
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    print(f"{label:28s} first decode step {first * 1e3:9.1f} ms, then median {statistics.median(times) * 1e3:6.2f} ms "
          f"(min {min(times) * 1e3:.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=112)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    common = {"dtype": "bfloat16", "max_model_len": 1024, "enable_prefix_caching": False,
              "max_num_batched_tokens": max(2048, args.num_seqs * args.prompt_len)}  # the prefill in one step
    run("eager", LLM("smollm2-135m-instruct", enforce_eager=True, **common), prompts, args.steps)
    compiled = LLM("smollm2-135m-instruct", enforce_eager=True, **common)
    compiled.engine.model.forward = torch.compile(compiled.engine.model.forward, dynamic=True)
    run("eager + torch.compile", compiled, prompts, args.steps)
    run("CPU graphs (the default)", LLM("smollm2-135m-instruct", **common), prompts, args.steps)


if __name__ == "__main__":
    main()
