#!/usr/bin/env bash
# Quantized execution on an H200, one device call (~370 s; every step under its own timeout, 400 s in all):
#
#   bash benchmarks/quant_gpu.sh [--with-bf16]     (from the repo root; logs and summary.txt under $OUT)
#
# Steps, most important first (a step that runs out of time is cut and the next runs):
#   kernels     benchmarks/quant_gpu_kernels.py: the GGUF, INT4 and FP8 kernels against the contract's
#               references, then per Llama-3.1-8B shape at 1/16/256/4096 rows bf16 cuBLAS, FP8 through
#               _scaled_mm and through the Triton GEMM, INT4 AWQ; "fp8 rule: ..." is the threshold the
#               timings imply for KernelTuning.fp8_triton_max_rows
#   fp8 throughput  the 8B shape (random bf16 weights) quantized at load (quantization=fp8), 256 x 512/256,
#               fp8 KV cache (target >= 15,000 output tok/s; bf16 measured ~10,450)
#   fp8 latency     the same, batch 1, 32 in / 128 out (target <= 2.6 ms a decode token)
#   awq latency     the 8B shape rounded to INT4 AWQ at load (quantization=awq: no checkpoint needed),
#               batch 1 (target <= 2.0 ms a decode token)
#   tests       podium-cuda's INT4/FP8/GGUF kernel tests on the GPU (bf16 too; GGUF's skip without
#               gguf-py) and the CPU GGUF kernel test on this host's CPU (its VNNI path)
#   --with-bf16 also the bf16 throughput and latency runs, same flags (+130 s: past the 400 s budget)
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_quant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cuda \
  -e ./platforms/cpu -e ./bench 2>&1 | grep -v -i warning | tail -3

run_step() {  # run_step NAME TIMEOUT COMMAND...: run, log, keep going
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  grep -E "${KEEP:-.}" "$OUT/$name.log" | tail -n "${TAIL:-40}" | tee -a "$OUT/summary.txt"
}

MODEL=(--model llama-3.1-8b-shape --max-model-len 1024 --kv-cache-dtype fp8 --no-progress)
THROUGHPUT=(--dataset random --input-len 512 --output-len 256 --num-prompts 256)
LATENCY=(--batch-size 1 --input-len 32 --output-len 128 --num-iters 3)
KEEP_T="tok/s|Throughput|output|rror"
KEEP_L="latency|ms|rror"

TAIL=60 run_step kernels 110 python3 benchmarks/quant_gpu_kernels.py
KEEP=$KEEP_T TAIL=6 run_step throughput_fp8 120 podium bench throughput "${MODEL[@]}" --quantization fp8 \
  "${THROUGHPUT[@]}" --json-out "$OUT/throughput_fp8.json"
KEEP=$KEEP_L TAIL=6 run_step latency_fp8 55 podium bench latency "${MODEL[@]}" --quantization fp8 "${LATENCY[@]}" \
  --json-out "$OUT/latency_fp8.json"
KEEP=$KEEP_L TAIL=6 run_step latency_awq 65 podium bench latency "${MODEL[@]}" --quantization awq "${LATENCY[@]}" \
  --json-out "$OUT/latency_awq.json"
TAIL=4 run_step tests 40 python3 -m pytest -q -p no:cacheprovider platforms/cuda/tests/test_int4_kernels.py \
  platforms/cuda/tests/test_fp8_kernels.py platforms/cuda/tests/test_gguf_kernels.py platforms/cpu/tests/test_cpu_gguf.py
if [ "${1:-}" = "--with-bf16" ]; then
  KEEP=$KEEP_T TAIL=6 run_step throughput_bf16 120 podium bench throughput "${MODEL[@]}" "${THROUGHPUT[@]}" \
    --json-out "$OUT/throughput_bf16.json"
  KEEP=$KEEP_L TAIL=6 run_step latency_bf16 50 podium bench latency "${MODEL[@]}" "${LATENCY[@]}" \
    --json-out "$OUT/latency_bf16.json"
fi
