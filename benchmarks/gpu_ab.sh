#!/usr/bin/env bash
# One device call on an H200: this tree's CUDA correctness tests, then an A/B of the 8B throughput run
# (256 x 512/256, fp8 KV cache) between a base tree and this tree, same command, interleaved; the
# ratio this/base goes to $OUT/summary.txt with each step's tail.
#
#   bash benchmarks/gpu_ab.sh [STEP ...]          (from the repo root; default: tests ab)
#
# The base tree: BASE_TREE=folder, or BASE_REF=commit to extract with git (needs .git on the device).
# Without .git there, make it before the call, at the repo root (untracked, so it travels):
#   git archive --prefix=ab_base/ <commit> | tar -x        (then BASE_TREE=ab_base)
# Steps: tests (the engine on CUDA and on the ROCm code path, the kernels' quick suite, the import
# and option checks), kernel_tests (the whole CUDA kernel suite, several minutes), ab (the A/B).
# ROUNDS=2 runs the A/B as A B A B (default 1: A B). Needs torch with CUDA, triton, transformers,
# safetensors, pluggy, numpy (no network: the model is a named shape with random weights).
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_gpu_out}
mkdir -p "$OUT"
HERE=$(pwd)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"

install_tree() {  # install_tree FOLDER: make FOLDER's distributions the installed ones (editable, no deps)
  local bench=()
  [ -d "$1/bench" ] && bench=(-e "$1/bench")  # podium-bench (trees before its move ship the bench in core)
  python3 -m pip install -q --no-deps --no-build-isolation -e "$1/plugin_api" -e "$1/core" -e "$1/platforms/cpu" \
    -e "$1/platforms/cuda" -e "$1/platforms/rocm" "${bench[@]}" 2>&1 | { grep -v -i warning || true; } | tail -3
}

run_step() {  # run_step NAME TIMEOUT COMMAND...: run, log, keep going
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-6}" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}

base_tree() {
  if [ -n "$BASE_TREE" ]; then echo "$BASE_TREE"; return; fi
  local ref=${BASE_REF:?set BASE_TREE=folder or BASE_REF=commit (see the header)}
  local dir=/tmp/podium_ab_base
  rm -rf "$dir" && mkdir -p "$dir" && git archive "$ref" | tar -x -C "$dir" && echo "$dir"
}

throughput() {  # throughput NAME: the 8B 256 x 512/256 fp8 run of the installed tree, JSON to $OUT/NAME.json
  TAIL=3 run_step "$1" 240 podium bench throughput --model llama-3.1-8b-shape --max-model-len 1024 --dataset random \
    --input-len 512 --output-len 256 --num-prompts 256 --kv-cache-dtype fp8 --no-progress --json-out "$OUT/$1.json"
}

ab() {
  local base
  base=$(base_tree) || { echo "== ab: no base tree" | tee -a "$OUT/summary.txt"; return; }
  for round in $(seq 1 "${ROUNDS:-1}"); do
    install_tree "$base" && throughput "base_$round"
    install_tree "$HERE" && throughput "this_$round"
  done
  python3 - "$OUT" "${ROUNDS:-1}" <<'EOF' | tee -a "$OUT/summary.txt"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rate(name):
    try:
        return json.load(open(f"{out}/{name}.json"))["results"]["podium"]["output_tokens_per_s"]
    except (OSError, KeyError, ValueError):
        return None
base = [rate(f"base_{r}") for r in range(1, rounds + 1)]
this = [rate(f"this_{r}") for r in range(1, rounds + 1)]
print("8B 256 x 512/256 fp8 output tok/s: base", base, "this", this)
if None not in base + this:
    print(f"ratio this / base (medians): {statistics.median(this) / statistics.median(base):.3f}")
EOF
}

steps=${*:-tests ab}
install_tree "$HERE"
for s in $steps; do
  case $s in
    tests)
      run_step engine_cuda 240 python3 -m pytest tests/test_engine_cuda.py tests/test_runner_graph_path.py \
        tests/test_runner_plan.py -q -p no:cacheprovider -rfE
      run_step engine_rocm_path 240 env PODIUM_ROCM_FORCE_ON_CUDA=1 PODIUM_TEST_GPU_DEVICE=rocm \
        python3 -m pytest tests/test_engine_cuda.py -q -p no:cacheprovider -rfE
      run_step cuda_quick 300 python3 -m pytest platforms/cuda/tests/test_import.py platforms/cuda/tests/test_gemv.py \
        platforms/cuda/tests/test_kv_write.py platforms/cuda/tests/test_fused_ops.py \
        platforms/cuda/tests/test_graph_replay.py -q -p no:cacheprovider -rfE ;;
    kernel_tests) run_step kernel_tests 590 python3 -m pytest platforms/cuda/tests -q -p no:cacheprovider -rfE ;;
    ab) ab; install_tree "$HERE" ;;
    *) echo "unknown step $s" | tee -a "$OUT/summary.txt" ;;
  esac
done
