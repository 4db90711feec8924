#!/usr/bin/env bash
# Multi-LoRA on an H200, one device call (<= 540 s): results under $OUT, key lines in $OUT/summary.txt.
#   bash benchmarks/lora_gpu.sh            (from the repo root)
# Steps (each under its own timeout, 460 s in all, plus the install):
#   kernels  the Triton SGMV shrink/expand kernels against the contract's reference on the GPU
#            (platforms/cuda/tests/test_lora_kernel.py: 8B shapes, bf16 and float32, a graph replayed
#            for new slot mixes)
#   engine   a tiny random Llama with 4 adapters over 2 slots, float32: the CUDA engine (decode graphs
#            with the adapters in them, and without them for base-only steps) gives the CPU platform's
#            greedy tokens (benchmarks/lora_gpu_check.py)
#   plain    llama-3.1-8b-shape (random bf16 weights), 256 requests x 512 in / 256 out, the base model in
#            an engine without LoRA (its own process)
#   lora     the same requests in the LoRA engine (8 slots of rank 16): the base model alone, then every
#            request with one of 8 random rank-16 adapters on all 7 projections, round-robin (one process)
#   kbench   the kernels' time per 8B decoder layer against its base GEMMs, decode (graph mapping,
#            8 adapters and none) and prefill, under a few decode tilings (benchmarks/lora_kernel_bench.py)
#            (run last, so the throughput lines come first in the summary)
# The throughput lines give the ratios: mixed / plain (the target is >= 0.8), mixed / base and
# base / plain, next to the run before these kernels and graphs (78741b2, 2026-12-03).
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_lora_gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cuda -e ./bench \
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
TAIL=4 run_step kernels 60 python3 -m pytest -q -p no:cacheprovider -rfE platforms/cuda/tests/test_lora_kernel.py
TAIL=4 run_step engine 60 python3 benchmarks/lora_gpu_check.py --device cuda
KEEP="tok/s|ratio|Error|error" run_step plain 90 "${BENCH[@]}" --only plain --json-out "$OUT/plain.json"
KEEP="tok/s|ratio|Error|error" run_step lora 150 "${BENCH[@]}" --only lora --json-out "$OUT/lora.json"
python3 - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
try:
    plain = json.loads((out / "plain.json").read_text())["median"]["plain"]
    lora = json.loads((out / "lora.json").read_text())["median"]
except (OSError, KeyError, ValueError) as exc:
    sys.exit(f"no ratio: {exc}")
print(f"8B 256 x 512/256, out tok/s: plain {plain:.0f}, LoRA engine base {lora['base']:.0f}, "
      f"8 adapters mixed {lora['mixed']:.0f}")
print(f"ratio mixed / plain {lora['mixed'] / plain:.3f} (target >= 0.8), mixed / base {lora['mixed'] / lora['base']:.3f}, "
      f"base / plain {lora['base'] / plain:.3f}")
print("before (78741b2): plain 10292, base 9628, mixed 7733: mixed / plain 0.751, mixed / base 0.803, base / plain 0.935")
EOF
TAIL=20 run_step kbench 100 python3 benchmarks/lora_kernel_bench.py
