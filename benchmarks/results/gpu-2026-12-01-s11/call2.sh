#!/usr/bin/env bash
# session 11 call 2: the decode tilings that double-buffer (5 stages) or prefetch in registers; the best fp8 one end to end
W=/tmp/w; mkdir -p $W; FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
OUT=$W/k timeout 360 bash benchmarks/gpu_session.sh engine_decode_kernels > $W/k.log 2>&1; el "engine_decode rc $?"
grep "engine decode" $W/k.log >> $FINAL/summary.txt
BEST=$(cat /tmp/podium_best_engine_decode_env 2>/dev/null); el "best: $BEST"
[ -n "$BEST" ] || BEST="fp8_decode=16/16/1/5"
AB_ENV="PODIUM_CUDA_TUNING=$BEST" OUT=$W/e timeout 420 bash benchmarks/gpu_session.sh tp_8b_fp8 tp_8b_fp8_B tp_8b_fp8 tp_8b_fp8_B > $W/e.log 2>&1
el "e2e rc $?"; grep -E "== |output tok|tok/s" $W/e.log >> $FINAL/summary.txt
tar cJf $FINAL/triton_cache.tar.xz -C $HOME .triton 2>/dev/null
cd $W && tar czf $FINAL/call2.tar.gz . ; el done
