"""The one-row FP8 and AWQ GEMV variants compiled for an NVIDIA target on any machine, with the instructions
a weight their main loop issues (the figure that says whether a variant can be bandwidth-bound):

    python platforms/cuda/scripts/gemv_sass.py [--arch 90] [--shape 28672x4096 ...]

No GPU needed: each launch the launcher would make for CPU tensors of the 8B shapes is captured and
compiled (decode_ir.compile_launch, integer arguments equal to 1 specialized as the JIT does, PDL and
the L2 prefetch on, the PTX path of the packed AWQ kernel), then disassembled with the wheel's
nvdisasm. A "loop" is a backward branch's body; its count over the weights a thread handles per
iteration is the figure (FP8: TILE rows x BLOCK_K bytes a step over the program's threads; AWQ: a
group of GROUP rows x 2 words a thread).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import tempfile

import torch
import triton
from decode_ir import compile_launch as compile_specialized

FP8_VARIANTS = {"cuda cores": {}, "packed": {"fp8_gemv_packed": True}, "packed bits": {"fp8_gemv_packed": True, "fp8_gemv_bits": True},
                "tensor cores": {"fp8_gemv_dot": True}}
AWQ_VARIANTS = {"float32": {}, "packed": {"int4_gemv_packed": True}}
ON_DEVICE = {"PDL": True, "PREFETCH": True, "launch_pdl": True, "HW_ASM": True, "HW_CAST": True}


class _Capture:
    def __init__(self) -> None:
        self.launch = None

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launch = (args, kwargs)
        return record


def capture(module, name: str, call) -> tuple:
    """(kernel, (args, kwargs)) of the launch ``call()`` makes of ``module.name``, as on an sm90 device."""
    kernel, stand_in = getattr(module, name), _Capture()
    setattr(module, name, stand_in)
    try:
        call()
    finally:
        setattr(module, name, kernel)
    args, kwargs = stand_in.launch
    kwargs = dict(kwargs, **{k: v for k, v in ON_DEVICE.items() if k in kernel.arg_names or k == "launch_pdl"})
    return kernel, (args, kwargs)


def compile_launch(kernel, launch, arch: int):
    """decode_ir.compile_launch with the JIT's specialization of integer arguments equal to 1 (the others stay
    runtime arguments, as in a launch: a loop over one keeps its runtime trip count)."""
    args, kwargs = launch
    values = dict(zip(kernel.arg_names, args)) | kwargs
    keep = {kernel.arg_names[a] if isinstance(a, int) else a for a in kernel.do_not_specialize or ()}
    ones = {n: 1 for n, v in values.items() if type(v) is int and v == 1 and n not in kwargs and n not in keep}
    return compile_specialized(kernel, (args, kwargs | ones), arch)


def _cubin_tool(compiled, tool: str, flag: str) -> str:
    """The output of the wheel's ``tool`` (nvdisasm, cuobjdump) run with ``flag`` on ``compiled``'s cubin."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([path, flag, f.name], capture_output=True, text=True, check=True).stdout


def sass(compiled) -> str:
    return _cubin_tool(compiled, "nvdisasm", "-c")


def registers(compiled) -> int:
    """Registers a thread of ``compiled`` holds (cuobjdump's resource usage of its cubin)."""
    return int(re.search(r"REG:(\d+)", _cubin_tool(compiled, "cuobjdump", "--dump-resource-usage")).group(1))


def loops(text: str) -> list[tuple[int, collections.Counter]]:
    """(instructions, opcode counts) of each backward branch's body in nvdisasm's output."""
    labels, instructions, current = {}, [], None
    for line in text.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            current = label.group(1)
            continue
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if found:
            address = int(found.group(1), 16)
            if current:
                labels[current], current = address, None
            instructions.append((address, found.group(2).strip()))
    bodies = []
    for address, text_ in instructions:
        target = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text_)
        if target and labels.get(target.group(1), address + 1) < address:
            body = [i for a, i in instructions if labels[target.group(1)] <= a <= address]
            bodies.append((len(body), collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0]
                                                          for i in body)))
    return bodies


def fp8_build(n: int, k: int, changes: dict, arch: int = 90):
    """(compiled, weights a thread handles per main-loop iteration) of the one-row FP8 GEMV."""
    from podium_cuda import fp8_gemv
    from podium_cuda.tuning import CUDA_TUNING

    tuning = dataclasses.replace(CUDA_TUNING, **({"fp8_gemv_dot": False} | changes))
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    w, s = torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(n, 1)
    kernel, launch = capture(fp8_gemv, "fp8_gemv_kernel", lambda: fp8_gemv.fp8_gemv(x, w, s, tuning=tuning))
    kw = launch[1]
    per_thread = kw["TILE"] * kw["BLOCK_K"] / (32 * kw["num_warps"])
    return compile_launch(kernel, launch, arch), per_thread


