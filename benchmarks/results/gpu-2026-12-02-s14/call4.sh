#!/usr/bin/env bash
# session 14 call 4: split fp8 decodes back on 16/32/1/3 (fp8_split_decode): batch-1 fp8 latency
# against sessions 10-13's tilings, then the new-token and fp8 tests and the CUDA engine tests
FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cpu \
  -e ./platforms/cuda -e ./platforms/rocm > $FINAL/install.log 2>&1; el "install rc $?"
OLD="PODIUM_CUDA_TUNING=fp8_decode=16/32/1/3,fp8_prefill=none,prefill=128/64/4/3"
S8="--model llama-3.1-8b-shape --max-model-len 1024 --no-progress"
lat() {  # lat NAME [ENV]
  timeout 60 env $2 podium bench latency $S8 --batch-size 1 --input-len 512 --output-len 128 --kv-cache-dtype fp8 > $FINAL/$1.log 2>&1
  el "$1 ${2:-new defaults}: $(grep 'Decode per token' $FINAL/$1.log || tail -2 $FINAL/$1.log)"
}
lat lat_new; lat lat_old "$OLD"
timeout 90 python3 -m pytest tests/test_engine_cuda.py -q -p no:cacheprovider -rfE > $FINAL/engine_tests.log 2>&1
el "engine tests rc $? $(tail -1 $FINAL/engine_tests.log)"
LEFT=$(( 400 - ($(date +%s) - T0) ))
timeout $LEFT python3 -m pytest platforms/cuda/tests/test_kv_write.py platforms/cuda/tests/test_fp8_cache.py \
  -q -p no:cacheprovider -rfE > $FINAL/tests.log 2>&1
el "tests (limit $LEFT s): rc $? $(tail -1 $FINAL/tests.log)"
grep -E "FAILED|Error" $FINAL/tests.log | head -5 >> $FINAL/summary.txt
