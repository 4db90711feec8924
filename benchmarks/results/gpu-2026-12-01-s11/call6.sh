#!/usr/bin/env bash
# session 11 call 6: the token budget (max_num_batched_tokens) of the 8B 512/256 fp8 run, alternated
W=/tmp/w6; mkdir -p $W; FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
OUT=$W/i timeout 60 bash benchmarks/gpu_session.sh none > $W/install.log 2>&1; el install
run() {  # run NAME BUDGET
  timeout 100 podium bench throughput --model llama-3.1-8b-shape --max-model-len 1024 --no-progress --dataset random \
    --input-len 512 --output-len 256 --num-prompts 256 --kv-cache-dtype fp8 --max-num-batched-tokens $2 \
    --json-out $W/$1.json > $W/$1.log 2>&1
  el "$1 (budget $2): $(grep 'Output tokens/s' $W/$1.log)"
}
set -- ${RUNS:-a1 8192 b1 16384 a2 8192 b2 16384}
while [ $# -ge 2 ]; do run $1 $2; shift 2; done
cd $W && tar czf $FINAL/call6.tar.gz . ; el done
