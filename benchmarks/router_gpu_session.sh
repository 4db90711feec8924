#!/usr/bin/env bash
# The router's benchmarks on one H200 in ONE device call of at most BUDGET seconds (default 530):
#   overhead  one replica behind the router vs direct: sharegpt-like, 1,000 requests at once (or at
#             OVERHEAD_RATE requests/s), an untimed warm-up, then OVERHEAD_ROUNDS (2) alternating rounds, or with
#             OVERHEAD_PAIRED=1 rounds of both paths at once (half the rate each: the replica's drift cancels) (goal: >= 97% of direct output throughput,
#             <= 2 ms added p50 TTFT)
#   prefix    10 prefixes of 1,024 tokens + 256-token suffixes, 200 requests, over 3 replicas that
#             each have KV room for 4.5 of the prefixes (cache pressure): ttft vs round-robin vs one
#             replica with the three's total cache (the hit-rate ceiling)
#   mixed     the GPU replica + a CPU replica on the host under a rising request rate: both
#             policies' p99 TTFT and the CPU replica's share
# Each step has its own time limit (a step that overruns is stopped with its replicas and the next
# one runs; rows measured before the limit are in its log), all within BUDGET from the start.
#   bash benchmarks/router_gpu_session.sh [overhead] [prefix] [mixed]      (from the repo root)
# Replicas are SmolLM2's architecture with random weights and its tokenizer (no GGUF travels):
#   before the call: python benchmarks/structured_cost.py --export-tokenizer wheels/smollm2-tokenizer
# The image has torch, triton, transformers (and its tqdm), safetensors, pluggy, numpy and prometheus-client;
# wheels/ (carried with the tree) brings what the server, router and client import besides, for Python 3.12:
# fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection typing-extensions
# opentelemetry-api anyio idna uvicorn click h11 httpx httpcore certifi httptools uvloop (uvicorn runs its loop
#   when installed, as it is with podium-server and podium-router: without it both paths measure asyncio's own loop)
#   (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels ...)
# Tables go to $OUT/summary.txt, each step's log to $OUT/STEP.log, server logs to $OUT/STEP-logs/.
# Check on a CPU (small workloads, each limit LIMIT_SCALE times longer: a few minutes on 2 cores):
#   DEVICE=cpu SMALL=1 LIMIT_SCALE=3 BUDGET=1600 TOKENIZER=DIR bash benchmarks/router_gpu_session.sh
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
BUDGET=${BUDGET:-530}
OUT=${OUT:-/tmp/podium_router_out}
DEVICE=${DEVICE:-cuda}
TOKENIZER=${TOKENIZER:-wheels/smollm2-tokenizer}
small=${SMALL:+--small}
mkdir -p "$OUT"
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
  if ls wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --find-links wheels fastapi uvicorn httpx httptools uvloop 2>&1 | grep -v -i warning | tail -3
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cpu \
    -e ./platforms/cuda -e ./server -e ./bench -e ./router 2>&1 | grep -v -i warning | tail -3
fi
if [ ! -f "$TOKENIZER/tokenizer.json" ] && [ ! -f "$TOKENIZER/tokenizer_config.json" ]; then
  echo "no tokenizer folder at $TOKENIZER: see the header" | tee -a "$OUT/summary.txt"
  exit 1
fi
MODEL="smollm2-135m-shape --tokenizer $TOKENIZER"
run_step() {  # run_step NAME LIMIT ARGS...: router_bench.py ARGS within LIMIT s and what is left of BUDGET
  local name=$1 limit=$(( $2 * ${LIMIT_SCALE:-1} )); shift 2
  local left=$(( BUDGET - ($(date +%s) - start) - 10 ))  # 10 s: the stop of an overrunning step
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo "== $name: skipped, $left s left of the budget" | tee -a "$OUT/summary.txt"
    return
  fi
  local begin=$(date +%s)
  timeout -k 10 "$limit" python3 benchmarks/router_bench.py "$@" $small --log-dir "$OUT/$name-logs" --summary "$OUT/summary.txt" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - begin )) s (limit $limit s)" | tee -a "$OUT/summary.txt"
  [ "$rc" -ne 0 ] && grep -e "^measured" -e Error "$OUT/$name.log" | tail -n 8 | tee -a "$OUT/summary.txt"
}
steps=${*:-overhead prefix mixed}
for step in $steps; do
  case $step in
    # one replica for the warm-up and all four timed runs; graphs for up to 256 sequences (the load)
    # OVERHEAD_RATE: requests/s (Poisson; default inf, all at once: the throughput side of the goal);
    # at a rate the replica keeps up with, p50 TTFT is the path's own cost, not a queue's (1,000 at
    # 30/s: five rounds of 33 s with the warm-up, OVERHEAD_LIMIT=230)
    overhead) run_step overhead "${OVERHEAD_LIMIT:-170}" overhead --serve-args "$MODEL --device $DEVICE --max-num-seqs 256" \
                --num-prompts 1000 --rounds "${OVERHEAD_ROUNDS:-2}" --request-rate "${OVERHEAD_RATE:-inf}" \
                ${OVERHEAD_PAIRED:+--paired} ;;
    # seven replicas started at once (each policy its own fresh caches), 64 sequences each
    prefix) run_step prefix 150 prefix --serve-args "$MODEL --device $DEVICE --max-num-seqs 64" \
              --num-prompts 200 --request-rate 16 --output-len 16 ;;
    # the CPU replica gets 12 of the host's 16 cores: the rest serve the GPU replica, router and client
    mixed) run_step mixed 170 mixed --serve-args "$MODEL --max-num-seqs 64" --fast-args "--device $DEVICE" \
             --slow-args "--device cpu" --slow-env "OMP_NUM_THREADS=12" --rates 4,16,64 --num-prompts 100 \
             --input-len 512 --output-len 32 ;;
    *) echo "unknown step $step (overhead, prefix, mixed)" | tee -a "$OUT/summary.txt" ;;
  esac
done
echo "== total $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
