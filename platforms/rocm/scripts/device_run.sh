#!/usr/bin/env bash
# The ROCm platform's GPU proof in one device call (from the repo root, on an NVIDIA or AMD GPU machine):
# installs the plugin API and the CUDA and ROCm platforms, then runs the ROCm platform's GPU tests
# and the conformance kit against the rocm platform. On an NVIDIA GPU the test-only switch
# PODIUM_ROCM_FORCE_ON_CUDA=1 runs the ROCm code path (its tuning table, graph capture and kernels)
# there; on a ROCm machine the switch is ignored and everything runs on the AMD GPU.
#   bash platforms/rocm/scripts/device_run.sh [pytest args...]       (logs under $OUT if set)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/podium_rocm_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./platforms/cuda -e ./platforms/rocm \
  2>&1 | grep -v -i warning | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'hip', torch.version.hip, 'triton', triton.__version__)"
export PODIUM_ROCM_FORCE_ON_CUDA=1
python3 -c "from podium_rocm import RocmPlatform as P; p = P(); print('rocm:', p.availability().reason); print(p.tuning())"
start=$(date +%s)
timeout "${TEST_TIMEOUT:-420}" python3 -m pytest platforms/rocm/tests --podium-platform rocm -q -p no:cacheprovider -rfEs "$@" \
  2>&1 | tee "$OUT/rocm_tests.log" | tail -40
rc=$?
echo "-- rocm tests + kit: rc $rc, $(( $(date +%s) - start )) s"
exit $rc
