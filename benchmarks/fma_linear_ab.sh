#!/usr/bin/env bash
# A/B of the CPU platform's bf16 FMA linear kernel between two git revisions, outside Python (the
# kernel alone: no interpreter, no torch), runs alternated so both see the same machine:
#
#   bash benchmarks/fma_linear_ab.sh REV_A REV_B [ROUNDS]      (from the repo root; needs gcc, AVX2 + FMA)
#
# Shapes: SmolLM2-135M's gate_up / down / qkv / lm_head at 32 rows, gate_up at 1,536 and at 1 row,
# 2 threads. Prints every run; compare the best of each revision per shape.
set -euo pipefail
A=${1:?usage: fma_linear_ab.sh REV_A REV_B [ROUNDS]}
B=${2:?usage: fma_linear_ab.sh REV_A REV_B [ROUNDS]}
ROUNDS=${3:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for rev in "$A" "$B"; do
  mkdir -p "$work/$rev"
  for f in fma_linear.c bf16.h; do
    git show "$rev:platforms/cpu/src/podium_cpu/native/$f" > "$work/$rev/$f"
  done
  gcc -O3 -march=native -fopenmp -fno-math-errno -fno-trapping-math -I"$work/$rev" \
    benchmarks/fma_linear_bench.c "$work/$rev/fma_linear.c" -o "$work/$rev/bench"
done
shapes=("32 3072 576 2 30" "32 576 1536 2 30" "32 960 576 2 30" "32 49152 576 2 3" "1536 3072 576 2 3" "1 3072 576 2 30")
for r in $(seq 1 "$ROUNDS"); do
  for shape in "${shapes[@]}"; do
    for rev in "$A" "$B"; do
      echo "round $r $rev: $("$work/$rev/bench" $shape)"
    done
  done
done
