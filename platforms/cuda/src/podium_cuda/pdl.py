"""Programmatic dependent launch (PDL, NVIDIA sm90+): a kernel may start before the one ahead of it ends.

A kernel launched with ``launch_pdl=True`` is scheduled once every program of the kernel before it
has called ``gdc_launch_dependents`` (or exited); it must call ``gdc_wait`` before it reads what
that kernel writes, or writes anything. What it does before the wait (loading weights no kernel
writes, or just being resident) overlaps the previous kernel's tail and the launch latency, which
at batch-1 decode is a large part of each small kernel's time. Captured CUDA graphs keep the
dependency as a programmatic edge. Never on ROCm, under Triton's interpreter or before sm90.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

try:  # NVIDIA's grid dependency control; a Triton build without it never takes the PDL path
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


@cache
def nvidia_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    """Whether ``device`` is an NVIDIA GPU (not HIP, not the interpreter's CPU) of ``capability`` or newer."""
    return (device.type == "cuda" and not getattr(torch.version, "hip", None)
            and torch.cuda.get_device_capability(device) >= capability)


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched as programmatic dependent launches."""
    return gdc_wait is not None and nvidia_at_least(device, (9, 0))


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at ``ptrs`` (one address a 128-byte line) without waiting for them: a kernel
    whose own first steps read only what the previous kernel wrote (a norm over the row, say) has its
    first weights on the way meanwhile, and with PDL during the previous kernel's tail. A hint with no
    result (NVIDIA only; never under the interpreter)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_l2_where(ptrs, ask):
    """``prefetch_l2`` of the elements where ``ask`` (int32, broadcast against ``ptrs``) is nonzero: for a
    tensor whose threads hold several elements with the same line, one of them asks."""
    tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t@p prefetch.global.L2 [$1];\n\t}"
                              "\n\tmov.u32 $0, 0;", "=r,l,r", [ptrs, ask], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_l2_bulk(ptrs, nbytes, ask):
    """Ask L2 for ``nbytes`` (a multiple of 16) from each 16-byte aligned address in ``ptrs`` where ``ask``
    (int32, broadcast against ``ptrs``) is nonzero, one instruction a stretch (sm90's bulk prefetch, no
    registers held while the bytes come): a warp that asks for its whole stretch of weights at its start
    has every byte of it in flight at once, where loads into registers keep a step or two (NVIDIA sm90+
    only; never under the interpreter)."""
    tl.inline_asm_elementwise("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $3;"
                              "\n\t}\n\tmov.u32 $0, 0;", "=r,l,r,r", [ptrs, ask, nbytes], dtype=tl.int32, is_pure=False,
                              pack=1)


def launch_options(enabled: bool) -> dict:
    """The extra launch keyword for a PDL launch (none otherwise)."""
    return {"launch_pdl": True} if enabled else {}
