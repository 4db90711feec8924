#!/usr/bin/env bash
# session 11 call 5 (call 4 again, its bench fixed): register-capped decode tilings (maxnreg); the best fp8 one end to end, alternated; the
# decode tilings' tests (swapped, register-capped) on the GPU
W=/tmp/w; mkdir -p $W; FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
OUT=$W/k timeout 200 bash benchmarks/gpu_session.sh engine_decode_kernels > $W/k.log 2>&1; el "engine_decode rc $?"
grep "engine decode" $W/k.log >> $FINAL/summary.txt
BEST=$(cat /tmp/podium_best_engine_decode_env 2>/dev/null); el "best: $BEST"
if [ -n "$BEST" ]; then
  for r in 1 2; do
    OUT=$W/a$r timeout 90 bash benchmarks/gpu_session.sh tp_8b_fp8 > /dev/null 2>&1
    AB_ENV="PODIUM_CUDA_TUNING=$BEST" OUT=$W/b$r timeout 90 bash benchmarks/gpu_session.sh tp_8b_fp8_B > /dev/null 2>&1
    el "round $r: default $(grep 'Output tokens/s' $W/a$r/summary.txt) | $BEST $(grep 'Output tokens/s' $W/b$r/summary.txt)"
  done
fi
left=0
[ $left -gt 60 ] && timeout $left python3 -m pytest platforms/cuda/tests/test_kv_write.py -k "new_tokens and (swapped or register)" \
  -q -p no:cacheprovider -rfE > $W/t.log 2>&1; el "tests rc $?"; tail -5 $W/t.log >> $FINAL/summary.txt
cd $W && tar czf $FINAL/call4.tar.gz . ; el done
