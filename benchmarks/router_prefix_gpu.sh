#!/usr/bin/env bash
# The router's prefix benchmark with replicas whose prefill costs: 3 replicas of llama-3.1-8b-shape
# (Llama 3.1 8B's architecture, random bf16 weights, 16 GB each) on ONE H200, in one device call of
# at most BUDGET seconds (default 530, installs included):
#   10 shared prefixes of 1,024 tokens + 256-token suffixes, 200 requests, at each of RATES requests/s
#   (Poisson arrivals; rate i's workload has seed i, the same for every group):
#     ttft         prefix-aware routing over 3 replicas
#     round-robin  over 3 fresh replicas
#     single       one replica alone: the hit-rate ceiling
#   Each of the 3 has KV room for 4.5 of the ten prefixes (288 blocks of 16 tokens, 576 MiB at the
#   8B's 128 KiB a token), so round-robin keeps evicting prefixes its replicas need again; the one
#   alone gets the three's total (864 blocks). Goals (issue 28): round-robin's mean TTFT >= 2x
#   prefix-aware routing's, whose hit rate is within 10% of the single replica's.
# Why these settings:
#   - An 8B prefill of 1,280 tokens is ~14 GFLOP a token (tens of ms on an H200), a prefix hit leaves
#     256 tokens of it: the cache decides TTFT (SmolLM2's prefill took a few ms, below the overheads).
#   - One group's replicas at a time (--one-group-at-a-time): 3 x 16 GB, never all 7 at once; each
#     group starts fresh, is warmed (untimed, other prefixes) and then runs every rate.
#   - Rates, not a burst: 200 requests at once measure how long a queue takes to drain, not what a
#     cache hit saves (the field's headline router figures, SGLang's 1.9x throughput or llm-d's 512
#     concurrent streams, come from saturated fleets); a trickle measures an idle device. As with
#     `vllm bench serve` (Poisson arrivals at a set rate) swept from light to heavy load: a miss
#     prefills 1,280 tokens (~28 ms at the ~770 TFLOP/s cuBLAS reaches at 2,048 rows), a hit 256
#     (~9 ms), so round-robin's fleet (about 2 in 3 requests miss) needs ~38 ms of the device a
#     request with its 3 decode steps: 6 to 24 requests/s should keep it ~20% to ~90% busy. The 3
#     replicas share one device; each row's gpu_busy (nvidia-smi) says how loaded it really was.
#   - Output 4 tokens: the replicas time-share one device, so every decode step of one delays the
#     others' prefills (replicas on devices of their own would not); short outputs keep TTFT about
#     prefill work while still streaming.
#   - No tokenizer: the client sends token ids below the model's vocabulary, the replicas answer ids
#     with empty text (SmolLM2's tokenizer would fail on the ids >= 49,152 random weights pick).
#   bash benchmarks/router_prefix_gpu.sh                 (from the repo root; RATES=6,12,18,24 by default)
# The image has torch, triton, transformers, numpy and prometheus-client; wheels/ (and .whl/, when
# carried) bring fastapi, uvicorn, pydantic and the rest the server and router import (Python 3.12;
# router_gpu_session.sh's header lists them).
# $OUT: summary.txt (the table, ratios per rate), prefix.log (rows as measured), logs.tar.gz (servers').
# Check on a CPU (a tiny model of the same architecture, the small workload; ~4 min on 2 shared cores):
#   DEVICE=cpu bash benchmarks/router_prefix_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
BUDGET=${BUDGET:-530}
OUT=${OUT:-/tmp/podium_router_prefix_out}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
logs=$(mktemp -d)
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
  links=""
  for dir in wheels .whl; do ls "$dir"/*.whl >/dev/null 2>&1 && links="$links --find-links $dir"; done
  if [ -n "$links" ]; then
    python3 -m pip install -q --no-index $links fastapi uvicorn httpx httptools uvloop 2>&1 | grep -v -i warning | tail -3
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cpu \
    -e ./platforms/cuda -e ./server -e ./bench -e ./router 2>&1 | grep -v -i warning | tail -3
  MODEL=${MODEL:-llama-3.1-8b-shape}
  RATES=${RATES:-6,12,18,24}
  extra="--gpu-busy --warmup 6"
  serve_extra="--dtype bfloat16"
else
  # Llama 3.1 8B's architecture and vocabulary at a tiny width: the same code paths, CPU-sized
  MODEL=${MODEL:-$logs/tiny-llama/config.json}
  mkdir -p "$(dirname "$MODEL")"
  python3 -c "import json, sys; from podium.shapes import NAMED_SHAPES; json.dump({**NAMED_SHAPES['llama-3.1-8b-shape'],
    'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 4,
    'num_key_value_heads': 2, 'head_dim': 16}, open(sys.argv[1], 'w'))" "$MODEL" || exit 1
  RATES=${RATES:-2,4}
  extra="--small --warmup 4"
  serve_extra=""
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
left=$(( BUDGET - ($(date +%s) - start) - 20 ))  # 20 s: stopping the last replicas, the archive
echo "== prefix: $MODEL on $DEVICE, rates $RATES, output ${OUTPUT_LEN:-4}, $left s for the runs" | tee -a "$OUT/summary.txt"
timeout -k 10 "$(( left + 10 ))" python3 benchmarks/router_bench.py prefix --serve-args "$MODEL --device $DEVICE \
  --max-num-seqs 32 $serve_extra" --one-group-at-a-time --rates "$RATES" --num-prompts 200 --output-len "${OUTPUT_LEN:-4}" \
  --time-limit "$left" $extra --log-dir "$logs/prefix-logs" --summary "$OUT/summary.txt" > "$OUT/prefix.log" 2>&1
rc=$?
echo "== prefix: rc $rc, $(( $(date +%s) - start )) s in all" | tee -a "$OUT/summary.txt"
[ "$rc" -ne 0 ] && grep -e "^measured" -e Error -e "skipped" "$OUT/prefix.log" | tail -n 12 | tee -a "$OUT/summary.txt"
tar czf "$OUT/logs.tar.gz" -C "$logs" . && rm -rf "$logs"
exit "$rc"
