#!/usr/bin/env bash
# session 14 call 3: the new defaults (fp8 decode 16/16/1/5/64, fp8 prefill 128/64/4/3/64, bf16
# prefill 128/32/4/3/64) against sessions 10-13's (OLD), alternated: 8B 512/256 fp8 and bf16 cache,
# batch-1 fp8 latency; then the kernels' tables and the attention / fp8 / new-token tests on the GPU
FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $FINAL/summary.txt
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cpu \
  -e ./platforms/cuda -e ./platforms/rocm > $FINAL/install.log 2>&1; el "install rc $?"
OLD="PODIUM_CUDA_TUNING=fp8_decode=16/32/1/3,fp8_prefill=none,prefill=128/64/4/3"
S8="--model llama-3.1-8b-shape --max-model-len 1024 --no-progress"
tp() {  # tp NAME CACHE [ENV]
  timeout 90 env $3 podium bench throughput $S8 --dataset random --input-len 512 --output-len 256 --num-prompts 256 \
    --kv-cache-dtype $2 --json-out $FINAL/$1.json > $FINAL/$1.log 2>&1
  el "$1 $2 ${3:-new defaults}: $(grep 'Output tokens/s' $FINAL/$1.log || tail -3 $FINAL/$1.log)"
}
lat() {  # lat NAME [ENV]
  timeout 60 env $2 podium bench latency $S8 --batch-size 1 --input-len 512 --output-len 128 --kv-cache-dtype fp8 > $FINAL/$1.log 2>&1
  el "$1 ${2:-new defaults}: $(grep 'Decode per token' $FINAL/$1.log || tail -2 $FINAL/$1.log)"
}
tp fp8_old1 fp8 "$OLD"; tp fp8_new1 fp8; tp fp8_old2 fp8 "$OLD"; tp fp8_new2 fp8
tp bf16_old1 auto "$OLD"; tp bf16_new1 auto
lat lat_old "$OLD"; lat lat_new
for part in engine_decode prefill; do
  timeout 90 python3 platforms/cuda/scripts/bench_kernels.py --only $part --out $FINAL/$part.json > $FINAL/$part.log 2>&1
  el "$part kernels rc $?"; grep -E "^(engine decode|prefill)" $FINAL/$part.log >> $FINAL/summary.txt
done
LEFT=$(( 570 - ($(date +%s) - T0) ))
timeout $LEFT python3 -m pytest platforms/cuda/tests/test_paged_attention.py platforms/cuda/tests/test_fp8_cache.py \
  platforms/cuda/tests/test_kv_write.py -q -p no:cacheprovider -rfE -x > $FINAL/tests.log 2>&1
el "tests (limit $LEFT s): rc $? $(tail -1 $FINAL/tests.log)"
