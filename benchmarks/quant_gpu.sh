#!/usr/bin/env bash
# Quantized execution on an H200, one device call (from the repo root, nothing to carry). Everything it
# measures ends up in $OUT/summary.txt; the logs and JSON in $OUT/logs.tar.gz (the device returns 8 files):
#
#   bash benchmarks/quant_gpu.sh            full, <= 520 s of its own clock (BUDGET=...), ~530 s in all
#   bash benchmarks/quant_gpu.sh one_row    the one-row GEMV A/B only (<= 200 s)
#   bash benchmarks/quant_gpu.sh table      benchmarks/quant_gpu_kernels.py's whole kernel table (<= 300 s)
#   bash benchmarks/quant_gpu.sh accum      the FP8 kernel tests, then the 8B 256 x 512/256 FP8 run with
#                                           _scaled_mm's fast accumulation off and on, alternated, and bf16
#                                           weights once (<= 540 s; "ratio" lines against each other)
#   bash benchmarks/quant_gpu.sh mma        the warp-MMA GEMVs (FP8: fp8_mma_gemv.py; AWQ: awq_mma_gemv.py): their tests,
#                                           the one-row timings (FP8 default, mma; AWQ default, mma) with both MMAs'
#                                           settings swept, then
#                                           batch-1 AWQ and FP8 latency under the MMA settings and the default, then
#                                           while the budget lasts FP8 (MMA settings) and bf16 256 x 512/256 (<= 560 s;
#                                           SWEEPS=awq / FORMATS=awq: only AWQ's sweep / latency, TESTS: pytest -k,
#                                           SECOND=merge: batch 1 under the MMA settings with attention_merge_in_kernel
#                                           in place of the default's run, ONE_ROW_LIMIT: the sweep's seconds)
#   bash benchmarks/quant_gpu.sh int4       AWQ as stored against AWQ_MMA (the layout the platform converts AWQ weights to):
#                                           the INT4 tests, benchmarks/quant_gpu_int4.py's per-projection timings at
#                                           1-1024 rows, then batch-1 AWQ latency and AWQ 256 x 512/256 throughput under
#                                           the default (AWQ_MMA) and int4_gemv_mma=0 (the stored layout), then where the
#                                           budget lasts a batch-1 step's kernels by family, AWQ and FP8
#                                           (benchmarks/graph_gaps.py) (<= 560 s)
#   bash benchmarks/quant_gpu.sh ncu        the one-row MMA GEMVs of an 8B layer (AWQ, FP8; default and prefetch settings)
#                                           under Nsight Compute: DRAM %, occupancy, issue %, stall reasons
#                                           (NCU_VARIANTS: quant_gpu_ncu.py's labels, comma-separated)
#                                           (benchmarks/quant_gpu_ncu.py; needs the Firecracker runtime's ncu; <= 300 s)
#   bash benchmarks/quant_gpu.sh targets    issue 31's GPU targets under the default tuning: 8B 256 x 512/256 FP8,
#                                           bf16 weights, FP8 again (alternated), then batch 1 FP8 and AWQ (<= 560 s)
#
# Full: steps in this order, each under its own timeout cut to what is left of the budget (a step with
# under 20 s left is skipped and said so):
#   tests       the CUDA quantization tests on the GPU, every dtype (pytest-xdist where installed):
#               FP8 quantization / GEMV / GEMM / linear, INT4 GEMV / kernels, GGUF kernels, fused linears:
#               pytest's "N passed" line, and the FAILED lines if any
#   one_row     benchmarks/quant_gpu_one_row.py: the one-row FP8 / AWQ GEMV variants checked, timed per
#               8B projection (with its prologue) against the current default in the same run ("time1",
#               "layer1"), their tiles swept over a layer, the fastest as "tuning: PODIUM_CUDA_TUNING=..."
#   latency_fp8, latency_awq   8B shape quantized at load, batch 1, 32 in / 128 out, fp8 KV cache,
#               under that tuning (targets: FP8 <= 2.6 ms a decode token, AWQ <= 2.0)
#   throughput_fp8, throughput_bf16   8B shape, 256 x 512/256 random prompts, fp8 KV cache, default tuning:
#               FP8 W8A8 online against bf16 weights (target: FP8 >= 15,000 out tok/s)
#   latency_fp8_default, latency_awq_default   where time is left: batch 1 under the default tuning
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODE=${1:-full}
case "$MODE" in
  full) BUDGET=${BUDGET:-520} ;;
  one_row) BUDGET=${BUDGET:-200} ;;
  table) BUDGET=${BUDGET:-300} ;;
  accum) BUDGET=${BUDGET:-540} ;;
  targets) BUDGET=${BUDGET:-560} ;;
  mma) BUDGET=${BUDGET:-560} ;;
  int4) BUDGET=${BUDGET:-560} ;;
  ncu) BUDGET=${BUDGET:-300} ;;
  *) echo "usage: bash benchmarks/quant_gpu.sh [full|one_row|table|accum|targets|mma|int4|ncu]" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/podium_quant_out}
