#!/usr/bin/env bash
# One device call on an H200 for the model-breadth work (MoE, Gemma 2/3, Phi-3, rope): correctness on
# the GPU, the fused MoE kernel at real sizes, and MoE throughput against transformers. Logs under $OUT,
# a short summary in $OUT/summary.txt.
#   bash benchmarks/models_gpu.sh [STEP ...]      (from the repo root; default: every step, ~5 min)
# Steps:
#   moe_kernel_tests  platforms/cuda/tests/test_moe_kernel.py: the Triton kernel against the reference
#   arch_tests        tests/test_architectures.py on cuda: every new architecture's greedy tokens = transformers'
#   moe_kernel_bench  benchmarks/moe_gpu.py --sweep: time, TB/s and TFLOP/s at batch 1 / 64 / 256 / 4096
#   mixtral / qwen3moe  256 x 512/256 out tok/s, Podium (bf16); then transformers on the same shape in its
#                    own process (the two models do not fit together) on 32 prompts x 512/32, batch 32
#                    (transformers at 256 x 256 would take minutes); the ratio of out tok/s is printed
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cpu -e ./bench \
  -e ./platforms/cuda -e ./platforms/rocm 2>&1 | grep -v -i warning | tail -3
run_step() {  # run_step NAME TIMEOUT COMMAND...: run, log, keep going
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-14}" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
out_tok_s() {  # out_tok_s JSON BACKEND
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['results'][sys.argv[2]]['output_tokens_per_s'])" "$1" "$2"
}
throughput() {  # throughput NAME SHAPE: Podium 256 x 512/256, then transformers 32 x 512/32
  local name=$1 shape=$2 common="--model $2 --max-model-len 1024 --dataset random --input-len 512 --no-progress"
  run_step ${name}_podium 240 podium bench throughput $common --output-len 256 --num-prompts 256 \
    --json-out "$OUT/${name}_podium.json"
  run_step ${name}_hf 240 podium bench throughput $common --output-len 32 --num-prompts 32 --backend hf \
    --hf-batch-size 32 --json-out "$OUT/${name}_hf.json"
  if [ -f "$OUT/${name}_podium.json" ] && [ -f "$OUT/${name}_hf.json" ]; then
    local ours theirs
    ours=$(out_tok_s "$OUT/${name}_podium.json" podium) theirs=$(out_tok_s "$OUT/${name}_hf.json" hf)
    python3 -c "import sys; o, t = map(float, sys.argv[2:]); print(f'{sys.argv[1]}: Podium {o:,.0f} out tok/s (256 x 512/256), transformers {t:,.0f} (32 x 512/32): {o / t:.1f}x')" \
      "$shape" "$ours" "$theirs" | tee -a "$OUT/summary.txt"
  fi
}
steps=${*:-moe_kernel_tests arch_tests moe_kernel_bench mixtral qwen3moe}
for s in $steps; do
  case $s in
    moe_kernel_tests) run_step $s 240 python3 -m pytest platforms/cuda/tests/test_moe_kernel.py -q -p no:cacheprovider -rfE ;;
    arch_tests) run_step $s 300 python3 -m pytest tests/test_architectures.py -q -p no:cacheprovider -rfE -k cuda ;;
    moe_kernel_bench) TAIL=30 run_step $s 300 python3 benchmarks/moe_gpu.py --sweep --tokens 1 64 256 4096 ;;
    mixtral) throughput mixtral mixtral-8x7b-shape ;;
    qwen3moe) throughput qwen3moe qwen3-30b-a3b-shape ;;
    *) echo "unknown step $s" | tee -a "$OUT/summary.txt" ;;
  esac
done
