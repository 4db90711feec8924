#!/usr/bin/env bash
# The batch-invariant GEMM (platforms/cuda invariant_gemm.py) on the GPU, bf16, at Llama-3.1-8B and
# Llama-3.2-1B linear shapes:
#   1. invariance: each of 8 rows computed alone == the same row inside batches of 7, 64 and 256
#      (the GEMM; cuBLAS's F.linear alongside, to show what the mode removes);
#   2. cost: time of the GEMM against cuBLAS at 1, 32, 256 and 2048 rows, same call, as a ratio.
#   bash benchmarks/invariant_gpu.sh        (results in $OUT/summary.txt; OUT defaults to ./invariant_out)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./invariant_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/platforms/cuda/src:$PWD/plugin_api/src${PYTHONPATH:+:$PYTHONPATH}"
python - "$OUT" <<'PY' 2>&1 | tee "$OUT/log.txt"
import sys, torch, triton
from torch.nn import functional as F
from podium_cuda.invariant_gemm import invariant_linear

out_dir = sys.argv[1]
SHAPES = {  # name: (K, N)
    "8B qkv": (4096, 6144), "8B o": (4096, 4096), "8B gate_up": (4096, 28672), "8B down": (14336, 4096),
    "1B qkv": (2048, 3072), "1B o": (2048, 2048), "1B gate_up": (2048, 16384), "1B down": (8192, 2048),
    "1B lm_head": (2048, 128256),
}
dev, dt = "cuda", torch.bfloat16
lines = [f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16"]
for name, (k, n) in SHAPES.items():
    g = torch.Generator(device=dev).manual_seed(k + n)
    w = torch.randn(n, k, device=dev, dtype=dt, generator=g) / k ** 0.5
    x = torch.randn(2048, k, device=dev, dtype=dt, generator=g)
    differ = {"gemm": 0, "cublas": 0}
    for fn_name, fn in (("gemm", invariant_linear), ("cublas", F.linear)):
        for rows in (7, 64, 256):
            batch = fn(x[:rows], w)
            for i in range(min(8, rows)):
                differ[fn_name] += int(not torch.equal(fn(x[i:i + 1], w), batch[i:i + 1]))
    ref = (x[:64].double() @ w.double().T)
    err = ((invariant_linear(x[:64], w).double() - ref).norm() / ref.norm()).item()
    times = {}
    for rows in (1, 32, 256, 2048):
        xs = x[:rows]
        t_g = triton.testing.do_bench(lambda: invariant_linear(xs, w), warmup=10, rep=50)
        t_c = triton.testing.do_bench(lambda: F.linear(xs, w), warmup=10, rep=50)
        times[rows] = (t_g, t_c)
    ratio = " ".join(f"M={r}: {tc / tg:.2f}x" for r, (tg, tc) in times.items())
    lines.append(f"{name:12s} K={k} N={n}: rows alone != in batch: gemm {differ['gemm']}/24, cuBLAS "
                 f"{differ['cublas']}/24; rel err {err:.1e}; speed gemm/cuBLAS {ratio}")
    print(lines[-1], flush=True)
open(f"{out_dir}/summary.txt", "w").write("\n".join(lines) + "\n")
PY
