"""Offline RSS over time: ``LLM.generate`` in a loop, the process's RSS split into the KV cache's
resident pages and everything else, so a leak is told apart from the cache filling.

Each iteration generates for a batch of 1-``--max-batch`` prompts of 4-40 words, 4-``--max-tokens``
tokens each, greedy or at temperature 0.8 (seeded), with ``--logprobs``. Printed every 10 iterations
and in a final JSON line: RSS, the KV cache's resident MiB (``mincore`` over its tensors) and their
difference; ``growth_after_warmup_mib`` is that difference's change from the end of the first third
of the run to its end (a leak grows it without bound; a warm-up does not).

    python benchmarks/rss_offline.py --iters 120
    python benchmarks/rss_offline.py --iters 60 --dtype bfloat16 --enforce-eager
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

from podium import LLM, SamplingParams
from podium_cpu.host_memory import resident_bytes

WORDS = "alpha beta gamma delta river mountain code python music light ocean tree stone cloud".split()


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def batch(rng: random.Random, args: argparse.Namespace) -> tuple[list[str], list[SamplingParams]]:
    n = rng.randint(1, args.max_batch)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))) for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(4, args.max_tokens), temperature=rng.choice([0, 0.8]),
                             seed=rng.randint(0, 999), logprobs=3 if args.logprobs else None, ignore_eos=True)
              for _ in range(n)]
    return prompts, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--iters", type=int, default=120)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--logprobs", action="store_true")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=args.enforce_eager,
              enable_prefix_caching=not args.no_prefix_caching)
    caches = llm.engine.kv_caches
    rng, rows, started = random.Random(args.seed), [], time.time()
    for i in range(args.iters):
        llm.generate(*batch(rng, args), use_tqdm=False)
        rss, kv = rss_mib(), sum(map(resident_bytes, caches)) / 2**20
        rows.append((rss, kv))
        if i % 10 == 0 or i == args.iters - 1:
            print(f"iter {i}: rss {rss:.1f} MiB, kv cache resident {kv:.1f} MiB, rest {rss - kv:.1f} MiB, "
                  f"python objects {len(gc.get_objects())}, {time.time() - started:.0f} s", flush=True)
    third = len(rows) // 3
    rest = [rss - kv for rss, kv in rows]
    print(json.dumps({"iters": args.iters, "dtype": str(llm.engine.dtype), "rss_first_mib": round(rows[0][0], 1),
                      "rss_last_mib": round(rows[-1][0], 1), "kv_resident_first_mib": round(rows[0][1], 1),
                      "kv_resident_last_mib": round(rows[-1][1], 1),
                      "growth_after_warmup_mib": round(rest[-1] - rest[third], 1)}))


if __name__ == "__main__":
    main()
