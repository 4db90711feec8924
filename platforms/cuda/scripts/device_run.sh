#!/usr/bin/env bash
# One device call: install podium's plugin API and CUDA platform, run the CUDA tests, time the kernels.
#   bash platforms/cuda/scripts/device_run.sh [bench args...]    (from the repo root; writes under $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/podium_cuda_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./platforms/cuda 2>&1 | grep -v -i warning | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest platforms/cuda/tests -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/tests.log" | tail -30
echo "-- tests: $(( $(date +%s) - start )) s"
start=$(date +%s)
timeout "${BENCH_TIMEOUT:-300}" python3 platforms/cuda/scripts/bench_kernels.py --out "$OUT/bench.json" "$@" > "$OUT/bench.log" 2>&1
echo "-- bench: rc $? $(( $(date +%s) - start )) s"
grep -B2 -A100 "== summary" "$OUT/bench.log" || tail -60 "$OUT/bench.log"
