#!/usr/bin/env bash
# session 12 call 3: varlen cuDNN attention on fresh prompts (call3_cudnn_varlen.py)
OUT=/tmp/w3 bash benchmarks/gpu_session.sh none > /dev/null 2>&1
timeout 200 python3 benchmarks/results/gpu-2026-12-02-s12/call3_cudnn_varlen.py 2>&1 | grep -v Warning | tee $OUT/cudnn_varlen.log
