#!/usr/bin/env bash
# session 13 call 1: the core's graph-capture changes (plugin API 1.6: GraphCaptureUnsupported, a
# runner's max_batch_size) on CUDA: the CUDA engine tests (greedy tokens on CUDA graphs = the CPU
# platform's, batch invariance, no leaks), graph replay tests, the kit's graph check; then the 8B
# 512/256 fp8 run twice and batch-1 decode, against session 12's figures (no regression expected)
FINAL=$OUT; T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $FINAL/summary.txt; }
OUT=$FINAL bash benchmarks/gpu_session.sh engine_tests > /dev/null 2>&1; el "engine_tests: $(grep -E 'passed|failed' $FINAL/engine_tests.log | tail -1)"
timeout 200 python3 -m pytest platforms/cuda/tests/test_graph_replay.py -q -p no:cacheprovider -rfE > $FINAL/graph_tests.log 2>&1
el "graph tests: $(tail -1 $FINAL/graph_tests.log)"
timeout 200 python3 -c "
import torch
from podium_cuda.platform import CudaPlatform
from podium_plugin_api.testing.attention_checks import check_graph_capture
p = CudaPlatform()
for dt in (torch.float32, torch.bfloat16):
    print(dt, 'declined' if check_graph_capture(p, p.attention_backend(), dt) else 'replays equal eager')
" > $FINAL/kit_graph.log 2>&1; el "kit graph check: $(tr '\n' ' ' < $FINAL/kit_graph.log | tail -c 300)"
run() {
  timeout 150 podium bench throughput --model llama-3.1-8b-shape --max-model-len 1024 --no-progress \
    --dataset random --input-len 512 --output-len 256 --num-prompts 256 --kv-cache-dtype fp8 --json-out $FINAL/$1.json > $FINAL/$1.log 2>&1
  el "$1: $(grep 'Output tokens/s' $FINAL/$1.log || tail -3 $FINAL/$1.log)"
}
run tp_8b_fp8_1; run tp_8b_fp8_2
timeout 100 podium bench latency --model llama-3.1-8b-shape --max-model-len 1024 --no-progress --batch-size 1 \
  --input-len 512 --output-len 128 > $FINAL/latency_8b.log 2>&1; el "latency_8b: $(grep -i 'per token\|decode' $FINAL/latency_8b.log | tail -2 | tr '\n' ' ')"
el done
