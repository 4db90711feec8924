"""Load-to-ready time of ``LLM(model)``, stage by stage, as the median of fresh processes.

    python benchmarks/startup.py                          # SmolLM2, platform default dtype, 5 runs
    python benchmarks/startup.py --dtype float32 --runs 7 --json startup.json
    python benchmarks/startup.py --cold-kernel-cache      # every run compiles the CPU kernels anew
    python benchmarks/startup.py --cold-tokenizer-cache   # every run converts (and caches) the GGUF tokenizer

Each run is a new Python process (nothing imported or cached in memory), after one untimed run
that warms the OS page cache, the CPU platform's kernel cache (``~/.cache/podium/cpu-kernels``) and
the tokenizer cache (``~/.cache/podium/tokenizers``) the way any earlier start on the machine would
have. ``--cold-kernel-cache`` gives every run an empty cache folder (both caches cold);
``--cold-tokenizer-cache`` one holding only the warm kernel cache (the first start of a new GGUF
file). ``PODIUM_TOKENIZER_CACHE=0`` in the environment turns the tokenizer cache off. A run reports:

    python_start   from spawning the process to its first line of Python
    imports        ``from podium import LLM`` (torch, the core, the plugin entry points)
    <stages>       ``LLMEngine.startup_seconds`` (see ``podium.startup``: platform, config, tokenizer,
                   custom_ops, model_build, weights, kv_cache, graph_capture)
    engine         the ``LLM(...)`` constructor: the stages' total
    ready          python_start + imports + engine: what a user waits for
    first_request  then one request of one token (first-call costs such as oneDNN's kernel choice)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
first_line = time.time()
t0 = time.perf_counter()
from podium import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1], dtype=sys.argv[2], device=sys.argv[3] or None, max_model_len=int(sys.argv[4]))
t2 = time.perf_counter()
llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
print("PODIUM_STARTUP " + json.dumps({
    "first_line": first_line, "imports": t1 - t0, "engine": t2 - t1, "first_request": t3 - t2,
    "stages": llm.engine.startup_seconds, "dtype": str(llm.engine.dtype).replace("torch.", ""),
    "platform": llm.engine.platform_name, "attention": llm.engine.platform.attention_backend().name,
}))
"""
ORDER = ("python_start", "imports", "platform", "config", "tokenizer", "custom_ops", "model_build", "weights",
         "kv_cache", "graph_capture", "engine", "ready", "first_request")


def one_run(args: argparse.Namespace, env: dict[str, str]) -> dict:
    """Spawn one process; its timings, flattened into one dict of seconds (plus dtype and backend)."""
    spawned = time.time()
    cmd = [sys.executable, "-c", CHILD, args.model, args.dtype, args.device or "", str(args.max_model_len)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PODIUM_STARTUP ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"startup run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    child = json.loads(lines[-1].split(" ", 1)[1])
    run = {"python_start": child["first_line"] - spawned, "imports": child["imports"]}
    run.update({k: v for k, v in child["stages"].items() if k != "total"})
    run["engine"] = child["engine"]
    run["ready"] = run["python_start"] + run["imports"] + run["engine"]
    run["first_request"] = child["first_request"]
    run["meta"] = {"dtype": child["dtype"], "platform": child["platform"], "attention": child["attention"]}
    return run


def cold_cache_run(args: argparse.Namespace, env: dict[str, str]) -> dict:
    """One run in an empty XDG_CACHE_HOME; with ``--cold-tokenizer-cache`` it links in the warm kernel cache."""
    with tempfile.TemporaryDirectory(prefix="podium-startup-") as cache:
        if args.cold_tokenizer_cache:
            kernels = os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "podium", "cpu-kernels")
            os.makedirs(os.path.join(cache, "podium"))
            if os.path.isdir(kernels):
                os.symlink(kernels, os.path.join(cache, "podium", "cpu-kernels"))
        return one_run(args, {**env, "XDG_CACHE_HOME": cache})


def medians(runs: list[dict]) -> dict[str, float]:
    keys = [k for k in ORDER if k in runs[0]] + [k for k in runs[0] if k not in ORDER and k != "meta"]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def table(runs: list[dict]) -> str:
    mid = medians(runs)
    lines = [f"{'stage':<14} {'median s':>9} {'min':>7} {'max':>7}"]
    for key, value in mid.items():
        values = [r[key] for r in runs]
        rule = "-" * 40 + "\n" if key in ("engine", "ready") else ""
        lines.append(f"{rule}{key:<14} {value:>9.2f} {min(values):>7.2f} {max(values):>7.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cold-kernel-cache", action="store_true",
                        help="give every run an empty XDG_CACHE_HOME (the CPU kernels are compiled each time)")
    parser.add_argument("--cold-tokenizer-cache", action="store_true",
                        help="give every run an empty tokenizer cache (the GGUF tokenizer is converted and saved)")
    parser.add_argument("--json", default=None, help="also write every run and the medians here")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.cold_kernel_cache and args.cold_tokenizer_cache:
        parser.error("--cold-kernel-cache already makes the tokenizer cache cold; pass one of them")
    env = dict(os.environ)
    one_run(args, env)  # untimed: page cache, kernel and tokenizer caches warm, as after any earlier start
    runs = []
    for _ in range(args.runs):
        runs.append(cold_cache_run(args, env) if args.cold_kernel_cache or args.cold_tokenizer_cache
                    else one_run(args, env))
        print(f"run {len(runs)}: ready {runs[-1]['ready']:.2f} s", file=sys.stderr, flush=True)
    meta = runs[0]["meta"]
    cold = " with cold kernel caches" if args.cold_kernel_cache else \
        " with cold tokenizer caches" if args.cold_tokenizer_cache else ""
    print(f"startup of {args.model} ({meta['dtype']}, platform {meta['platform']}, attention {meta['attention']}), "
          f"median of {len(runs)} fresh processes{cold}:")
    print(table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "args": vars(args), "meta": meta, "median": medians(runs),
                       "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