def awq_build(n: int, k: int, changes: dict, arch: int = 90):
    """(compiled, weights a thread handles per group) of the one-row AWQ GEMV."""
    from podium_cuda import awq_gemv, int4_gemv
    from podium_cuda.tuning import CUDA_TUNING
    from podium_plugin_api.int4 import AWQ

    tuning = dataclasses.replace(CUDA_TUNING, **changes)
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    qweight, qzeros = torch.zeros(k, n // 8, dtype=torch.int32), torch.zeros(k // 128, n // 8, dtype=torch.int32)
    scales = torch.zeros(k // 128, n, dtype=torch.bfloat16)
    kernel, launch = capture(awq_gemv, "awq_gemv_kernel",
                             lambda: int4_gemv.int4_gemv(x, qweight, qzeros, scales, 128, AWQ, tuning=tuning))
    return compile_launch(kernel, launch, arch), 128 * 2 * 8 // launch[1]["SUB_ROWS"]


def mma_build(n: int, k: int, changes: dict, arch: int = 90):
    """(compiled, weight bytes a thread handles per main-loop iteration) of the one-row FP8 warp-MMA GEMV
    (fp8_mma_gemv.py: its launch as fp8_mma_gemv would make it on a device of 132 multiprocessors)."""
    from podium_cuda import fp8_mma_gemv
    from podium_cuda.tuning import CUDA_TUNING, register_cap

    tuning = dataclasses.replace(CUDA_TUNING, **({"fp8_gemv_mma": True} | changes))
    warps, unroll, splits = fp8_mma_gemv.config(n, k, 132, tuning)
    out = torch.zeros(1, n, dtype=torch.bfloat16)
    args = (out, torch.zeros(splits, n), torch.zeros(4096, dtype=torch.int32), torch.zeros(n, k // 4, dtype=torch.int32),
            torch.ones(n), out, torch.zeros(k // 4, dtype=torch.int32), torch.ones(1), n, k // 4,
            k // 4 // (splits * warps), splits)
    kwargs = {"WARPS": warps, "UNROLL": unroll, "PER_CHANNEL": True, "HAS_BIAS": False, "PDL": True,
              "PREFETCH": tuning.fp8_mma_prefetch, "BULK": tuning.fp8_mma_bulk_prefetch, "num_warps": warps,
              "num_stages": 1, "launch_pdl": True, **register_cap(tuning.fp8_mma_maxnreg)}
    return compile_launch(fp8_mma_gemv.fp8_mma_gemv_kernel, (args, kwargs), arch), 2 * fp8_mma_gemv.STEP * unroll


def awq_mma_build(n: int, k: int, changes: dict, arch: int = 90, group: int = 128, rows: int = 1):
    """(compiled, weights a thread handles per main-loop iteration: a group) of the AWQ warp-MMA GEMV
    (awq_mma_gemv.py: its launch as awq_mma_gemv would make it on a device of 132 multiprocessors) for
    ``rows`` rows (one: the ONE_ROW build); weights: a chunk of groups."""
    from podium_cuda import awq_mma_gemv
    from podium_cuda.tuning import CUDA_TUNING, register_cap

    tuning = dataclasses.replace(CUDA_TUNING, **changes)
    warps, splits, chunk = awq_mma_gemv.config(n, k, group, 132, tuning)
    out = torch.zeros(1, n, dtype=torch.bfloat16)
    args = (out, torch.zeros(splits, n), torch.zeros(4096, dtype=torch.int32),
            torch.zeros(n // 16, k // 64, 32, 4, dtype=torch.int32), torch.ones(k // group, n),
            torch.zeros(k // group, n // 8, dtype=torch.int32), out, torch.zeros(k // 2, dtype=torch.int32),
            torch.zeros(k // group), torch.ones(1), rows, n, k // awq_mma_gemv.STEP_K, k // group // (splits * warps),
            splits)
    kwargs = {"WARPS": warps, "GROUP_STEPS": group // awq_mma_gemv.STEP_K, "CHUNK": chunk, "HAS_BIAS": False,
              "PDL": True, "HW_ASM": True, "ONE_ROW": rows == 1, "PREFETCH": tuning.int4_mma_prefetch,
              "AHEAD": tuning.int4_mma_ahead or chunk > 1, "num_warps": warps,
              "num_stages": 1, "launch_pdl": True, **register_cap(tuning.int4_mma_maxnreg)}
    return (compile_launch(awq_mma_gemv.awq_mma_gemv_kernel, (args, kwargs), arch),
            32 * chunk * group // awq_mma_gemv.STEP_K)


def per_weight(compiled, weights: float) -> tuple[float, collections.Counter]:
    """The largest loop's instructions over ``weights``, and its opcodes."""
    count, ops = max(loops(sass(compiled)), key=lambda body: body[0])
    return count / weights, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--shape", nargs="+", default=["28672x4096", "4096x14336"], help="N x K")
    args = parser.parse_args()
    for shape in args.shape:
        n, k = map(int, shape.split("x"))
        for family, variants, build in (("fp8", FP8_VARIANTS, fp8_build), ("awq", AWQ_VARIANTS, awq_build)):
            for label, changes in variants.items():
                compiled, weights = build(n, k, changes, args.arch)
                figure, ops = per_weight(compiled, weights)
                print(f"{family} {label:12s} {n} x {k}: {figure:.2f} instructions a weight; "
                      + ", ".join(f"{op} {c}" for op, c in ops.most_common(8)), flush=True)


if __name__ == "__main__":
    main()
