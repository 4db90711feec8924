"""The CPU platform's fused norm / SiLU-mul + FMA linear (plugin API 1.5 ops) against "op, then linear".

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_fused_linear_ab.py pairs [--rounds 3]
    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_fused_linear_ab.py step {fused,unfused} [decode_breakdown args]

``pairs``: SmolLM2-135M's shapes at a 32-row decode step (x [32, 576] -> qkv [960], gate_up
[32, 3072] -> down [576]), best of 5 x 100 calls per round, rounds alternated. ``step``: one
``decode_breakdown.py`` run with the CPU platform's rms_norm_linear / silu_and_mul_linear installed
(fused) or left to the core's composition (unfused); alternate the two by hand. Needs an AVX2 build
of the native kernels (the FmaLinear path).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

FUSED = ("rms_norm_linear", "silu_and_mul_linear")


def pairs(rounds: int) -> None:
    from podium_cpu import fused_ops
    from podium_cpu.linear_packing import FmaLinear
    from podium_cpu.native_kernels import load_kernels

    k, why = load_kernels()
    if k is None or not k.fma_fused_linear:
        raise SystemExit(f"no native FMA kernel here: {why or 'this build has no AVX2 + FMA'}")

    def layer(k_in: int, n: int) -> FmaLinear:
        return FmaLinear(nn.Linear(k_in, n, bias=False).bfloat16(), k.fma_linear[torch.bfloat16],
                         k.fma_pack[torch.bfloat16])

    qkv, down = layer(576, 960), layer(1536, 576)
    x, r, w = torch.randn(32, 576).bfloat16(), torch.randn(32, 576).bfloat16(), torch.ones(576).bfloat16()
    gate_up = torch.randn(32, 3072).bfloat16()
    cases = {
        "add + norm -> qkv, fused": lambda: fused_ops.rms_norm_linear(k, x, r, w, 1e-5, qkv),
        "add + norm -> qkv, op then linear": lambda: qkv(fused_ops.fused_add_rms_norm(k, x, r, w, 1e-5)[0]),
        "silu -> down, fused": lambda: fused_ops.silu_and_mul_linear(k, gate_up, down),
        "silu -> down, op then linear": lambda: down(fused_ops.silu_and_mul(k, gate_up)),
    }
    for round_ in range(rounds):
        for name, fn in cases.items():
            for _ in range(20):
                fn()
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(100):
                    fn()
                best = min(best, (time.perf_counter() - start) / 100)
            print(f"round {round_}  {name:36s} {best * 1e6:8.1f} us")


def step(mode: str, args: list[str]) -> None:
    if mode not in ("fused", "unfused"):
        raise SystemExit(f"step takes fused or unfused, got {mode!r}")
    if mode == "unfused":
        import podium_cpu.platform as platform

        cpu_ops = platform.cpu_ops
        platform.cpu_ops = lambda kernels: {n: f for n, f in cpu_ops(kernels).items() if n not in FUSED}
    sys.path.insert(0, str(Path(__file__).parent))
    import decode_breakdown

    sys.argv = ["decode_breakdown.py", *args]
    decode_breakdown.main()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "pairs":
        pairs(int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3)
    elif len(sys.argv) >= 3 and sys.argv[1] == "step":
        step(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(__doc__)
