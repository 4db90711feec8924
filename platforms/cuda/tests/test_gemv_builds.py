"""The packed one-row GEMVs built for sm90 on any machine (Triton's compiler and the wheel's ptxas /
nvdisasm, no GPU): the inline-PTX AWQ kernel assembles, and both main loops stay at the instruction
counts that make them candidates for bandwidth-bound decode (platforms/cuda/scripts/gemv_sass.py
prints them all; the float32 / plain loops take ~4.7 / ~6.2 a weight). Triton's interpreter replaces
the JIT functions, so these run without it."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def gemv_sass():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("Triton's interpreter replaces the JIT functions this compiles")
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("needs triton with its NVIDIA backend")
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gemv_sass
    finally:
        sys.path.remove(str(SCRIPTS))
    return gemv_sass


def _counts_calibrated() -> bool:
    """The instruction-count bounds were read off Triton 3.9's sm90 builds; another Triton schedules
    differently, so there the builds are still made and assembled but the counts are not judged."""
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2]) == (3, 9)


def test_packed_fp8_gemv_loop(gemv_sass):
    figure, ops = gemv_sass.per_weight(*gemv_sass.fp8_build(28672, 4096, {"fp8_gemv_packed": True}))
    if not _counts_calibrated():
        pytest.skip("built; the instruction-count bounds are Triton 3.9's")
    assert figure < 2.5, f"{figure:.2f} instructions a weight: {dict(ops.most_common(8))}"
    assert ops["HFMA2"] + ops["HMUL2"] > 0 and ops["FFMA"] == 0, "the products are not packed f16"


def test_packed_awq_gemv_loop(gemv_sass):
    compiled, weights = gemv_sass.awq_build(28672, 4096, {"int4_gemv_packed": True})
    assert "fma.rn.f16x2" in compiled.asm["ptx"] and "lop3.b32" in compiled.asm["ptx"]
    figure, ops = gemv_sass.per_weight(compiled, weights)
    if not _counts_calibrated():
        pytest.skip("built and assembled; the instruction-count bounds are Triton 3.9's")
    assert figure < 3.0, f"{figure:.2f} instructions a weight: {dict(ops.most_common(8))}"


def test_fp8_mma_gemv_loop(gemv_sass):
    """The warp-MMA GEMV's main loop: its MMAs read the 16-byte loads' words as they are (no shared memory,
    no layout conversion, no spills), two MMAs and three 16-byte loads a step of 64 K bytes a lane, and
    well under an instruction a weight byte (sm90 runs each fp8 MMA as a conversion and two f16 HMMAs)."""
    compiled, weight_bytes = gemv_sass.mma_build(28672, 4096, {})  # unsplit: a warp loops over 1,024 bytes
    ptx = compiled.asm["ptx"]
    assert "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" in ptx
    assert "ld.global.v4.b32" in ptx, "the weight is not loaded 16 bytes a lane: the MMA operands' layout breaks"
    count, ops = max(gemv_sass.loops(gemv_sass.sass(compiled)), key=lambda body: body[0])
    assert ops["LDS"] == ops["STS"] == ops["STL"] == ops["LDL"] == ops["BAR"] == 0, dict(ops)
    assert ops["LDG"] == 12 and ops["HMMA"] == 16, dict(ops)  # 4 steps: 3 loads and 2 fp8 MMAs each
    # the MMAs' operands: 4 words a thread, a warp's 32 lanes down the rows (lane = row % 32), whatever the
    # unroll. A layout that spreads lanes over the unrolled steps (as Triton 3.6 did with a third
    # dimension for them) hands each MMA other lanes' words: results wrong, nothing else changes.
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", compiled.asm["ttgir"], re.M))
    mma = re.findall(r'tt\.elementwise_inline_asm "mma\.sync[^\n]*-> tensor<\d+x4xf32, (#\w+)>', compiled.asm["ttgir"])
    assert mma and all(layouts.get(name, "").startswith(
        "#ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [32, 1], warpsPerCTA = [4, 1]") for name in mma), \
        [layouts.get(name) for name in mma]
    if not _counts_calibrated():
        pytest.skip("built; the instruction-count bounds are Triton 3.9's")
    assert count / weight_bytes < 0.6, f"{count / weight_bytes:.2f} instructions a weight byte: {dict(ops)}"


@pytest.mark.parametrize("chunk", [1, 2])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("group", [64, 128, 256])
def test_awq_mma_gemv_loop(gemv_sass, group, rows, chunk):
    """The AWQ warp-MMA GEMV's main loop (``chunk`` groups a warp an iteration): its MMAs read the 16-byte loads' words as they are
    (no shared memory, no layout conversion, no spills), one 16-byte weight load and four MMAs a super-step
    of 64 k, and the sums' layout a thread's four words down the rows (lane = row % 32): the layout Triton
    3.6 gave the MMA's operands when a group's scales and zeros were gathered as [rows, 4] tensors spread a
    thread's four sums over other rows. One row: only the sums of B's first column are kept (the others are
    never computed); eight rows: every column's, a zero term a column."""
    compiled, per_thread = gemv_sass.awq_mma_build(28672, 4096, {"int4_mma_programs": 0, "int4_mma_warps": 4,
                                                                 "int4_mma_groups": chunk}, group=group, rows=rows)
    chunk = per_thread * 64 // (32 * group)  # as config gives it (at most four super-steps in flight)
    ptx = compiled.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert "ld.global.v4.b32" in ptx, "the weight is not loaded 16 bytes a lane: the MMA operands' layout breaks"
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", compiled.asm["ttgir"], re.M))
    mma = re.findall(r'tt\.elementwise_inline_asm "\{[^\n]*mma\.sync[^\n]*-> tensor<\d+x4xf32, (#\w+)>',
                     compiled.asm["ttgir"])
    assert mma and all(layouts.get(name, "").startswith(
        "#ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [32, 1], warpsPerCTA = [") for name in mma), \
        [layouts.get(name) for name in mma]
    count, ops = max(gemv_sass.loops(gemv_sass.sass(compiled)), key=lambda body: body[0])
    assert ops["LDS"] == ops["STS"] == ops["STL"] == ops["LDL"] == ops["BAR"] == 0, dict(ops)
    # four m16n8k16 a super-step, a chunk's super-steps an iteration (or several chunks, where unrolled)
    assert ops["HMMA"] and ops["HMMA"] % (4 * chunk * (group // 64)) == 0, dict(ops)
    weights = 8 * ops["HMMA"]  # an m16n8k16's 256 weights are 8 a lane
    if not _counts_calibrated():
        pytest.skip("built; the instruction-count bounds are Triton 3.9's")
    # a group of 64 spreads its zero and scale work over half the weights
    assert count / weights < (2.2 if rows == 1 else 2.6) + (0.5 if group == 64 else 0), f"{count / weights:.2f} instructions a weight: {dict(ops)}"


@pytest.mark.parametrize("changes", [{"int4_mma_prefetch": True}, {"int4_mma_prefetch": True, "int4_mma_ahead": False},
                                     {"int4_mma_ahead": False}])
def test_awq_mma_gemv_bulk_prefetch_and_loads_in_the_iteration(gemv_sass, changes):
    """The AWQ MMA GEMV's L2 bulk prefetch of a warp's stretch assembles (sm90's UBLKPF, one a warp, before the
    loop), and loading a group's operands in its own iteration (``int4_mma_ahead`` off) holds fewer registers
    than loading them an iteration ahead, without spilling: the two levers against its memory-latency bound."""
    compiled, _ = gemv_sass.awq_mma_build(28672, 4096, changes)
    text = gemv_sass.sass(compiled)
    if changes.get("int4_mma_prefetch"):
        assert "cp.async.bulk.prefetch.L2.global" in compiled.asm["ptx"] and "UBLKPF" in text
    assert not re.search(r"\b(STL|LDL)\b", text), "spills"
    if changes.get("int4_mma_ahead") is False:
        ahead, _ = gemv_sass.awq_mma_build(28672, 4096, {k: v for k, v in changes.items() if k != "int4_mma_ahead"})
        assert gemv_sass.registers(compiled) < gemv_sass.registers(ahead)


def test_fp8_mma_gemv_bulk_prefetch(gemv_sass):
    """The FP8 MMA GEMV's bulk prefetch of a warp's 16 row stretches assembles, outside the main loop."""
    compiled, _ = gemv_sass.mma_build(28672, 4096, {"fp8_mma_bulk_prefetch": True})
    text = gemv_sass.sass(compiled)
    assert "cp.async.bulk.prefetch.L2.global" in compiled.asm["ptx"] and "UBLKPF" in text
    _, ops = max(gemv_sass.loops(text), key=lambda body: body[0])
    assert ops["UBLKPF"] == 0, dict(ops)
