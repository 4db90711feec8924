"""Launch parameters of the Triton kernels: one small table another platform (ROCm) can replace.

Nothing here imports triton. ``KernelTuning`` is plain data; the kernels' launchers read it, and
``TritonAttentionBackend(tuning=...)`` / ``custom_ops(tuning)`` take a replacement. The values in
``CUDA_TUNING`` were chosen by timing on an H200 (platforms/cuda/NOTES.md has the numbers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace


@dataclass(frozen=True)
class AttentionTiling:
    """One paged-attention kernel configuration.

    block_m rows of a program = query tokens x the query heads sharing one KV head (GQA group);
    block_n keys are read per loop iteration (independent of the cache's block size).
    table_blocks > 0: a program holds that many block-table entries in registers (a power of two)
    and takes each key tile's block ids from them, so the tile copies' addresses depend on no load
    of the loop and Triton's pipeliner issues them num_stages - 1 tiles ahead; 0: each tile loads
    its block ids in the loop, which costs a pipeline stage (one tile ahead at 2-4 stages, NOTES.md
    sessions 11 and 14).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    table_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"AttentionTiling.{name} must be a power of two, got {value}")
        if self.table_blocks < 0 or self.table_blocks & (self.table_blocks - 1):
            raise ValueError(f"AttentionTiling.table_blocks must be 0 or a power of two, got {self.table_blocks}")
        if self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"block_m and block_n must be >= 16 (tensor-core tiles), got {self.block_m}, {self.block_n}")
        if self.num_stages < 1:
            raise ValueError(f"AttentionTiling.num_stages must be >= 1, got {self.num_stages}")


@dataclass(frozen=True)
class SplitPolicy:
    """When a decode step splits each sequence's keys over several programs (flash-decoding).

    Splits are added until ``num_seqs * num_kv_heads * splits`` reaches ``target_programs``, never
    leaving a split fewer than ``min_keys_per_split`` keys of ``max_seq_len``, at most ``max_splits``
    (a power of two).
    """

    target_programs: int = 264  # two waves of the H200's 132 multiprocessors
    min_keys_per_split: int = 64  # H200, batch 1: 64 keys a split was fastest at 512/2048/8192 context
    max_splits: int = 64

    def __post_init__(self) -> None:
        if self.max_splits < 1 or self.max_splits & (self.max_splits - 1):
            raise ValueError(f"SplitPolicy.max_splits must be a power of two, got {self.max_splits}")
        if self.target_programs < 1 or self.min_keys_per_split < 1:
            raise ValueError("SplitPolicy.target_programs and min_keys_per_split must be >= 1")


