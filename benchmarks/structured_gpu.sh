#!/usr/bin/env bash
# One H200 call for structured output: the cost of JSON-schema decoding against unconstrained decoding
# at batch 256 on the Llama-3.1-8B shape (random weights) with SmolLM2's tokenizer (each backend), and
# time to first token for a new schema (compile) against a cached one.
#   bash benchmarks/structured_gpu.sh          (from the repo root; ~5 min; results and summary.txt in $OUT)
# The device has no network (and no pydantic): before the call, fill wheels/ (carried with the tree) with
#   - the grammar libraries and what they import, for its Python 3.12 (7 wheels, ~11 MB):
#       W="pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels"
#       $W --platform manylinux_2_28_x86_64 xgrammar==0.2.9 apache-tvm-ffi pydantic annotated-types typing-inspection
#       $W --platform manylinux2014_x86_64 pydantic-core    # the version pydantic pins
#       $W --platform manylinux_2_31_x86_64 llguidance==1.9.1
#   - wheels/smollm2-tokenizer: python benchmarks/structured_cost.py --export-tokenizer wheels/smollm2-tokenizer
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
if ls wheels/*.whl >/dev/null 2>&1; then  # (torch, transformers, numpy, triton: the device's own)
  python3 -m pip install -q --no-index --find-links wheels xgrammar llguidance 2>&1 | grep -v -i warning | tail -3
fi
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cuda -e ./bench \
  2>&1 | grep -v -i warning | tail -3
python3 -c "import xgrammar; print('xgrammar', xgrammar.__version__)" 2>&1 | tee -a "$OUT/summary.txt"
python3 -c "import llguidance; print('llguidance', llguidance.__version__)" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
TOKENIZER=${TOKENIZER:-wheels/smollm2-tokenizer}
run_step() {  # run_step NAME TIMEOUT COMMAND...: run, log, keep going
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-6}" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
if [ ! -f "$TOKENIZER/tokenizer.json" ] && [ ! -f "$TOKENIZER/tokenizer_config.json" ]; then
  echo "no tokenizer folder at $TOKENIZER: see the header" | tee -a "$OUT/summary.txt"
  exit 1
fi
run_step cost_xgrammar 300 python3 benchmarks/structured_cost.py --model llama-3.1-8b-shape --vocab-size 49152 --tokenizer "$TOKENIZER" \
  --device cuda --dtype bfloat16 --batch 256 --max-tokens 192 --pairs 3 --ttft-runs 5
run_step cost_llguidance 200 python3 benchmarks/structured_cost.py --model llama-3.1-8b-shape --vocab-size 49152 --tokenizer "$TOKENIZER" \
  --device cuda --dtype bfloat16 --batch 256 --max-tokens 192 --pairs 1 --ttft-runs 3 --backend llguidance
