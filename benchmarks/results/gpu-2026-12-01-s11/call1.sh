#!/usr/bin/env bash
# session 11 call 1: diagnostics. ncu on the fp8 / bf16 engine decode launch, the run's timeline and clocks,
# graph gaps; a fresh Triton cache back.
W=/tmp/w; mkdir -p $W; FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
OUT=$W/gs timeout 60 bash benchmarks/gpu_session.sh none > $W/install.log 2>&1; el install
which ncu >> $W/install.log 2>&1; ncu --version >> $W/install.log 2>&1
for c in fp8 bf16; do
  timeout 150 ncu --clock-control none -k regex:paged_attention_kernel -s 3 -c 1 --set full -o $W/decode_$c \
    python3 platforms/cuda/scripts/ncu_decode.py --cache $c --ctx 640 > $W/ncu_$c.log 2>&1
  el "ncu $c rc $?"
  ncu --import $W/decode_$c.ncu-rep --page details > $W/ncu_${c}_details.txt 2>&1
  ncu --import $W/decode_$c.ncu-rep --page source --csv --print-source sass > $W/ncu_${c}_sass.csv 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Warp Cycles Per Issued|No Eligible" $W/ncu_${c}_details.txt | head -20 | tee -a $FINAL/summary.txt
done
timeout 240 python3 benchmarks/step_profile.py --model llama-3.1-8b-shape --kv-cache-dtype fp8 --clocks --timeline --kernels \
  > $W/step_profile_fp8.log 2>&1; el "step_profile rc $?"
grep -v Warning $W/step_profile_fp8.log | head -40 >> $FINAL/summary.txt
OUT=$W/gs timeout 200 bash benchmarks/gpu_session.sh graph_gaps_256_fp8 > $W/gg.log 2>&1; el "graph_gaps rc $?"
tail -45 $W/gg.log >> $FINAL/summary.txt
tar cJf $FINAL/triton_cache.tar.xz -C $HOME .triton 2>/dev/null; el "triton cache $(ls -la $FINAL/triton_cache.tar.xz | awk '{print $5}')"
rm -f $W/*.ncu-rep.tmp; cd $W && tar czf $FINAL/call1.tar.gz --exclude="*.ncu-rep" . ; el done
