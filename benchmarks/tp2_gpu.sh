#!/usr/bin/env bash
# Tensor parallelism on two H200s of one host (issue 27), one device call (NVLink multicast stays off).
#
#   bash benchmarks/tp2_gpu.sh [STEP ...]       (from the repo root; default: check allreduce throughput latency big)
#
# Steps:
#   check       TP=2 == TP=1 greedy tokens, fixed-seed random Llama-3.2-1B and Llama-3.1-8B shapes,
#               bf16 and float32, CUDA graphs on and off (benchmarks/tp_check.py; bf16 reports the share)
#   allreduce   NCCL all-reduce time of one layer's output [tokens, 4096] / [tokens, 8192] bf16 (2 ranks)
#   throughput  Llama-3.1-8B shape, 256 x 512/256: TP=2 vs TP=1 output tok/s, same call, and the ratio
#   latency     batch-1 decode ms/token at TP=2 vs TP=1 (8B shape)
#   big         Llama-3.1-70B shape (bf16, ~141 GB: one H200 cannot hold it) at TP=2: 64 x 512/256 out
#               tok/s and batch-1 ms/token
# Needs torch with CUDA, triton, transformers, safetensors, pluggy, numpy; no network (named shapes).
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/podium_tp2_out}
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
  tail -n "${TAIL:-6}" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}

rate() {  # rate FILE KEY: a number from a bench JSON
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results']['podium']; print(r.get(sys.argv[2]))" "$1" "$2" 2>/dev/null
}

steps=${*:-check allreduce throughput latency big}
for s in $steps; do
  case $s in
    check)
      TAIL=12 run_step check_1b 200 python3 benchmarks/tp_check.py --tp 2 --shape llama-3.2-1b-shape \
        --dtype bfloat16 float32 --graphs on off --json-out "$OUT/check_1b.json"
      TAIL=4 run_step check_8b 240 python3 benchmarks/tp_check.py --tp 2 --shape llama-3.1-8b-shape \
        --dtype bfloat16 float32 --graphs on --json-out "$OUT/check_8b.json" ;;
    allreduce)
      TAIL=12 run_step allreduce 120 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/tp_allreduce.py ;;
    throughput)
      for tp in 1 2; do
        TAIL=3 run_step "throughput_tp$tp" 240 podium bench throughput --model llama-3.1-8b-shape --max-model-len 1024 \
          --dataset random --input-len 512 --output-len 256 --num-prompts 256 -tp $tp --no-progress \
          --json-out "$OUT/throughput_tp$tp.json"
      done
      a=$(rate "$OUT/throughput_tp1.json" output_tokens_per_s); b=$(rate "$OUT/throughput_tp2.json" output_tokens_per_s)
      echo "8B 256 x 512/256 out tok/s: TP=1 $a, TP=2 $b, ratio $(python3 -c "print(round($b/$a, 3))" 2>/dev/null)" \
        | tee -a "$OUT/summary.txt" ;;
    latency)
      for tp in 1 2; do
        TAIL=4 run_step "latency_tp$tp" 180 podium bench latency --model llama-3.1-8b-shape --max-model-len 1024 \
          --batch-size 1 --input-len 128 --output-len 128 -tp $tp --json-out "$OUT/latency_tp$tp.json"
      done ;;
    big)
      TAIL=3 run_step throughput_70b_tp2 360 podium bench throughput --model llama-3.1-70b-shape --max-model-len 1024 \
        --dataset random --input-len 512 --output-len 256 --num-prompts 64 -tp 2 --no-progress \
        --json-out "$OUT/throughput_70b_tp2.json"
      TAIL=4 run_step latency_70b_tp2 240 podium bench latency --model llama-3.1-70b-shape --max-model-len 1024 \
        --batch-size 1 --input-len 128 --output-len 64 -tp 2 --json-out "$OUT/latency_70b_tp2.json" ;;
    *) echo "unknown step $s" | tee -a "$OUT/summary.txt" ;;
  esac
done