@dataclass(frozen=True)
class KernelTuning:
    """Every launch parameter of podium_cuda's kernels."""

    # H200, 8B shape, bf16 cache (NOTES.md session 14): 16 x 512 new 167.7 us against 201.8 for
    # 128/64/4/3 (190.3 at 128/32/4/3 without the table in registers), 2 x 512 over a 4,096 prefix
    # 224.3 against 226.9, 4 x 2048 472.2 against 501.5; 128/64/4/3/64 is 60-75% slower (two buffers
    # of 64-key bf16 tiles: fewer programs fit)
    prefill: AttentionTiling = AttentionTiling(block_m=128, block_n=32, num_warps=4, num_stages=3, table_blocks=64)
    decode: AttentionTiling = AttentionTiling(block_m=16, block_n=64, num_warps=4, num_stages=2)
    split: SplitPolicy = field(default_factory=SplitPolicy)
    reduce_num_warps: int = 4
    kv_write_num_warps: int = 4
    elementwise_num_warps: int = 4  # rms_norm, rotary, silu_and_mul
    max_head_size: int = 256  # larger heads fall back to the pure-torch reference
    # fused ops the platform installs: those that beat the torch reference on the device (H200, bf16,
    # Llama-3.1-8B shapes, 1..8192 tokens: each fused op was 2-18x faster in graph replay and eager)
    # argmax (greedy sampling over V / 4096 programs a row): 3.3 against torch's 26 us at batch 1
    # in a graph, 42 against 46 at 256; batch-1 8B decode 4.61 -> 4.58 ms a token (NOTES.md session 6)
    # rms_norm_linear / silu_and_mul_linear (API 1.5): the batch-1 GEMV below, else the fused norm / SiLU
    # then the linear
    fused_ops: tuple[str, ...] = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "argmax",
                                  "rms_norm_linear", "silu_and_mul_linear")
    # pure-decode steps rotate q and k, write the new key/value and attend in the attention kernel
    # (forward_rotary); False: rotary_write_kv then the attention kernel (two launches a layer)
    decode_rotary_in_attention: bool = True
    # an fp8 cache under bf16 queries: the attention dots run in fp16, q clamped to its range (bf16
    # -> fp16 is exact there, e4m3/e5m2 -> fp16 always: one convert a pair, where -> bf16 adds one an
    # element). The sm90 PTX of the decode kernel: 161 converts instead of 265 (bf16 cache: 51).
    # H200 A/B (session 8, 256 x 512/256, 8B shape): 9,996 and 10,023 out tok/s against 9,617 and
    # 9,608 with bf16 dots
    fp8_dot_in_fp16: bool = True
    # fp8 caches (NVIDIA sm89+): attention converts value tiles to fp16 in the registers they load
    # into, then feeds them to the MMA through shared memory as a bf16 tile goes (ldmatrix). Triton's
    # own cast comes after the shared-memory load instead, where a [keys, head] tile (keys not
    # contiguous) takes one 8-bit load an element: 64 of the decode loop's 100 shared loads. H200,
    # decode at batch 256 x 640: bf16 cache 159 us, fp8 175 us with Triton's cast, 122 us so; keys
    # converted so too: 160 us (NOTES.md session 9). Keys keep Triton's cast.
    fp8_values_in_registers: bool = True
    # the decode tiling over an fp8 cache with fp8_values_in_registers (None: ``decode``). One warp a
    # program: with 20.6 KB of shared memory and 180 registers a thread, eight programs share a
    # multiprocessor (two per scheduler's 16K registers; four at 16/64/4/2) and keep that many KV
    # tiles in flight (Nsight Compute, NOTES.md session 11). H200, the 8B engine's decode launch (new tokens rotated,
    # stored and attended in the kernel; batch 256 at 520 / 640 / 760 context, NOTES.md session 10):
    # 91.9 / 108.9 / 124.8 us against 121.5 / 140.6 / 156.8 for session 9's launch (16/64/4/2, the new
    # token after the loop), 118 / 137 / 150 at 16/64/4/2 and 126 / 150 / 172 at 16/32/2/2 (the new
    # token first); end to end 256 x 512/256 fp8 10,765 / 10,787 out tok/s against 10,379 / 10,415.
    # Session 14: with the block ids in registers (table_blocks) the 16-key tiles get four buffers at
    # five stages (20.5 KB, 158 registers): 87.1 / 103.8 / 120.2 us against 91.5 / 109.4 / 124.4 for
    # 16/32/1/3 (whose two buffers at 28.7 KB let only seven programs share a multiprocessor)
    fp8_decode: AttentionTiling | None = AttentionTiling(block_m=16, block_n=16, num_warps=1, num_stages=5, table_blocks=64)
    # ... and when the keys are split over programs (small batches, plan_splits; None: ``fp8_decode``).
    # A split holds as few as 64 keys, four 16-key tiles: all pipeline prologue at five stages. H200,
    # 8B batch-1 decode at 512 context, fp8 cache (session 14): 4.30 ms a token at 16/32/1/3, 4.65
    # with 16/16/1/5/64
    fp8_split_decode: AttentionTiling | None = AttentionTiling(block_m=16, block_n=32, num_warps=1, num_stages=3)
    # the prefill tiling over an fp8 cache with fp8_values_in_registers (None: ``prefill``). H200 (session
    # 14): 16 x 512 202.3 us against 203.3 without the table in registers, 2 x 512 over a 4,096 prefix
    # 246.9 against 258.7, 4 x 2048 548.9 against 556.7 (bf16's 128/32/4/3/64 here: 198.8 / 271.8 /
    # 580.0). End to end 256 x 512/256 with the fp8 decode above: 11,230 / 11,245 out tok/s against
    # 11,177 / 11,195 with sessions 10-13's tilings, one machine, alternated
    fp8_prefill: AttentionTiling | None = AttentionTiling(block_m=128, block_n=64, num_warps=4, num_stages=3, table_blocks=64)
    # mixed steps starting with at least this many decodes launch the decode kernel for them and the
    # prefill kernel for the rest (attention.decode_prefix); 0: one prefill launch for every row.
    # H200, 16 x 512 prefill + 16 / 64 / 128 / 240 decodes, bf16: 225 / 294 / 381 / 527 us in one
    # launch, 230 / 256 / 297 / 367 us split (so not at 16). The decode launch's variant is built by
    # the startup profile step, whose batch starts with decodes (engine.profile_batch). 256 x 512/256
    # fp8 end to end (NOTES.md session 10): 10,831 / 10,849 out tok/s against 10,765 / 10,787 without
    mixed_decode_min: int = 32
    # one-row bf16/fp16 linears (batch-1 decode) as a Triton GEMV (gemv.py), with the norm or SiLU-mul
    # before them in its prologue: faster than separate kernel + cuBLAS at every 1B/8B shape, median
    # 0.88x (benchmarks/gemv_fused_sweep.py); False: cuBLAS
    gemv_batch1: bool = True
    # programmatic dependent launches (pdl.py, NVIDIA sm90+ only) of the GEMV, whose first weight
    # tile loads while the kernel before it finishes (H200 batch-1 decode: 1B 0.94 -> 0.90-0.91 ms,
    # 8B 4.32 -> 4.18 ms, NOTES.md session 8), and of the attention kernel and its split merge
    gemv_pdl: bool = True
    attention_pdl: bool = True


