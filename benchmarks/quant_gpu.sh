#!/usr/bin/env bash
# Quantized execution on an H200, one device call: kernels against their references and timed against
# bf16 at Llama-3.1-8B's linear shapes, then the 8B engine runs, bf16 against online FP8 W8A8
# (quantization=fp8), same command otherwise, interleaved:
#
#   bash benchmarks/quant_gpu.sh            (from the repo root; results and summary.txt under $OUT)
#
# Steps: install (editable, no deps), kernels (benchmarks/quant_gpu_kernels.py: GGUF Triton kernels and
# fp8 _scaled_mm checked, then timed at 1 and 256 rows), tests (podium-cuda's GGUF kernel tests, which
# skip without gguf-py), throughput (256 x 512/256, fp8 KV cache both), latency (batch 1, 32 in / 128 out).
# The model is a named shape with random weights (no network). INT4 AWQ is not implemented yet.
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_quant_out}
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
  grep -E "${KEEP:-.}" "$OUT/$name.log" | tail -n "${TAIL:-40}" | tee -a "$OUT/summary.txt"
}

MODEL=(--model llama-3.1-8b-shape --max-model-len 1024 --kv-cache-dtype fp8 --no-progress)
run_step kernels 120 python3 benchmarks/quant_gpu_kernels.py
TAIL=3 run_step tests 60 python3 -m pytest -q platforms/cuda/tests/test_gguf_kernels.py
for quant in none fp8; do
  flags=(); [ "$quant" = fp8 ] && flags=(--quantization fp8)
  KEEP="tok/s|Throughput|output|error|Error" TAIL=6 run_step "throughput_$quant" 130 podium bench throughput \
    "${MODEL[@]}" "${flags[@]}" --dataset random --input-len 512 --output-len 256 --num-prompts 256 \
    --json-out "$OUT/throughput_$quant.json"
  KEEP="latency|ms|error|Error" TAIL=6 run_step "latency_$quant" 70 podium bench latency "${MODEL[@]}" \
    "${flags[@]}" --batch-size 1 --input-len 32 --output-len 128 --num-iters 3 --json-out "$OUT/latency_$quant.json"
done
