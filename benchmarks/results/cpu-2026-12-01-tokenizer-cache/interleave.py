"""Single fresh processes, interleaved: before (another checkout's core on PYTHONPATH), after (this checkout, warm
tokenizer cache), after_cold (this checkout, empty tokenizer cache, warm kernel cache). Run from the repository root:

    git archive 8a196b3 core | tar -x -C /tmp/before
    OMP_WAIT_POLICY=PASSIVE python benchmarks/results/cpu-2026-12-01-tokenizer-cache/interleave.py \
        /tmp/before/core/src 10 interleaved.json
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, "benchmarks")
import startup as bench  # noqa: E402

before_src, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
args = argparse.Namespace(model="smollm2-135m-instruct", dtype="bfloat16", device=None, max_model_len=2048,
                          timeout=600, cold_kernel_cache=False, cold_tokenizer_cache=True)
env = dict(os.environ)
before = {**env, "PYTHONPATH": before_src}
sides = {"before": lambda: bench.one_run(args, before), "after": lambda: bench.one_run(args, env),
         "after_cold": lambda: bench.cold_cache_run(args, env)}
bench.one_run(args, before)  # untimed warm-ups: page cache, kernel cache, tokenizer cache
bench.one_run(args, env)
runs = {name: [] for name in sides}
start = time.strftime("%H:%M:%S", time.gmtime())
for i in range(rounds):
    for name, run in sides.items():
        runs[name].append(run())
        print(i, name, f"ready {runs[name][-1]['ready']:.2f}", file=sys.stderr, flush=True)
window = [start, time.strftime("%H:%M:%S", time.gmtime())]
with open(out, "w") as f:
    json.dump({"window_utc": window, "median": {k: bench.medians(v) for k, v in runs.items()}, "runs": runs}, f, indent=2)
for name, values in runs.items():
    print(name, len(values))
    print(bench.table(values))
