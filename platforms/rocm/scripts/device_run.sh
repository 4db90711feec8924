#!/usr/bin/env bash
# The ROCm platform's GPU proof in one device call (from the repo root, on an NVIDIA or AMD GPU machine):
# installs the plugin API and the CUDA and ROCm platforms, then runs the ROCm platform's GPU tests
# and the conformance kit against the rocm platform, sequentially. On an NVIDIA GPU the test-only
# switch PODIUM_ROCM_FORCE_ON_CUDA=1 runs the ROCm code path (its tuning table, graph capture and
# kernels) there; on a ROCm machine the switch is ignored and everything runs on the AMD GPU.
#   bash platforms/rocm/scripts/device_run.sh [pytest args, e.g. -x]
# Writes under $OUT (default /tmp/podium_rocm_out): rocm_tests.log and junit.xml. Most of the wall
# time is Triton compiling kernels; when the run does not pass, Triton's cache goes to $OUT too
# (triton-cache.tar.xz.NN) and TRITON_CACHE_IN=<folder holding those files> restores it in the next
# run, which then compiles only what changed.
# TEST_TIMEOUT (s, default 480): pytest then gets SIGINT, so it still prints its summary and junit.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/podium_rocm_out}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/podium_triton_cache}
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
if [ -n "$TRITON_CACHE_IN" ] && ls "$TRITON_CACHE_IN"/triton-cache.tar.xz.* > /dev/null 2>&1; then
  cat "$TRITON_CACHE_IN"/triton-cache.tar.xz.* | xz -d | tar xf - -C "$TRITON_CACHE_DIR"
  echo "triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) entries restored from $TRITON_CACHE_IN"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./platforms/cuda -e ./platforms/rocm \
  2>&1 | grep -v -i warning | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'hip', torch.version.hip, 'triton', triton.__version__)"
export PODIUM_ROCM_FORCE_ON_CUDA=1
python3 -c "from podium_rocm import RocmPlatform as P; p = P(); print('rocm:', p.availability().reason); print(p.tuning())"
start=$(date +%s)
timeout -s INT -k 30 "${TEST_TIMEOUT:-480}" python3 -m pytest platforms/rocm/tests --podium-platform rocm \
  -q -p no:cacheprovider -rfEs --durations=20 --junitxml="$OUT/junit.xml" "$@" \
  2>&1 | tee "$OUT/rocm_tests.log" | tail -60
rc=$?
echo "-- rocm tests + kit: rc $rc, $(( $(date +%s) - start )) s"
if [ "$rc" != 0 ]; then
  tar cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -6 | split -b 12M -d - "$OUT/triton-cache.tar.xz."
  ls -l "$OUT"
fi
exit $rc
