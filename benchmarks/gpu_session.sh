#!/usr/bin/env bash
# One device call on an H200: install Podium without dependencies (the image has torch, triton,
# transformers), prove the CUDA engine correct, run the GPU benchmarks. Logs go under $OUT.
#   bash benchmarks/gpu_session.sh [STEP ...]     (from the repo root; default: every step)
# Steps: engine_tests engine_tests_rocm kernel_tests rocm_tests tp_fixed_8b tp_fixed_8b_sync tp_async_ab tp_sharegpt_8b step_profile_8b
#        latency_8b latency_1b tp_cold_log profile_bs1_1b profile_bs1_8b decode_sweep fused_tests
#        graph_gaps_1 graph_gaps_256 graph_gaps_256_fp8 tp_8b (the fixed 8B run without --compare) rotary_tests (rotary / KV write / graph tests, CUDA and ROCm)
# STEP_B: STEP again with the environment AB_ENV adds (an A/B in one call), e.g.
#   AB_ENV="PODIUM_CUDA_TUNING=decode_rotary_in_attention=0" bash benchmarks/gpu_session.sh latency_8b latency_8b_B
# attention_tests: paged attention, fp8 caches, KV write / one-kernel decode, graph replay. decode_tests: of those, the
# one-kernel decode (each decode option), attention over fp8 caches, fp8 graph replay, splits and mixed-step splits.
# engine_decode_kernels: the 8B engine's batch-256 decode launch over the decode kernel's options (bench_kernels'
# engine_decode section; its gemm section times cuBLAS against TunableOp); the fastest fp8 option's PODIUM_CUDA_TUNING
# value goes to /tmp/podium_best_engine_decode_env for an A/B in the same call.
# mixed_kernels: mixed-step attention, one launch or decodes apart (bench_kernels' mixed section). prefill_kernels: prefill
# tilings over bf16 and fp8 caches (bench_kernels' prefill section); the fastest fp8 one at 16 x 512 goes to
# /tmp/podium_best_prefill_env.
# fp8 KV cache: fp8_tests, fp8_kernels (bench_kernels' fp8 section), tp_8b_fp8, latency_8b_fp8, step_profile_8b_fp8 (--kv-cache-dtype fp8);
# triton_cache_out tars ~/.triton into $OUT (its own file, 16 MiB at most comes
# back) for the next call to carry as .triton_cache.tar.xz. gemv_tests: the batch-1 GEMV and the kit's op checks on cuda;
# cuda_quick_tests: GEMV, KV write / one-kernel decode, fused ops, graph replay (not the long attention sweep).
# run_timeline_8b_fp8: the fp8 512/256 run's SM clock and power by step kind (NVML), then the whole run's GPU timeline
# (step_profile.py --clocks --timeline). ncu_decode_fp8 / ncu_decode_bf16: Nsight Compute's counters for the 8B
# engine's batch-256 decode attention launch (ncu_decode.py), the report's details page as text.
# tp_cold_log: the fixed 8B run with every Triton variant built or loaded logged (PODIUM_TRITON_COMPILE_LOG=1);
# run first on a fresh machine, it shows what the startup warm-up leaves to compile inside the timed run.
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./bench -e ./platforms/cpu \
  -e ./platforms/cuda -e ./platforms/rocm 2>&1 | grep -v -i warning | tail -3
