#!/usr/bin/env bash
# Multi-LoRA on an H200, one device call (<= 540 s): results under $OUT, key lines in $OUT/summary.txt.
#   bash benchmarks/lora_gpu.sh            (from the repo root)
# Steps (each under its own timeout, 480 s in all, plus the install; ~260 s expected):
#   kernels  the Triton SGMV shrink/expand kernels against the contract's reference on the GPU
#            (platforms/cuda/tests/test_lora_kernel.py: 8B shapes, bf16 and float32, a graph replayed
#            for new slot mixes)
#   engine   a tiny random Llama with 4 adapters over 2 slots, float32: the CUDA engine (decode graphs
#            with the adapters in them, and without them for base-only steps) gives the CPU platform's
#            greedy tokens (benchmarks/lora_gpu_check.py)
#   plain    llama-3.1-8b-shape (random bf16 weights), 256 requests x 512 in / 256 out, the base model in
#            an engine without LoRA (its own process)
#   lora     the same requests in the LoRA engine (8 slots of rank 16): the base model alone, then every
#            request with one of 8 random rank-16 adapters on all 7 projections, round-robin, alternated
#            twice (one process)
#   plain2   plain again, after the LoRA engine's process: the first process on a cold GPU ran ~8 % slower
#            once, so the ratios are against the mean of both plain runs, and each run is printed
#   kbench   the kernels' time per 8B decoder layer against its base GEMMs, decode (graph mapping,
#            8 adapters and none) under a few tilings, as two launches per projection and as the fused
#            one, and prefill under a few prefill tilings (benchmarks/lora_kernel_bench.py; each variant
#            next to the default, marked) (run last, so the throughput lines come first in the summary)
# The throughput lines give the ratios: mixed / plain (the mean of the two plain runs; the target is
# >= 0.8), mixed / base and base / plain, next to the previous runs' (adc5f05, 2026-12-04), and each
# run's two phases (until every request has its first token; after: decode alone), to tell the
# adapters' prefill cost from their decode cost.
# The CPU platform is installed too: the engine step compares the GPU's tokens with its own.
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_lora_gpu}
JSON=$(mktemp -d)  # the runs' figures, read below (not under $OUT: at most 8 files come back)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cpu -e ./platforms/cuda \
  -e ./bench \
  2>&1 | grep -v -i warning | tail -3

run_step() {  # run_step NAME TIMEOUT COMMAND...: run, log, keep going
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  grep -E "${KEEP:-.}" "$OUT/$name.log" | tail -n "${TAIL:-8}" | tee -a "$OUT/summary.txt"
}

BENCH=(python3 benchmarks/lora_cpu.py --device cuda --model llama-3.1-8b-shape --dtype bfloat16 --adapters 8
       --rank 16 --requests 256 --input-len 512 --output-len 256 --max-model-len 1024 --pairs 1)
TAIL=4 run_step kernels 120 python3 -m pytest -q -p no:cacheprovider -rfE platforms/cuda/tests/test_lora_kernel.py
TAIL=4 run_step engine 90 python3 benchmarks/lora_gpu_check.py --device cuda
KEEP="tok/s|ratio|Error|error" run_step plain 60 "${BENCH[@]}" --only plain --json-out "$JSON/plain.json"
KEEP="tok/s|ratio|Error|error" run_step lora 120 "${BENCH[@]}" --only lora --pairs 2 --json-out "$JSON/lora.json"
KEEP="tok/s|ratio|Error|error" run_step plain2 60 "${BENCH[@]}" --only plain --json-out "$JSON/plain2.json"
python3 - "$JSON" <<'EOF' | tee -a "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
plains, plain_phases = [], []
for name in ("plain", "plain2"):
    try:
        result = json.loads((out / f"{name}.json").read_text())
        plains.append(result["median"]["plain"])
        plain_phases.append(result["phases"]["plain"])
    except (OSError, KeyError, ValueError) as exc:
        print(f"{name}: no result ({exc})")
try:
    result = json.loads((out / "lora.json").read_text())
    lora, phases = result["median"], result["phases"]
except (OSError, KeyError, ValueError) as exc:
    sys.exit(f"no ratio: {exc}")
if not plains:
    sys.exit("no ratio: neither plain run gave a result")
plain, mixed = sum(plains) / len(plains), lora["mixed"]
print(f"8B 256 x 512/256, out tok/s: plain {plain:.0f} (mean of {', '.join(f'{p:.0f}' for p in plains)}: "
      f"before and after the LoRA engine), LoRA engine base {lora['base']:.0f}, 8 adapters mixed {lora['mixed']:.0f}")
print(f"ratio mixed / plain {mixed / plain:.3f} (target >= 0.8; against each plain run: "
      f"{', '.join(f'{mixed / p:.3f}' for p in plains)}), "
      f"mixed / base {mixed / lora['base']:.3f}, base / plain {lora['base'] / plain:.3f}")
if plain_phases:  # where the adapters' time goes: the prompts' prefill or the decode steps after it
    pre, dec = (sum(p[i] for p in plain_phases) / len(plain_phases) for i in (0, 1))
    b, m = phases["base"], phases["mixed"]
    print(f"phases, s until every first token / after: plain {pre:.2f} / {dec:.2f}, base {b[0]:.2f} / {b[1]:.2f}, "
          f"mixed {m[0]:.2f} / {m[1]:.2f}; time base / mixed {b[0] / m[0]:.3f} / {b[1] / m[1]:.3f}")
print("before (adc5f05): plain 9604 (one run, first process), base 10452, mixed 8184: mixed / plain 0.852, "
      "mixed / base 0.783, base / plain 1.088")
EOF
TAIL=32 run_step kbench 70 python3 benchmarks/lora_kernel_bench.py
