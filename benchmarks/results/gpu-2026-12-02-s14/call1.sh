#!/usr/bin/env bash
# session 14 call 1: decode attention with block ids from table entries held in registers
# (the tilings' fifth field, table_blocks), which lets Triton's pipeliner double-buffer the key/value tiles: the
# engine's batch-256 decode launch over tilings, the kernel tests of the new path on the GPU, the
# 8B 512/256 fp8 run alternated default / fastest variant, then prefill tilings with and without it
FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
OUT=$FINAL TAIL=0 bash benchmarks/gpu_session.sh engine_decode_kernels > /dev/null 2>&1
grep "engine decode" $FINAL/engine_decode_kernels.log >> $FINAL/summary.txt
# as run, A was the defaults of the time and B the bench's pick, fp8_decode=16/16/1/5 with the ids in
# registers; in today's syntax (the fields became the tilings' fifth field, and the defaults moved):
OLD="fp8_decode=16/32/1/3,fp8_prefill=none,prefill=128/64/4/3"
BEST="$OLD,fp8_decode=16/16/1/5/64,decode=16/64/4/2/64"
timeout 200 python3 -m pytest platforms/cuda/tests/test_paged_attention.py platforms/cuda/tests/test_fp8_cache.py \
  -k "registers or table or attention_over" -q -p no:cacheprovider -rfE > $FINAL/table_tests.log 2>&1
el "table tests: $(tail -1 $FINAL/table_tests.log)"
run() {  # run NAME [ENV]
  timeout 90 env $2 podium bench throughput --model llama-3.1-8b-shape --max-model-len 1024 --no-progress \
    --dataset random --input-len 512 --output-len 256 --num-prompts 256 --kv-cache-dtype fp8 --json-out $FINAL/$1.json > $FINAL/$1.log 2>&1
  el "$1 ${2:-default}: $(grep 'Output tokens/s' $FINAL/$1.log || tail -3 $FINAL/$1.log)"
}
run tp_A1 "PODIUM_CUDA_TUNING=$OLD"; run tp_B1 "PODIUM_CUDA_TUNING=$BEST"; run tp_A2 "PODIUM_CUDA_TUNING=$OLD"
run tp_B2 "PODIUM_CUDA_TUNING=$BEST"
if [ $(( $(date +%s) - T0 )) -lt 400 ]; then
  OUT=$FINAL TAIL=0 timeout 150 bash benchmarks/gpu_session.sh prefill_kernels > /dev/null 2>&1
  grep "^prefill" $FINAL/prefill_kernels.log >> $FINAL/summary.txt
fi
el done