run_step() {  # run_step NAME TIMEOUT COMMAND...: run, log, keep going
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-14}" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}
shape8b="--model llama-3.1-8b-shape --max-model-len 1024 --no-progress"
# a Triton cache from an earlier call (triton_cache_out, carried back as .triton_cache.tar.gz): no cold compiles
[ -f .triton_cache.tar.xz ] && tar xJf .triton_cache.tar.xz -C "$HOME" && echo "Triton cache restored" | tee -a "$OUT/summary.txt"
steps=${*:-engine_tests tp_fixed_8b latency_8b latency_1b kernel_tests rocm_tests}
for s in $steps; do
  pre=""
  base=${s%_B}
  [ "$base" != "$s" ] && pre="env ${AB_ENV:?STEP_B needs AB_ENV}"
  case $base in
    engine_tests) run_step $s 170 $pre python3 -m pytest tests/test_engine_cuda.py -q -p no:cacheprovider -rfE ;;
    engine_tests_rocm) run_step $s 240 $pre env PODIUM_ROCM_FORCE_ON_CUDA=1 PODIUM_TEST_GPU_DEVICE=rocm \
      python3 -m pytest tests/test_engine_cuda.py -q -p no:cacheprovider -rfE ;;
    fused_tests) run_step $s 200 $pre python3 -m pytest platforms/cuda/tests/test_fused_ops.py -q -p no:cacheprovider -rfE ;;
    graph_gaps_1) TAIL=30 run_step $s 150 $pre python3 benchmarks/graph_gaps.py --sizes 1 --trace-dir "$OUT" ;;
    graph_gaps_256) TAIL=30 run_step $s 200 $pre python3 benchmarks/graph_gaps.py --sizes 256 --trace-dir "$OUT" ;;
    graph_gaps_256_fp8) TAIL=30 run_step $s 200 $pre python3 benchmarks/graph_gaps.py --sizes 256 --trace-dir "$OUT" \
      --kv-cache-dtype fp8 ;;
    kernel_tests) run_step $s 400 $pre python3 -m pytest platforms/cuda/tests -q -p no:cacheprovider -rfE ;;
    rocm_tests) run_step $s 200 $pre env PODIUM_ROCM_FORCE_ON_CUDA=1 python3 -m pytest platforms/rocm/tests \
      --podium-platform rocm -q -p no:cacheprovider -rfE ;;
    tp_fixed_8b) run_step $s 200 $pre podium bench throughput $shape8b --dataset random --input-len 512 \
      --output-len 256 --num-prompts 256 --compare hf --hf-batch-size 256 --json-out "$OUT/$s.json" ;;
    tp_8b) run_step $s 120 $pre podium bench throughput $shape8b --dataset random --input-len 512 \
      --output-len 256 --num-prompts 256 --json-out "$OUT/$s.json" ;;
    tp_8b_fp8) run_step $s 120 $pre podium bench throughput $shape8b --dataset random --input-len 512 \
      --output-len 256 --num-prompts 256 --kv-cache-dtype fp8 --json-out "$OUT/$s.json" ;;
    latency_8b_fp8) run_step $s 70 $pre podium bench latency $shape8b --batch-size 1 --input-len 512 --output-len 128 \
      --kv-cache-dtype fp8 ;;
    run_timeline_8b_fp8) TAIL=40 run_step $s 240 $pre python3 benchmarks/step_profile.py --model llama-3.1-8b-shape \
      --kv-cache-dtype fp8 --clocks --timeline ;;
    ncu_decode_fp8|ncu_decode_bf16) cache=${s#ncu_decode_}
      TAIL=30 run_step $s 150 $pre ncu --clock-control none -k regex:paged_attention_kernel -s 3 -c 1 --set full \
        -o "$OUT/$s" python3 platforms/cuda/scripts/ncu_decode.py --cache $cache --ctx 640
      ncu --import "$OUT/$s.ncu-rep" --page details > "$OUT/${s}_details.txt" 2>&1; rm -f "$OUT/$s.ncu-rep" ;;
    step_profile_8b_fp8) run_step $s 150 $pre python3 benchmarks/step_profile.py --model llama-3.1-8b-shape --kernels \
      --kv-cache-dtype fp8 ;;
    cuda_quick_tests) run_step $s 200 $pre python3 -m pytest platforms/cuda/tests/test_gemv.py platforms/cuda/tests/test_kv_write.py \
      platforms/cuda/tests/test_fused_ops.py platforms/cuda/tests/test_graph_replay.py -q -p no:cacheprovider -rfE ;;
    gemv_tests) run_step $s 300 $pre bash -c "python3 -m pytest platforms/cuda/tests/test_gemv.py -q -p no:cacheprovider -rfE \
      && cd \$(mktemp -d) && python3 -m pytest -p no:cacheprovider -q --podium-platform cuda -k 'custom_op or generation' -rfE" ;;
    attention_tests) run_step $s 300 $pre python3 -m pytest platforms/cuda/tests/test_paged_attention.py \
      platforms/cuda/tests/test_fp8_cache.py platforms/cuda/tests/test_kv_write.py platforms/cuda/tests/test_graph_replay.py \
      -q -p no:cacheprovider -rfE ;;
    decode_tests) run_step $s 330 $pre python3 -m pytest platforms/cuda/tests/test_kv_write.py platforms/cuda/tests/test_fp8_cache.py \
      platforms/cuda/tests/test_paged_attention.py -k "new_tokens or attention_over_fp8 or graph_replay or mixed or split" \
      -q -p no:cacheprovider -rfE ;;
    fp8_tests) run_step $s 300 $pre python3 -m pytest platforms/cuda/tests/test_fp8_cache.py -q -p no:cacheprovider -rfE ;;
    triton_cache_out) tar cJf "$OUT/triton_cache.tar.xz" -C "$HOME" .triton 2>/dev/null; ls -la "$OUT/triton_cache.tar.xz" ;;
    rotary_tests) run_step $s 300 $pre bash -c "python3 -m pytest platforms/cuda/tests/test_kv_write.py \
      platforms/cuda/tests/test_fused_ops.py platforms/cuda/tests/test_graph_replay.py -q -p no:cacheprovider -rfE && \
      PODIUM_ROCM_FORCE_ON_CUDA=1 python3 -m pytest platforms/rocm/tests/test_rocm_attention_on_gpu.py \
      --podium-platform rocm -q -p no:cacheprovider -rfE" ;;
    tp_async_ab) for m in async-scheduling no-async-scheduling async-scheduling no-async-scheduling; do
      run_step "${s}_$m" 150 $pre podium bench throughput $shape8b --dataset random --input-len 512 --output-len 256 \
        --num-prompts 256 --$m; done ;;
    tp_fixed_8b_sync) run_step $s 150 $pre podium bench throughput $shape8b --dataset random --input-len 512 \
      --output-len 256 --num-prompts 256 --no-async-scheduling --json-out "$OUT/$s.json" ;;
    tp_sharegpt_8b) run_step $s 400 $pre podium bench throughput --model llama-3.1-8b-shape --no-progress \
      --dataset sharegpt-like --num-prompts 256 --compare hf --hf-batch-size 64 --json-out "$OUT/$s.json" ;;
    step_profile_8b) run_step $s 150 $pre python3 benchmarks/step_profile.py --model llama-3.1-8b-shape --kernels ;;
    latency_8b) run_step $s 70 $pre podium bench latency $shape8b --batch-size 1 --input-len 512 --output-len 128 ;;
    latency_1b) run_step $s 50 $pre podium bench latency --model llama-3.2-1b-shape --max-model-len 1024 \
      --no-progress --batch-size 1 --input-len 512 --output-len 128 ;;
    tp_cold_log) TAIL=40 run_step $s 200 $pre env PODIUM_TRITON_COMPILE_LOG=1 podium bench throughput $shape8b --dataset random \
      --input-len 512 --output-len 256 --num-prompts 256 --json-out "$OUT/$s.json" ;;
    fp8_kernels) TAIL=60 run_step $s 300 $pre python3 platforms/cuda/scripts/bench_kernels.py --only fp8 --out "$OUT/$s.json" ;;
    engine_decode_kernels) TAIL=70 run_step $s 330 $pre python3 platforms/cuda/scripts/bench_kernels.py --only engine_decode \
      --out "$OUT/$s.json"; cp "$OUT/best_engine_decode_env" /tmp/podium_best_engine_decode_env 2>/dev/null ;;
    prefill_kernels) TAIL=40 run_step $s 300 $pre python3 platforms/cuda/scripts/bench_kernels.py --only prefill --out "$OUT/$s.json"
      cp "$OUT/best_prefill_env" /tmp/podium_best_prefill_env 2>/dev/null ;;
    mixed_kernels) TAIL=12 run_step $s 200 $pre python3 platforms/cuda/scripts/bench_kernels.py --only mixed --out "$OUT/$s.json" ;;
    decode_sweep) TAIL=12 run_step $s 240 $pre python3 platforms/cuda/scripts/bench_kernels.py --only decode_sweep --out "$OUT/$s.json" ;;
    profile_bs1_1b|profile_bs1_8b) model=llama-3.2-1b-shape; [ "$s" = profile_bs1_8b ] && model=llama-3.1-8b-shape
      TAIL=30 run_step $s 90 $pre env PROFILE_ROWS=24 python3 benchmarks/step_profile.py --model $model --num-prompts 1 \
        --input-len 512 --output-len 64 --kernels ;;
    *) echo "unknown step $s" ;;
  esac
done
# the device tool brings back at most 8 files: keep summary.txt, bundle the rest (a second run into
# the same OUT appends to summary.txt and makes a second bundle)
bundle=logs.tar.gz; [ -e "$OUT/$bundle" ] && bundle=logs_$(date +%s).tar.gz
cd "$OUT" && others=$(ls | grep -v -x -e summary.txt -e 'logs.*\.tar\.gz' -e triton_cache.tar.xz) && [ -n "$others" ] && \
  tar czf $bundle $others && rm -rf $others
exit 0
