#!/usr/bin/env bash
# session 12 call 2: dense attention kernels against the paged prefill kernel at 16 x 512 (8B shape), then
# Nsight Compute's details of the paged prefill launch over an fp8 cache
FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
OUT=/tmp/w2 bash benchmarks/gpu_session.sh none > /dev/null 2>&1; el install
timeout 200 python3 benchmarks/results/gpu-2026-12-02-s12/call2_attention_backends.py > $FINAL/backends.log 2>&1
el "backends rc $?"; cat $FINAL/backends.log | tee -a $FINAL/summary.txt
cat > /tmp/ncu_prefill.py <<'PY'
import sys, torch
sys.path.insert(0, "platforms/cuda/scripts")
from bench_kernels import PagedSets
from podium_cuda.tuning import CUDA_TUNING
sets = PagedSets(16, 512, 512, rotate=False, cache_dtype=torch.float8_e4m3fn)
call = sets.calls(CUDA_TUNING, 1)[0]
for _ in range(5): call()
torch.cuda.synchronize()
PY
timeout 200 ncu --clock-control none -k regex:paged_attention_kernel -s 3 -c 1 --set full -o /tmp/ncu_prefill python3 /tmp/ncu_prefill.py > $FINAL/ncu_run.log 2>&1
el "ncu rc $?"
ncu --import /tmp/ncu_prefill.ncu-rep --page details > $FINAL/ncu_prefill_fp8_details.txt 2>&1
ncu --import /tmp/ncu_prefill.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip > $FINAL/ncu_prefill_fp8_sass.csv.gz
el done
