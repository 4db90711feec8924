#!/usr/bin/env bash
# The batch-invariant mode on one NVIDIA GPU, bf16, in one call of ~4.5 minutes (each step under a
# timeout, all within DEADLINE seconds, 285 by default):
#   kernels  the invariant GEMM and attention alone: rows / tokens equal alone and in batches, the
#            default kernels alongside; the GEMM's time against cuBLAS (invariant_gpu_kernels.py)
#   8b_on    llama-3.1-8b-shape with --batch-invariant: 64 requests' outputs alone == in batches of 8,
#            64 and 256 rows == after a prefix-cache hit == with 64-token chunks and preemptions;
#            then the 256 x 512/256 throughput (invariant_gpu.py)
#   8b_off   the same in the default mode (the differences it shows are why the mode exists)
#   1b_on    llama-3.2-1b-shape, the mode, and 256 concurrent streams through the server's engine
#            loop (podium_server.ThreadEngine in process: no fastapi/uvicorn needed)
#   1b_off   the 1B in the default mode, engine A's ways only
#   gemm_sweep  with the time left: the GEMM's time against cuBLAS under other fixed tilings
#   bash benchmarks/invariant_gpu.sh        (results in $OUT/summary.txt; OUT defaults to ./invariant_out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./invariant_out}
DEADLINE=${DEADLINE:-285}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
: > "$OUT/log.txt"
begin=$(date +%s)
if ! python3 -c "import podium, podium_cuda, podium_server" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cuda -e ./server \
    >> "$OUT/log.txt" 2>&1
fi

step() {  # step NAME LIMIT_SECONDS COMMAND...: at most LIMIT, and never past the deadline
  local name=$1 limit=$2 left start rc
  shift 2
  left=$(( DEADLINE - ($(date +%s) - begin) - 8 ))  # 8 s kept for the summary
  (( left < limit )) && limit=$left
  if (( limit < 10 )); then echo "step $name: skipped (deadline)" | tee -a "$OUT/steps.txt"; return; fi
  start=$(date +%s)
  echo "=== $name (limit ${limit}s)" >> "$OUT/log.txt"
  timeout "$limit" "$@" >> "$OUT/log.txt" 2>&1
  rc=$?
  echo "step $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
}

ENGINE="python3 benchmarks/invariant_gpu.py engine --out $OUT"
step kernels 45 python3 benchmarks/invariant_gpu_kernels.py --out "$OUT"
step 8b_on 100 $ENGINE --model llama-3.1-8b-shape --mode on --throughput
step 8b_off 75 $ENGINE --model llama-3.1-8b-shape --mode off --throughput
step 1b_on 45 $ENGINE --model llama-3.2-1b-shape --mode on --streams
step 1b_off 25 $ENGINE --model llama-3.2-1b-shape --mode off --skip-b
step gemm_sweep 40 python3 benchmarks/invariant_gpu_kernels.py --out "$OUT" --sweep
python3 benchmarks/invariant_gpu.py summary --out "$OUT" >> "$OUT/summary.txt" 2>> "$OUT/log.txt"
cat "$OUT/steps.txt" >> "$OUT/summary.txt" && rm -f "$OUT/steps.txt"
echo "total $(( $(date +%s) - begin )) s" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
