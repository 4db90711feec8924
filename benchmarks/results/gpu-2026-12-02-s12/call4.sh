#!/usr/bin/env bash
# session 12 call 4: prefill tilings at 128 rows a program with fewer keys a tile (fewer registers, no
# spills at 128/16) over bf16 / fp8 caches; then the fastest fp8 one at 16 x 512 against the default,
# end to end (8B 512/256, fp8 cache), alternated
W=/tmp/w4; rm -rf $W; mkdir -p $W; FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
OUT=$W/i bash benchmarks/gpu_session.sh none > /dev/null 2>&1; el install
timeout 200 python3 -c "
import sys; sys.path.insert(0, 'platforms/cuda/scripts'); sys.argv = ['bench_kernels.py', '--only', 'prefill', '--out', '$FINAL/prefill.json']
import bench_kernels as b
from podium_cuda.tuning import AttentionTiling as T
b.PREFILL_VARIANTS = [b.CUDA_TUNING.prefill] + [T(*t) for t in ((128, 32, 4, 2), (128, 32, 4, 3), (128, 32, 4, 4), (128, 16, 4, 3), (128, 16, 4, 4), (128, 16, 4, 2))]
b.main()" > $FINAL/prefill.log 2>&1
el "prefill rc $?"; grep "prefill 16x512\|best" $FINAL/prefill.log | tee -a $FINAL/summary.txt
BEST=$(cat $FINAL/best_prefill_env 2>/dev/null); el "best: $BEST"
run() {  # run NAME TUNING
  PODIUM_CUDA_TUNING=$2 timeout 100 podium bench throughput --model llama-3.1-8b-shape --max-model-len 1024 --no-progress \
    --dataset random --input-len 512 --output-len 256 --num-prompts 256 --kv-cache-dtype fp8 --json-out $W/$1.json > $W/$1.log 2>&1
  el "$1 ($2): $(grep 'Output tokens/s' $W/$1.log || tail -3 $W/$1.log)"
}
if [ -n "$BEST" ] && [ "$BEST" != "prefill=128/64/4/3" ]; then
  run a1 ""; run b1 "$BEST"; run a2 ""; run b2 "$BEST"
fi
cp $W/*.json $FINAL/ 2>/dev/null; el done
