#!/usr/bin/env bash
# Quantized execution on an H200, one device call (<= 480 s: every step under its own timeout, cut to
# what is left of the budget; logs and summary.txt under $OUT):
#
#   bash benchmarks/quant_gpu.sh            (from the repo root; nothing to carry but the repo)
#
# Steps, most important first (a step that runs out of time is cut and the next runs):
#   kernels     benchmarks/quant_gpu_kernels.py: PASS / FAIL of every new kernel against the references
#               (one-launch FP8 quantization with each prologue, FP8 GEMV on tensor and CUDA cores,
#               quantize + _scaled_mm, INT4 GEMVs, old INT4); microseconds per 8B projection at
#               1/4/16/256/4096 rows of bf16 cuBLAS / bf16 GEMV / FP8 old / FP8 new quantize +
#               _scaled_mm / _scaled_mm alone / FP8 GEMV / INT4 old / INT4 new, then with each
#               projection's prologue, one decoder layer's linears per path ("layer rows ..."), a tile
#               sweep at one row, and the KernelTuning values the timings imply ("tuning: ...")
#   latency_awq     the 8B shape rounded to INT4 AWQ at load (quantization=awq), batch 1, 32 in / 128
#               out, fp8 KV cache (target <= 2.0 ms a decode token; before: 6.21)
#   throughput_fp8  the 8B shape quantized at load (quantization=fp8), 256 x 512/256 random prompts
#               (target >= 15,000 out tok/s; before 9,482, bf16 weights 11,230 with the same fp8 cache)
#   latency_fp8     the same model at batch 1, as latency_awq (target <= 2.6 ms; bf16 4.30)
#   adopted     when the kernels step's tuning differs from the defaults where batch 1 or 256 rows
#               feel it: the latency (and throughput) runs again with PODIUM_CUDA_TUNING set to it
#   tests       the new kernels' tests on the GPU (bf16 cases and the GPU-only ones), if time is left
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_quant_out}
BUDGET=${BUDGET:-475}
START=$(date +%s)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cuda \
  -e ./platforms/cpu -e ./bench 2>&1 | grep -v -i warning | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

run_step() {  # run_step NAME TIMEOUT COMMAND...: run (cut to the budget left), log, keep going
  local name=$1 limit=$2; shift 2
  local remaining=$(left)
  if [ "$remaining" -lt 20 ]; then
    echo "== $name: skipped, ${remaining} s of the budget left" | tee -a "$OUT/summary.txt"
    return
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  echo "== $name: $*" >> "$OUT/summary.txt"
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  grep -E "${KEEP:-.}" "$OUT/$name.log" | tail -n "${TAIL:-40}" | tee -a "$OUT/summary.txt"
}

MODEL=(--model llama-3.1-8b-shape --max-model-len 1024 --kv-cache-dtype fp8 --no-progress)
THROUGHPUT=(--dataset random --input-len 512 --output-len 256 --num-prompts 256)
LATENCY=(--batch-size 1 --input-len 32 --output-len 128 --num-iters 3)
KEEP_T="tok/s|Throughput|output|rror"
KEEP_L="Decode per token|Prefill|rror"

KEEP="check|layer|sweep|rule|tuning|rror|Traceback" TAIL=80 run_step kernels 200 \
  python3 benchmarks/quant_gpu_kernels.py
grep -E "^time" "$OUT/kernels.log" > "$OUT/kernel_times.txt" 2>/dev/null
KEEP=$KEEP_L TAIL=6 run_step latency_awq 75 podium bench latency "${MODEL[@]}" --quantization awq "${LATENCY[@]}" \
  --json-out "$OUT/latency_awq.json"
KEEP=$KEEP_T TAIL=6 run_step throughput_fp8 130 podium bench throughput "${MODEL[@]}" --quantization fp8 \
  "${THROUGHPUT[@]}" --json-out "$OUT/throughput_fp8.json"
KEEP=$KEEP_L TAIL=6 run_step latency_fp8 65 podium bench latency "${MODEL[@]}" --quantization fp8 "${LATENCY[@]}" \
  --json-out "$OUT/latency_fp8.json"

# The measured tuning, where it changes what batch 1 (one-row GEMVs) or 256 rows (the fused
# quantization) run: fp8_gemv_dot, fp8_fused_quant, or a GEMV threshold of 0.
MEASURED=$(grep -oE "PODIUM_CUDA_TUNING=[^ ]+" "$OUT/kernels.log" | tail -1 | cut -d= -f2-)
if [ -n "$MEASURED" ]; then
  echo "measured tuning: $MEASURED" | tee -a "$OUT/summary.txt"
  if echo "$MEASURED" | grep -qE "fp8_gemv_max_rows=0|fp8_gemv_dot=0|int4_gemv_max_rows=0"; then
    KEEP=$KEEP_L TAIL=6 run_step adopted_latency_awq 75 env PODIUM_CUDA_TUNING="$MEASURED" podium bench latency \
      "${MODEL[@]}" --quantization awq "${LATENCY[@]}" --json-out "$OUT/adopted_latency_awq.json"
    KEEP=$KEEP_L TAIL=6 run_step adopted_latency_fp8 65 env PODIUM_CUDA_TUNING="$MEASURED" podium bench latency \
      "${MODEL[@]}" --quantization fp8 "${LATENCY[@]}" --json-out "$OUT/adopted_latency_fp8.json"
  fi
  if echo "$MEASURED" | grep -q "fp8_fused_quant=0"; then
    KEEP=$KEEP_T TAIL=6 run_step adopted_throughput_fp8 130 env PODIUM_CUDA_TUNING="$MEASURED" podium bench \
      throughput "${MODEL[@]}" --quantization fp8 "${THROUGHPUT[@]}" --json-out "$OUT/adopted_throughput_fp8.json"
  fi
fi
TAIL=6 run_step tests 90 python3 -m pytest -q -p no:cacheprovider platforms/cuda/tests/test_fp8_quant.py \
  platforms/cuda/tests/test_fp8_gemv.py platforms/cuda/tests/test_int4_gemv.py platforms/cuda/tests/test_fused_linear.py \
  platforms/cuda/tests/test_fp8_kernels.py -k "bfloat16 or scaled_mm or either_path"
echo "== total $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
