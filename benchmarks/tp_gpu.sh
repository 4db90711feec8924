#!/usr/bin/env bash
# Tensor parallelism on one H200: tensor_parallel_size=1 must leave the single-GPU figures unchanged.
#
#   BASE_TREE=folder bash benchmarks/tp_gpu.sh      (or BASE_REF=commit with .git present; from the repo root)
#
# Steps (one device call): nccl (the platform's Communicator over NCCL in a world of one: init, all_reduce,
# all_gather, broadcast on the GPU), engine (tests/test_tensor_parallel.py's CPU checks run here too),
# ab (Llama-3.1-8B shape, 256 x 512/256, bf16: the base tree, then this tree with -tp 1, same command,
# A B A B; the ratio this/base in summary.txt). Without BASE_TREE/BASE_REF only this tree's run is made.
# Needs torch with CUDA, triton, transformers, safetensors, pluggy, numpy; no network.
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/podium_tp_gpu_out}
mkdir -p "$OUT"
HERE=$(pwd)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"

install_tree() {
  local bench=()
  [ -d "$1/bench" ] && bench=(-e "$1/bench")
  python3 -m pip install -q --no-deps --no-build-isolation -e "$1/plugin_api" -e "$1/core" -e "$1/platforms/cpu" \
    -e "$1/platforms/cuda" "${bench[@]}" 2>&1 | { grep -v -i warning || true; } | tail -3
}

run_step() {
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-6}" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}

throughput() {  # throughput NAME [EXTRA...]: the base tree predates -tp, so only this tree passes it
  local name=$1; shift
  TAIL=3 run_step "$name" 240 podium bench throughput --model llama-3.1-8b-shape --max-model-len 1024 --dataset random \
    --input-len 512 --output-len 256 --num-prompts 256 --no-progress --json-out "$OUT/$name.json" "$@"
}

base_tree() {
  if [ -n "$BASE_TREE" ]; then echo "$BASE_TREE"; return; fi
  [ -n "$BASE_REF" ] || return 1
  local dir=/tmp/podium_tp_base
  rm -rf "$dir" && mkdir -p "$dir" && git archive "$BASE_REF" | tar -x -C "$dir" && echo "$dir"
}

install_tree "$HERE"
TAIL=4 run_step nccl 120 python3 - <<'PY'
import os, torch
from podium_plugin_api import Communicator
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
torch.cuda.set_device(0)
torch.distributed.init_process_group("nccl", rank=0, world_size=1)
x = torch.arange(6, dtype=torch.float32, device="cuda").reshape(2, 3)
torch.distributed.all_reduce(x)  # the collective itself, which Communicator skips at size 1
comm = Communicator(0, 1)
assert torch.equal(comm.all_reduce(x.clone()), x) and torch.equal(comm.all_gather(x), x)
assert torch.equal(comm.broadcast(x.clone()), x)
torch.distributed.destroy_process_group()
print("nccl world of one: all_reduce, all_gather, broadcast ok")
PY
[ -n "$SKIP_ENGINE" ] || run_step engine 200 python3 -m pytest tests/test_tensor_parallel.py -q -p no:cacheprovider -x -k "not smollm2"
base=$(base_tree)
for round in 1 2; do
  if [ -n "$base" ]; then install_tree "$base" && throughput "base_$round"; fi
  install_tree "$HERE" && throughput "this_$round" -tp 1
done
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import json, statistics, sys
out = sys.argv[1]
def rate(name):
    try:
        return json.load(open(f"{out}/{name}.json"))["results"]["podium"]["output_tokens_per_s"]
    except (OSError, KeyError, ValueError):
        return None
base, this = [rate(f"base_{r}") for r in (1, 2)], [rate(f"this_{r}") for r in (1, 2)]
print("8B 256 x 512/256 bf16 out tok/s at -tp 1: base", base, "this", this)
if None not in base + this:
    print(f"ratio this / base (medians): {statistics.median(this) / statistics.median(base):.3f}")
PY
