#!/usr/bin/env bash
# One device call for the decode-batch GEMM: install, its tests, bench_gemm.py -> $OUT.
#   bash platforms/cuda/scripts/gemm_device_run.sh --budget-s 170     (from the repo root)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/podium_gemm_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./platforms/cuda 2>&1 | grep -v -i warning | tail -3
start=$(date +%s)
timeout "${TEST_TIMEOUT:-100}" python3 -m pytest platforms/cuda/tests/test_gemm.py -q -p no:cacheprovider -rfE 2>&1 \
  | tee "$OUT/tests.log" | tail -15
echo "-- tests: $(( $(date +%s) - start )) s"
timeout "${BENCH_TIMEOUT:-230}" python3 platforms/cuda/scripts/bench_gemm.py --out "$OUT" "$@"
echo "-- bench: rc $? $(( $(date +%s) - start )) s since the tests began"
