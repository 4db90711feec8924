"""The batch-invariant GEMM's tiling table (plain data, no triton): which kernel and which tiles
multiply a weight of shape [N, K], chosen from (N, K, dtype) alone, never from the number of rows.

A ``GemmTiling`` names a kernel of invariant_gemm.py and its tiles; a ``GemmPlan`` is a default
tiling plus exact tilings for listed (N, K) shapes. Its text form (the ``tuning`` option's
``invariant_gemm`` field, and what benchmarks/invariant_gemm_gpu.py prints) is items joined by ``;``:

    tma/128/128/64/8/3;6144:4096=tma/128/128/64/4/4;4096:4096=tiles/64/128/64/4/4

an item without ``N:K=`` is the default (omitted: ``DEFAULT_TILING``); a tiling is
``[kernel/]block_m/block_n/block_k/num_warps/num_stages`` (no kernel: ``tiles``).
"""

from __future__ import annotations

from dataclasses import dataclass

# tiles: one program per output tile, pointer loads (any GPU Triton runs on, and the fallback)
# tma: persistent programs over the output tiles with TMA (tensor-descriptor) loads (Hopper, sm90)
# tma_ws: tma with Triton's warp specialization of the tile loop (a producer warp issues the loads)
KERNELS = ("tiles", "tma", "tma_ws")
TILING_FORM = "[kernel/]block_m/block_n/block_k/num_warps/num_stages"


@dataclass(frozen=True)
class GemmTiling:
    """A program computes block_m x block_n outputs walking K block_k at a time, in one order, with
    ``kernel`` (KERNELS). Taken from the weight's shape and dtype, never from the number of rows, so
    every row is summed in one order whatever the batch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    kernel: str = "tiles"

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            too_small = value < (1 if name == "num_warps" else 16)
            if too_small or value & (value - 1):
                raise ValueError(f"GemmTiling.{name} must be a power of two (>= 16 for blocks), got {value}")
        if self.num_stages < 1:
            raise ValueError(f"GemmTiling.num_stages must be >= 1, got {self.num_stages}")
        if self.kernel not in KERNELS:
            raise ValueError(f"GemmTiling.kernel must be one of {KERNELS}, got {self.kernel!r}")

    def text(self) -> str:
        return "/".join((self.kernel, *map(str, (self.block_m, self.block_n, self.block_k, self.num_warps,
                                                  self.num_stages))))

    @classmethod
    def parse(cls, text: str) -> GemmTiling:
        parts = text.strip().lower().split("/")
        kernel = parts.pop(0) if parts and parts[0] in KERNELS else "tiles"
        if len(parts) != 5 or not all(p.isdigit() for p in parts):
            raise ValueError(f"a GEMM tiling is {TILING_FORM} with kernel one of {KERNELS}, got {text!r}")
        return cls(*map(int, parts), kernel=kernel)


DEFAULT_TILING = GemmTiling(128, 128, 64, 8, 3)


@dataclass(frozen=True)
class GemmPlan:
    """The default tiling (adapted to narrow weights and float32 by invariant_gemm) and exact tilings
    for the listed (N, K) shapes of 16-bit weights, as ``((n, k, tiling), ...)``."""

    default: GemmTiling = DEFAULT_TILING
    shapes: tuple[tuple[int, int, GemmTiling], ...] = ()

    def __post_init__(self) -> None:
        keys = [(n, k) for n, k, _ in self.shapes]
        if len(set(keys)) != len(keys):
            raise ValueError(f"GemmPlan lists a shape twice: {sorted(keys)}")

    def entry(self, n: int, k: int) -> GemmTiling | None:
        """The tiling listed for a weight of [n, k], or None."""
        return next((t for sn, sk, t in self.shapes if (sn, sk) == (n, k)), None)

    def text(self) -> str:
        return ";".join([self.default.text(), *(f"{n}:{k}={t.text()}" for n, k, t in self.shapes)])

    @classmethod
    def parse(cls, text: str) -> GemmPlan:
        default, shapes = DEFAULT_TILING, []
        for item in filter(None, (part.strip() for part in text.split(";"))):
            shape, sep, tiling = item.rpartition("=")
            if not sep:
                default = GemmTiling.parse(item)
                continue
            n, colon, k = shape.partition(":")
            if not (colon and n.strip().isdigit() and k.strip().isdigit()):
                raise ValueError(f"a GEMM plan's shape entry is N:K={TILING_FORM}, got {item!r}")
            shapes.append((int(n), int(k), GemmTiling.parse(tiling)))
        return cls(default, tuple(shapes))


# The tilings benchmarks/invariant_gemm_gpu.py measures at each shape (and the CPU tests check under
# Triton's interpreter): the pointer kernel's current default (128-wide, and 64-wide as the default
# adapts to narrow weights) and the best of an earlier sweep at 256 rows; the TMA kernel at one and
# two warpgroups, wide and tall tiles for many rows, small ones for more programs at few rows.
# Shared memory (Triton 3.6, sm90): 128/256/64 at 3 stages 213 KB, 128/128/128 at 3 stages 229 KB
# of the 227 KiB a program may take; 128/256/64 at 4 stages (262 KB) does not fit.
CANDIDATES = tuple(GemmTiling.parse(text) for text in (
    "tiles/128/128/64/8/3", "tiles/128/64/64/8/3", "tiles/64/128/64/4/4",
    "tma/128/128/64/8/3", "tma/128/128/64/4/4", "tma/128/256/64/8/3", "tma/256/128/64/8/3",
    "tma/64/128/64/4/4", "tma/128/64/64/4/4", "tma/64/256/64/4/4", "tma/128/128/128/8/3",
    "tma_ws/128/128/64/8/3"))
