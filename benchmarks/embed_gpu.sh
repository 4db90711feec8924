#!/usr/bin/env bash
# Embedding models on one NVIDIA GPU (~2-4 min): tiny BERT and Qwen3 pooling models against
# transformers (float32, bfloat16), then a BERT-base shape's embeddings/s against transformers.
# Results in $OUT/summary.txt (see benchmarks/embed_gpu.py). Needs torch, transformers, triton,
# safetensors, pluggy, numpy; the repository installed with:
#   pip install --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cuda -e ./bench
set -euo pipefail
OUT="${OUT:-$(mktemp -d)}"
cd "$(dirname "$0")/.."
if ! python -c "import podium, podium_cuda" 2>/dev/null; then
  pip install -q --no-deps --no-build-isolation -e ./plugin_api -e ./core -e ./platforms/cuda -e ./bench
fi
python benchmarks/embed_gpu.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/embed_gpu.log"
echo "summary: $OUT/summary.txt"
cat "$OUT/summary.txt"
