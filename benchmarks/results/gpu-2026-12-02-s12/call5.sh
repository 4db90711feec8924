#!/usr/bin/env bash
# session 12 call 5: FlashAttention-3 availability; batched cuDNN SDPA's first-call cost per prompt length
timeout 120 python3 benchmarks/results/gpu-2026-12-02-s12/call5_checks.py 2>&1 | grep -v Warn | tee $OUT/checks.log
