#!/usr/bin/env bash
# The router's benchmarks on one H200 (one device call, ~4-5 min): router overhead against direct,
# the prefix-repetition workload over 3 replicas sharing the GPU (ttft vs round-robin vs one replica),
# and a mixed fleet (the GPU replica + a CPU replica on the host) under a rising request rate.
#   bash benchmarks/router_gpu_session.sh [overhead] [prefix] [mixed]     (default: all three)
# Needs fastapi, uvicorn and httpx in the image (the lead carries their wheels); the tables go to
# $OUT/summary.txt, each step's log to $OUT/STEP.log.
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_router_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cpu \
  -e ./platforms/cuda -e ./server -e ./bench -e ./router 2>&1 | grep -v -i warning | tail -3
MODEL=${MODEL:-smollm2-135m-instruct}
run_step() {  # run_step NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" python3 benchmarks/router_bench.py "$@" --log-dir "$OUT/$name-logs" > "$OUT/$name.log" 2>&1
  echo "== $name: rc $?, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
}
steps=${*:-overhead prefix mixed}
for step in $steps; do
  case $step in
    overhead) run_step overhead 300 overhead --serve-args "$MODEL --device cuda --max-num-seqs 256" \
                --num-prompts 1000 --rounds 2 ;;
    prefix) run_step prefix 300 prefix --serve-args "$MODEL --device cuda --num-kv-blocks 20000" \
              --num-prompts 200 --request-rate 16 --output-len 16 ;;
    mixed) run_step mixed 300 mixed --serve-args "$MODEL --max-num-seqs 64" --fast-args "--device cuda" \
             --slow-args "--device cpu" --rates 4,16,64 --num-prompts 100 --input-len 512 --output-len 32 ;;
    *) echo "unknown step $step (overhead, prefix, mixed)" | tee -a "$OUT/summary.txt" ;;
  esac
done
