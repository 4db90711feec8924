"""The decode paged-attention kernel compiled ahead of time for an NVIDIA target, on any machine.

    python platforms/cuda/scripts/decode_ir.py [--arch 90] [--out DIR]

No GPU needed (Triton compiles for ``GPUTarget("cuda", arch, 32)``; ptxas ships with the wheel). It
captures the launch ``paged_attention`` makes for a batch-256, 640-token, Llama-3.1-8B-shaped
decode step, once per cache dtype (bf16, fp8 e4m3) and with / without the fused new-token path,
adds the divisibility-16 attributes the JIT would give (without them the IR is not the one that
runs), and prints instruction counts that tell the variants apart (async copies, shared loads,
converts, MMAs). ``--out`` keeps each variant's TTGIR and PTX.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import podium_cuda.paged_attention as pa
from podium_plugin_api import AttentionMetadata

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
NOT_SPECIALIZED = {"num_seqs", "num_splits", "window", "stride_bt"}  # the kernel's do_not_specialize
COUNTS = {"cp.async": r"cp\.async\.", "shared loads": r"ld\.shared|ldmatrix", "converts": r"\bcvt\.",
          "mma": r"\bmma\.|wgmma", "global loads": r"ld\.global"}


class _Capture:
    """Stands in for the kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self) -> None:
        self.launch = None

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launch = (args, kwargs)
        return record


def decode_launch(cache_dtype: torch.dtype, new_tokens: bool):
    num_seqs, length, block = 256, 640, 16
    width = -(-length // block)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(num_seqs)]
    meta = AttentionMetadata.from_lengths([1] * num_seqs, [length] * num_seqs, tables, block, device="cpu")
    query = torch.zeros(num_seqs, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, num_seqs * width + 1, block, 8, 128, dtype=cache_dtype)
    new = None
    if new_tokens:
        kv = torch.zeros(num_seqs, 8, 128, dtype=torch.bfloat16)
        new = pa.NewTokens(torch.zeros(num_seqs, dtype=torch.int64), kv, kv, torch.zeros(1024, 128), meta.slot_mapping)
    capture, kernel = _Capture(), pa.paged_attention_kernel
    pa.paged_attention_kernel = capture
    try:
        pa.paged_attention(query, cache[0], cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                           scale=128**-0.5, max_query_len=1, new_tokens=new)
    finally:
        pa.paged_attention_kernel = kernel
    return kernel, capture.launch


def compile_launch(kernel, launch, arch: int):
    args, kwargs = launch
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl", "maxnreg") if k in kwargs}
    values = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
        elif name in kwargs:
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
        aligned = isinstance(value, torch.Tensor) or (signature[name] == "i32" and value % 16 == 0)
        if aligned and name not in NOT_SPECIALIZED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out", default=None)
    parser.add_argument("--fp8-triton-cast", action="store_true",
                        help="fp8 value tiles by Triton's cast (fp8_values_in_registers off); by default they convert "
                             "in registers as on an sm89+ GPU (the CPU tensors here would otherwise select the cast)")
    args = parser.parse_args()
    registers = pa.CUDA_TUNING.fp8_values_in_registers and not args.fp8_triton_cast
    pa._fp8_convert = lambda tuning, key_cache: registers and key_cache.element_size() == 1
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for new_tokens in (False, True):
            compiled = compile_launch(*decode_launch(cache_dtype, new_tokens), args.arch)
            ptx = compiled.asm["ptx"]
            name = f"{str(cache_dtype).replace('torch.', '')}-{'new_tokens' if new_tokens else 'cached'}"
            counts = ", ".join(f"{k} {len(re.findall(p, ptx))}" for k, p in COUNTS.items())
            print(f"{name:28s} shared {compiled.metadata.shared} B; {counts}")
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                Path(args.out, f"{name}.ttgir").write_text(compiled.asm["ttgir"])
                Path(args.out, f"{name}.ptx").write_text(ptx)


if __name__ == "__main__":
    main()
