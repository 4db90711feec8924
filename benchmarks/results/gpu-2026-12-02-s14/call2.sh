#!/usr/bin/env bash
# session 14 call 2: the engine's decode launch over tilings with / without block ids in registers
# (call 1 lost this table: a second gpu_session.sh run overwrote its bundle), then the 8B 512/256
# fp8 run alternated: default / block ids in registers for decode and prefill at the default tilings
FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/e2e.txt; }
OUT=$FINAL TAIL=0 bash benchmarks/gpu_session.sh engine_decode_kernels > /dev/null 2>&1  # (today's variant list)
run() {  # run NAME [ENV]
  timeout 90 env $2 podium bench throughput --model llama-3.1-8b-shape --max-model-len 1024 --no-progress \
    --dataset random --input-len 512 --output-len 256 --num-prompts 256 --kv-cache-dtype fp8 --json-out $FINAL/$1.json > $FINAL/$1.log 2>&1
  el "$1 ${2:-default}: $(grep 'Output tokens/s' $FINAL/$1.log || tail -3 $FINAL/$1.log)"
}
# as run: A the defaults of the time, C decode_table_blocks=64,prefill_table_blocks=64 (fields since
# folded into the tilings' fifth field); the same settings in today's syntax:
A="PODIUM_CUDA_TUNING=fp8_decode=16/32/1/3,fp8_prefill=none,prefill=128/64/4/3"
C="PODIUM_CUDA_TUNING=fp8_decode=16/32/1/3/64,decode=16/64/4/2/64,fp8_prefill=none,prefill=128/64/4/3/64"
run tp_A1 "$A"; run tp_C1 "$C"; run tp_A2 "$A"; run tp_C2 "$C"
el done