TUNING_ENV = "PODIUM_CUDA_TUNING"  # "field=value,...": int / bool fields of KernelTuning, tilings as m/n/w/s[/t]


def _tiling_value(name: str, text: str, optional: bool) -> AttentionTiling | None:
    """``block_m/block_n/num_warps/num_stages[/table_blocks]`` (e.g. 16/32/2/2), or none for an optional tiling."""
    if optional and text == "none":
        return None
    parts = text.split("/")
    if len(parts) not in (4, 5) or not all(p.isdigit() for p in parts):
        raise ValueError(f"{TUNING_ENV}: {name} takes block_m/block_n/num_warps/num_stages[/table_blocks]"
                         f"{' or none' if optional else ''}, got {text!r}")
    try:
        return AttentionTiling(*map(int, parts))
    except ValueError as error:
        raise ValueError(f"{TUNING_ENV}: {name}: {error}") from None


def tuning_from_env(value: str | None, base: KernelTuning) -> KernelTuning:
    """``base`` with the ``PODIUM_CUDA_TUNING`` overrides (A/B runs on the device); bad ones raise."""
    if not value:
        return base
    changes = {}
    kinds = {f.name: type(getattr(base, f.name)) for f in fields(base)}
    tilings = {f.name: "None" in str(f.type) for f in fields(base) if "AttentionTiling" in str(f.type)}  # -> optional
    settable = sorted(n for n, k in kinds.items() if k in (int, bool) or n in tilings)
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, _, text = item.partition("=")
        name, text = name.strip(), text.strip().lower()
        kind = kinds.get(name)
        if (kind not in (int, bool) and name not in tilings) or not text:
            raise ValueError(f"{TUNING_ENV}: cannot set {item!r}; settable: {settable} as name=value")
        if name in tilings:
            changes[name] = _tiling_value(name, text, tilings[name])
        elif kind is bool:
            if text not in ("0", "1", "true", "false"):
                raise ValueError(f"{TUNING_ENV}: {name} takes 0/1/true/false, got {text!r}")
            changes[name] = text in ("1", "true")
        elif not text.lstrip("-").isdigit():
            raise ValueError(f"{TUNING_ENV}: {name} takes an integer, got {text!r}")
        else:
            changes[name] = int(text)
    return replace(base, **changes)


CUDA_TUNING = tuning_from_env(os.environ.get(TUNING_ENV), KernelTuning())

FUSED_OPS_ENV = "PODIUM_CUDA_FUSED_OPS"  # comma-separated op names, "none" for the torch references


def fused_ops_from_env(value: str | None, default: tuple[str, ...], known) -> tuple[str, ...]:
    """The fused ops to install: ``default`` unless ``PODIUM_CUDA_FUSED_OPS`` names them (A/B runs).

    ``"none"`` (or an empty value) installs none; an unknown name is an error that lists the known.
    """
    if value is None:
        return default
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if names in ((), ("none",)):
        return ()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{FUSED_OPS_ENV}: unknown fused op(s) {unknown}; known: {sorted(known)}")
    return names


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def plan_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, policy: SplitPolicy) -> int:
    """Number of KV splits (a power of two) for a pure-decode step.

    Depends only on host values that stay upper bounds under CUDA-graph replay: the kernels read the
    real lengths from device tensors, so any split count is correct for any length; this only
    chooses how much parallelism to create.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    splits = 1
    while (
        splits < policy.max_splits
        and programs * splits < policy.target_programs
        and max_seq_len >= 2 * splits * policy.min_keys_per_split
    ):
        splits *= 2
    return splits
