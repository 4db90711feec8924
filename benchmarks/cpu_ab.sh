#!/usr/bin/env bash
# Alternated A/B of the 32 x 48/128 bf16 run between an earlier revision and this checkout, in one window:
#   bash benchmarks/cpu_ab.sh BASE_REV [ROUNDS] [extra `podium bench throughput` options...]
# BASE_REV runs from a git worktree of it (its packages first on PYTHONPATH, this checkout's .venv otherwise;
# its native kernels build into the same cache under their own hashes). Prints "base X new Y" (out tok/s) a round,
# base first in odd rounds and new first in even ones.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: bash benchmarks/cpu_ab.sh BASE_REV [ROUNDS] [bench options...]}
ROUNDS=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
TREE=$(mktemp -d)/base
git worktree add -f --detach "$TREE" "$BASE" > /dev/null 2>&1 || { echo "no revision $BASE" >&2; exit 1; }
trap 'git worktree remove --force "$TREE"' EXIT
SRC=""
for d in core plugin_api server bench platforms/cpu platforms/cuda platforms/rocm platforms/tpu; do SRC="$SRC:$TREE/$d/src"; done
REQUESTS=$(mktemp --suffix .jsonl)
.venv/bin/python benchmarks/export_requests.py --out "$REQUESTS" --model smollm2-135m-instruct --num-prompts 32 \
    --input-len 48 --output-len 128 > /dev/null 2>&1 || exit 1
run() {
    .venv/bin/podium bench throughput --model smollm2-135m-instruct --dtype bfloat16 --dataset file \
        --dataset-path "$REQUESTS" --num-prompts 32 --no-progress "$@" 2>&1 | awk '/Output tokens\/s/ {print $3}'
}
# the order swaps every round: the run that goes first in a round is faster by itself (~4% at this size
# on a 2-vCPU EPYC: median 908 against 872 out tok/s over 8 rounds of two equal-speed builds)
for i in $(seq 1 "$ROUNDS"); do
    if [ $((i % 2)) -eq 1 ]; then
        base=$(PYTHONPATH=${SRC#:} run "$@"); new=$(run "$@")
    else
        new=$(run "$@"); base=$(PYTHONPATH=${SRC#:} run "$@")
    fi
    echo "base $base new $new"
done
