#!/usr/bin/env bash
# session 11 call 3: prefill tilings over bf16 / fp8 caches; the best fp8 one end to end, alternated
W=/tmp/w; mkdir -p $W; FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
OUT=$W/k timeout 330 bash benchmarks/gpu_session.sh prefill_kernels > $W/k.log 2>&1; el "prefill rc $?"
grep "^prefill" $W/k.log >> $FINAL/summary.txt
BEST=$(cat /tmp/podium_best_prefill_env 2>/dev/null); el "best: $BEST"
if [ -n "$BEST" ] && [ "$BEST" != "prefill=128/64/4/3" ]; then
  for r in 1 2; do
    OUT=$W/a$r timeout 100 bash benchmarks/gpu_session.sh tp_8b_fp8 > /dev/null 2>&1
    AB_ENV="PODIUM_CUDA_TUNING=$BEST" OUT=$W/b$r timeout 100 bash benchmarks/gpu_session.sh tp_8b_fp8_B > /dev/null 2>&1
    el "round $r: default $(grep 'Output tokens/s' $W/a$r/summary.txt) | $BEST $(grep 'Output tokens/s' $W/b$r/summary.txt)"
  done
fi
cd $W && tar czf $FINAL/call3.tar.gz . ; el done
