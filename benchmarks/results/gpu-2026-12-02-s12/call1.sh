#!/usr/bin/env bash
# session 12 call 1: fresh prompts through torch's flash kernel (dense_prefill_min_tokens 128) against the
# paged prefill kernel (0): the mixed steps' attention layer, the 8B 512/256 run alternated (fp8, then bf16
# caches), the dense path's tests
# (dense_prefill_min_tokens and the dense path were removed after this call: dense_prefill.patch holds them)
W=/tmp/w1; rm -rf $W; mkdir -p $W; FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
OUT=$W/k bash benchmarks/gpu_session.sh dense_kernels > $W/kernels.log 2>&1; el "kernels"; cat $W/k/summary.txt >> $FINAL/summary.txt
run() {  # run NAME MIN_TOKENS ARGS...
  local name=$1 min=$2; shift 2
  PODIUM_CUDA_TUNING=dense_prefill_min_tokens=$min timeout 100 podium bench throughput --model llama-3.1-8b-shape \
    --max-model-len 1024 --no-progress --dataset random --input-len 512 --output-len 256 --num-prompts 256 "$@" \
    --json-out $W/$name.json > $W/$name.log 2>&1
  el "$name (dense_prefill_min_tokens=$min $*): $(grep 'Output tokens/s' $W/$name.log || tail -3 $W/$name.log)"
}
set -- ${RUNS:-a1 128 b1 0 a2 128 b2 0}
while [ $# -ge 2 ]; do run $1 $2 --kv-cache-dtype fp8; shift 2; done
run c1 128; run d1 0
OUT=$W/t bash benchmarks/gpu_session.sh dense_tests > $W/tests.log 2>&1; el "tests"; cat $W/t/summary.txt >> $FINAL/summary.txt
timeout 150 python3 -m pytest tests/test_engine_cuda.py -q -p no:cacheprovider -rfE -k dense > $W/engine_dense.log 2>&1
el "engine dense test: $(tail -1 $W/engine_dense.log)"
cd $W && tar czf $FINAL/call1.tar.gz . ; el done