START=$(date +%s)
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
if COMMIT=$(git rev-parse --short HEAD 2>/dev/null); then
  git diff --quiet HEAD 2>/dev/null || COMMIT="$COMMIT (+ uncommitted changes)"
else
  COMMIT="unknown (no git here)"
fi
echo "== quant_gpu.sh $MODE, commit $COMMIT, budget $BUDGET s" | tee -a "$SUMMARY"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$SUMMARY"
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cuda \
  -e ./platforms/cpu -e ./bench 2>&1 | grep -v -i warning | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$SUMMARY"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

run_step() {  # run_step NAME TIMEOUT COMMAND...: run (cut to the budget left), log, its KEEP lines to the summary
  local name=$1 limit=$2; shift 2
  local remaining
  remaining=$(left)
  if [ "$remaining" -lt 20 ]; then
    echo "== $name: skipped, ${remaining} s of the budget left" | tee -a "$SUMMARY"
    return
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  echo "== $name: $*" >> "$SUMMARY"
  local start
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc$({ [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && echo ' (timed out)'), $(( $(date +%s) - start )) s (limit $limit s)" \
    | tee -a "$SUMMARY"
  grep -E "${KEEP:-.}" "$OUT/$name.log" | tail -n "${TAIL:-40}" | tee -a "$SUMMARY"
}

finish() {  # every run's figures from its JSON into the summary, then the logs and JSON into one archive
  python3 - "$OUT" <<'EOF' | tee -a "$SUMMARY"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
decode, tput = {}, {}
for path in sorted(out.glob("*.json")):
    r = json.loads(path.read_text()).get("results", {})
    if "decode_per_token_s_median" in r:
        decode[path.stem] = 1000 * r["decode_per_token_s_median"]
        print(f"figure {path.stem}: decode {decode[path.stem]:.2f} ms a token, prefill "
              f"{1000 * r['prefill_s_median']:.2f} ms, {r['decode_tokens_per_s']:.1f} decode tok/s")
    for backend, t in r.items():  # throughput: {backend: ThroughputResult.as_dict()}
        if isinstance(t, dict) and "output_tokens_per_s" in t:
            tput[path.stem] = t["output_tokens_per_s"]
            print(f"figure {path.stem} ({backend}): {t['output_tokens_per_s']:.0f} out tok/s, "
                  f"{t['total_tokens_per_s']:.0f} total tok/s, {t['requests_per_s']:.2f} req/s, {t['elapsed_s']:.1f} s")
if "throughput_fp8" in tput and "throughput_bf16" in tput:
    print(f"ratio throughput fp8 / bf16 (same call): {tput['throughput_fp8'] / tput['throughput_bf16']:.3f} "
          f"({tput['throughput_fp8']:.0f} / {tput['throughput_bf16']:.0f} out tok/s; target fp8 >= 15000)")
fp8_runs = [v for k, v in tput.items() if k.startswith("throughput_fp8_r")]
if fp8_runs and "throughput_bf16" in tput:
    from statistics import median
    print(f"ratio throughput fp8 (median of {len(fp8_runs)}, alternated with bf16) / bf16 (same call): "
          f"{median(fp8_runs) / tput['throughput_bf16']:.3f} ({fp8_runs} / {tput['throughput_bf16']:.0f} out tok/s; "
          f"target fp8 >= 15000)")
fast = [v for k, v in tput.items() if k.startswith("throughput_fp8_accum1")]
plain = [v for k, v in tput.items() if k.startswith("throughput_fp8_accum0")]
if fast and plain:
    from statistics import median
    print(f"ratio throughput fp8 fast accumulation / promoted (same call, medians): "
          f"{median(fast) / median(plain):.3f} ({fast} / {plain} out tok/s)")
    if "throughput_bf16" in tput:
        print(f"ratio throughput fp8 (the faster median) / bf16 weights: "
              f"{max(median(fast), median(plain)) / tput['throughput_bf16']:.3f} "
              f"(bf16 {tput['throughput_bf16']:.0f} out tok/s; target fp8 >= 15000)")
for fmt, target in (("fp8", 2.6), ("awq", 2.0)):
    best, default = decode.get(f"latency_{fmt}"), decode.get(f"latency_{fmt}_default")
    if best is not None:
        print(f"ratio latency {fmt} measured tuning / default: "
              + (f"{best / default:.3f} ({best:.2f} / {default:.2f} ms)" if default else f"{best:.2f} ms (default not run)")
              + f"; target <= {target} ms")
EOF
  echo "== total $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
  local files
  files=$(cd "$OUT" && ls -- *.log *.json 2>/dev/null)
  [ -n "$files" ] && (cd "$OUT" && tar czf logs.tar.gz $files && rm -f $files)
  ls "$OUT"
}

FIGURES="^check|^default|^time|^layer|^sweep|rule|^tuning|^mma|^failed|rror|Traceback"
# the 8B runs of every mode: the model, the 256 x 512/256 throughput run, batch-1 latency
MODEL=(--model llama-3.1-8b-shape --max-model-len 1024 --kv-cache-dtype fp8 --no-progress)
THROUGHPUT=(--dataset random --input-len 512 --output-len 256 --num-prompts 256)
LATENCY=(--max-num-seqs 1 --batch-size 1 --input-len 32 --output-len 128 --num-iters 3)
if [ "$MODE" = one_row ]; then
  KEEP=$FIGURES TAIL=400 run_step one_row "$BUDGET" python3 benchmarks/quant_gpu_one_row.py
  finish
  exit 0
fi
if [ "$MODE" = accum ]; then
  KEEP=" passed| failed|^FAILED|^ERROR|rror:" TAIL=40 run_step tests 110 python3 -m pytest -q -p no:cacheprovider -rfE \
    platforms/cuda/tests/test_fp8_kernels.py platforms/cuda/tests/test_fp8_quant.py
  for round in 1 2; do
    for accum in 0 1; do
      KEEP="Output tokens/s|rror" TAIL=4 run_step "throughput_fp8_accum${accum}_r$round" 100 \
        env PODIUM_CUDA_TUNING="fp8_fast_accum=$accum" podium bench throughput "${MODEL[@]}" --quantization fp8 \
        "${THROUGHPUT[@]}" --json-out "$OUT/throughput_fp8_accum${accum}_r$round.json"
    done
    [ "$round" = 1 ] && KEEP="Output tokens/s|rror" TAIL=4 run_step throughput_bf16 90 podium bench throughput \
      "${MODEL[@]}" "${THROUGHPUT[@]}" --json-out "$OUT/throughput_bf16.json"
  done
  finish
  exit 0
fi
if [ "$MODE" = targets ]; then
  for run in fp8_r1 bf16 fp8_r2; do
    QUANT=(); [ "${run#fp8}" != "$run" ] && QUANT=(--quantization fp8)
    KEEP="Output tokens/s|rror" TAIL=4 run_step "throughput_$run" 100 podium bench throughput "${MODEL[@]}" \
      "${QUANT[@]}" "${THROUGHPUT[@]}" --json-out "$OUT/throughput_$run.json"
  done
  for fmt in fp8 awq; do
    KEEP="Decode per token|rror" TAIL=4 run_step "latency_$fmt" 80 podium bench latency "${MODEL[@]}" \
      --quantization $fmt "${LATENCY[@]}" --json-out "$OUT/latency_$fmt.json"
  done
  finish
  exit 0
fi
if [ "$MODE" = mma ]; then
  XDIST=()
  python3 -c "import xdist" 2>/dev/null && XDIST=(-n 8)
  KEEP=" passed| failed|^FAILED|^ERROR|rror:" TAIL=40 run_step tests 70 python3 -m pytest -q -p no:cacheprovider -rfE \
    "${XDIST[@]}" platforms/cuda/tests/test_awq_mma_gemv.py platforms/cuda/tests/test_fp8_mma_gemv.py ${TEST_FILES:-} \
    -k "${TESTS:-default or groups or split or config or bulk}"
  KEEP=$FIGURES TAIL=400 run_step one_row "${ONE_ROW_LIMIT:-200}" python3 benchmarks/quant_gpu_one_row.py --mma-only-sweep \
    --variants "fp8 mma,awq mma" --mma-sweeps "${SWEEPS:-fp8,awq}"
  MEASURED=$(grep -E "^mma: " "$OUT/one_row.log" 2>/dev/null | grep -oE "PODIUM_CUDA_TUNING=[^ ]+" | tail -1 | cut -d= -f2-)
  echo "the MMA GEMVs' fastest settings: ${MEASURED:=fp8_gemv_mma=1,int4_gemv_mma=1}" | tee -a "$SUMMARY"
  # batch 1 under the MMA settings and the default, AWQ first (its GEMV is the newer one), then, while the
  # budget lasts, FP8 and bf16 throughput in the same call
  for fmt in ${FORMATS:-awq fp8}; do
    KEEP="Decode per token|rror" TAIL=4 run_step "latency_${fmt}_mma" 70 env PODIUM_CUDA_TUNING="$MEASURED" podium bench \
      latency "${MODEL[@]}" --quantization $fmt "${LATENCY[@]}" --json-out "$OUT/latency_${fmt}_mma.json"
    if [ "${SECOND:-default}" = merge ]; then  # the same settings with the split decode merged in the attention kernel
      KEEP="Decode per token|rror" TAIL=4 run_step "latency_${fmt}_mma_merge" 70 env \
        PODIUM_CUDA_TUNING="$MEASURED,attention_merge_in_kernel=1" podium bench latency "${MODEL[@]}" \
        --quantization $fmt "${LATENCY[@]}" --json-out "$OUT/latency_${fmt}_mma_merge.json"
    else
      KEEP="Decode per token|rror" TAIL=4 run_step "latency_${fmt}_default" 70 podium bench latency "${MODEL[@]}" \
        --quantization $fmt "${LATENCY[@]}" --json-out "$OUT/latency_${fmt}_default.json"
    fi
  done
  KEEP="Output tokens/s|rror" TAIL=4 run_step throughput_fp8 100 env PODIUM_CUDA_TUNING="$MEASURED" podium bench \
    throughput "${MODEL[@]}" --quantization fp8 "${THROUGHPUT[@]}" --json-out "$OUT/throughput_fp8.json"
  KEEP="Output tokens/s|rror" TAIL=4 run_step throughput_bf16 90 podium bench throughput "${MODEL[@]}" \
    "${THROUGHPUT[@]}" --json-out "$OUT/throughput_bf16.json"
  finish
  exit 0
fi
if [ "$MODE" = int4 ]; then
  XDIST=()
  python3 -c "import xdist" 2>/dev/null && XDIST=(-n 8)
  KEEP=" passed| failed|^FAILED|^ERROR|rror:" TAIL=40 run_step tests 200 python3 -m pytest -q -p no:cacheprovider -rfE \
    "${XDIST[@]}" platforms/cuda/tests/test_awq_mma_gemv.py platforms/cuda/tests/test_int4_kernels.py \
    platforms/cuda/tests/test_int4_gemv.py platforms/cuda/tests/test_fused_linear.py
  KEEP="^check|^time|^layer|rror|Traceback" TAIL=80 run_step int4_layouts 120 python3 benchmarks/quant_gpu_int4.py
  for layout in mma awq; do
    SETTING=""; [ $layout = awq ] && SETTING="int4_gemv_mma=0"
    KEEP="Decode per token|weight|rror" TAIL=6 run_step "latency_awq_$layout" 70 env PODIUM_CUDA_TUNING="$SETTING" \
      podium bench latency "${MODEL[@]}" --quantization awq "${LATENCY[@]}" --json-out "$OUT/latency_awq_$layout.json"
  done
  for layout in mma awq; do
    SETTING=""; [ $layout = awq ] && SETTING="int4_gemv_mma=0"
    KEEP="Output tokens/s|rror" TAIL=4 run_step "throughput_awq_$layout" 100 env PODIUM_CUDA_TUNING="$SETTING" \
      podium bench throughput "${MODEL[@]}" --quantization awq "${THROUGHPUT[@]}" --json-out "$OUT/throughput_awq_$layout.json"
  done
  for fmt in awq fp8; do  # where a batch-1 decode step's time goes: the replayed graph's kernels by family
    KEEP="^graph|busy in|rror|Traceback" TAIL=30 run_step "gaps_$fmt" 90 python3 benchmarks/graph_gaps.py --sizes 1 \
      --prompt-len 32 --steps 4 --kv-cache-dtype fp8 --quantization $fmt
  done
  finish
  exit 0
fi
if [ "$MODE" = ncu ]; then
  VARIANTS=(); [ -n "${NCU_VARIANTS:-}" ] && VARIANTS=(--variants "$NCU_VARIANTS")  # quant_gpu_ncu.py's labels
  run_step ncu 240 ncu --clock-control none -k regex:gemv --metrics "$(python3 benchmarks/quant_gpu_ncu.py --metrics)" \
    -f -o "$OUT/gemv" python3 benchmarks/quant_gpu_ncu.py "${VARIANTS[@]}"
  KEEP="^ncu|rror" TAIL=100 run_step ncu_report 40 python3 benchmarks/quant_gpu_ncu.py --report "$OUT/gemv.ncu-rep" \
    "${VARIANTS[@]}"
  finish
  exit 0
fi
if [ "$MODE" = table ]; then
  KEEP=$FIGURES TAIL=400 run_step kernels "$BUDGET" python3 benchmarks/quant_gpu_kernels.py
  finish
  exit 0
fi

XDIST=()
python3 -c "import xdist" 2>/dev/null && XDIST=(-n 12)
KEEP=" passed| failed|^FAILED|^ERROR|rror:" TAIL=40 run_step tests 120 python3 -m pytest -q -p no:cacheprovider -rfE \
  "${XDIST[@]}" platforms/cuda/tests/test_fp8_quant.py platforms/cuda/tests/test_fp8_gemv.py \
  platforms/cuda/tests/test_fp8_kernels.py platforms/cuda/tests/test_int4_gemv.py platforms/cuda/tests/test_int4_kernels.py \
  platforms/cuda/tests/test_gguf_kernels.py platforms/cuda/tests/test_fused_linear.py

KEEP=$FIGURES TAIL=400 run_step one_row 170 python3 benchmarks/quant_gpu_one_row.py
MEASURED=$(grep -oE "PODIUM_CUDA_TUNING=[^ ]+" "$OUT/one_row.log" 2>/dev/null | tail -1 | cut -d= -f2-)
echo "measured tuning: ${MEASURED:-none (the one_row step gave none: the defaults)}" | tee -a "$SUMMARY"

KEEP_T="Output tokens/s|rror"
KEEP_L="Decode per token|rror"

KEEP=$KEEP_L TAIL=4 run_step latency_fp8 70 env PODIUM_CUDA_TUNING="$MEASURED" podium bench latency "${MODEL[@]}" \
  --quantization fp8 "${LATENCY[@]}" --json-out "$OUT/latency_fp8.json"
KEEP=$KEEP_L TAIL=4 run_step latency_awq 80 env PODIUM_CUDA_TUNING="$MEASURED" podium bench latency "${MODEL[@]}" \
  --quantization awq "${LATENCY[@]}" --json-out "$OUT/latency_awq.json"
KEEP=$KEEP_T TAIL=4 run_step throughput_fp8 100 podium bench throughput "${MODEL[@]}" --quantization fp8 \
  "${THROUGHPUT[@]}" --json-out "$OUT/throughput_fp8.json"
KEEP=$KEEP_T TAIL=4 run_step throughput_bf16 90 podium bench throughput "${MODEL[@]}" "${THROUGHPUT[@]}" \
  --json-out "$OUT/throughput_bf16.json"
if [ -n "$MEASURED" ] && [ "$(left)" -gt 50 ]; then
  KEEP=$KEEP_L TAIL=4 run_step latency_fp8_default 60 podium bench latency "${MODEL[@]}" --quantization fp8 \
    "${LATENCY[@]}" --json-out "$OUT/latency_fp8_default.json"
fi
if [ -n "$MEASURED" ] && [ "$(left)" -gt 50 ]; then
  KEEP=$KEEP_L TAIL=4 run_step latency_awq_default 60 podium bench latency "${MODEL[@]}" --quantization awq \
    "${LATENCY[@]}" --json-out "$OUT/latency_awq_default.json"
fi
finish
