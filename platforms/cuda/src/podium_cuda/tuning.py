"""Launch parameters of the Triton kernels: one small table another platform (ROCm) can replace.

Nothing here imports triton. ``KernelTuning`` is plain data; the kernels' launchers read it, and
``TritonAttentionBackend(tuning=...)`` / ``custom_ops(tuning)`` take a replacement. The values in
``CUDA_TUNING`` were chosen by timing on an H200 (platforms/cuda/DESIGN.md says why each one).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from podium_plugin_api.ops import REFERENCE_OPS

from .gemm_plan import GemmPlan


@dataclass(frozen=True)
class AttentionTiling:
    """One paged-attention kernel configuration.

    block_m rows of a program = query tokens x the query heads sharing one KV head (GQA group);
    block_n keys are read per loop iteration (independent of the cache's block size).
    table_blocks > 0: a program holds that many block-table entries in registers (a power of two)
    and takes each key tile's block ids from them, so the tile copies' addresses depend on no load
    of the loop and Triton's pipeliner issues them num_stages - 1 tiles ahead; 0: each tile loads
    its block ids in the loop, which costs a pipeline stage (the copies then run one tile ahead with
    one buffer at 2-4 stages).
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


# The batch-invariant GEMM's plan (gemm_plan.py's text form): benchmarks/invariant_gemm_gpu.py
# measures every candidate kernel and tiling at each Llama-3.1-8B / 3.2-1B projection shape and
# prints the winners as this string as its last line; paste it here. Shapes not listed take the
# default (its first item). Measured on an H200 (2026-12-03; docs/performance.md): the persistent
# TMA kernel at these tilings ran the mode at 0.91-0.95x of the default's 8B throughput, where the
# pointer kernel's 128 x 128 x 64 tiles ran it at 0.67x.
INVARIANT_GEMM_PLAN = ("tma/128/128/64/4/4;"
                       "6144:4096=tma/128/128/64/4/4;"
                       "4096:4096=tma/64/256/64/4/4;"
                       "28672:4096=tma/128/256/64/8/3;"
                       "4096:14336=tma/128/128/64/4/4;"
                       "128256:4096=tma/128/256/64/8/3;"
                       "3072:2048=tma/64/256/64/4/4;"
                       "2048:2048=tma/64/256/64/4/4;"
                       "16384:2048=tma/128/256/64/8/3;"
                       "2048:8192=tma/128/128/64/4/4;"
                       "128256:2048=tma/128/256/64/8/3")


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

    # bf16 cache: 32-key tiles with the block ids in registers were the fastest at every 8B prefill
    # shape on the H200 (fresh prompts, a prefix over cached context, long prompts); 64-key tiles
    # with the table need two buffers of 64-key bf16 tiles, so fewer programs fit and it is far slower
    prefill: AttentionTiling = AttentionTiling(block_m=128, block_n=32, num_warps=4, num_stages=3, table_blocks=64)
    decode: AttentionTiling = AttentionTiling(block_m=16, block_n=64, num_warps=4, num_stages=2)
    split: SplitPolicy = field(default_factory=SplitPolicy)
    reduce_num_warps: int = 4
    kv_write_num_warps: int = 4
    elementwise_num_warps: int = 4  # rms_norm, rotary, silu_and_mul
    max_head_size: int = 256  # larger heads fall back to the pure-torch reference
    # fused ops the platform installs: those that beat the torch reference on the device (H200, bf16,
    # Llama-3.1-8B shapes, 1..8192 tokens, in graph replay and eager)
    # argmax (greedy sampling over V / 4096 programs a row): faster than torch's one-block reduction
    # inside a graph at batch 1 and 256, which sped up batch-1 decode
    # rms_norm_linear / silu_and_mul_linear (fused_linear.py): FP8 / INT4 layers' kernels with the
    # norm / SiLU in their prologue, the batch-1 GEMV below for bf16, else the fused norm / SiLU
    # then the linear
    # fused_moe: the grouped Triton GEMMs (moe.py); the reference's per-expert loop reads
    # expert counts on the host, which a CUDA graph cannot capture
    # gguf_linear / gguf_embedding: GGUF blocks dequantized in the kernel (gguf.py); the reference
    # dequantizes the whole weight every call; fp8_linear: torch._scaled_mm or the Triton GEMM
    # (fp8_linear.py, fp8_triton_max_rows); int4_linear: the Triton dequant-GEMM/GEMV (int4.py);
    # apply_token_bitmask: one launch writing the forbidden tokens only (token_bitmask.py);
    # lora_shrink / lora_expand: the segmented Triton GEMMs (lora.py); the reference loops over slots
    # with their row counts read on the host, which a CUDA graph cannot capture
    fused_ops: tuple[str, ...] = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "argmax",
                                  "rms_norm_linear", "silu_and_mul_linear", "fused_moe", "gguf_linear",
                                  "gguf_embedding", "fp8_linear", "int4_linear", "apply_token_bitmask",
                                  "lora_shrink", "lora_expand")
    # fp8_linear calls of at most this many rows (per-tensor / per-channel scales) take the Triton
    # GEMM, which quantizes the activations inside it, instead of the per-token quantization's
    # launches plus torch._scaled_mm; block scales always take it. benchmarks/quant_gpu.sh times
    # both per 8B shape at 1 / 16 / 256 / 4096 rows and prints the threshold they imply: on an H200
    # _scaled_mm won at every shape and row count (the Triton GEMM 1.1-3x its time), so 0
    fp8_triton_max_rows: int = 0
    # fp8_linear calls (and an RMSNorm / SiLU-and-mul before one, through rms_norm_linear /
    # silu_and_mul_linear) of at most this many rows (per-tensor / per-channel scales) take the FP8
    # GEMV (fp8_gemv.py: the e4m3 weight read once, the rows' prologue and quantization inside);
    # 0: never. benchmarks/quant_gpu.sh prints the row count up to which it beats quantize +
    # _scaled_mm summed over the 8B shapes ("fp8 gemv rule"): measured on an H200, 1 (at 4 rows the
    # tensor-core GEMV's 150 us for a layer's four projections against quantize + _scaled_mm's 134)
    fp8_gemv_max_rows: int = 1
    # the FP8 GEMV's slice of K a program (a power of two; packed: a multiple of 512); 0: fp8_gemv.config's rule
    fp8_gemv_block_k: int = 0
    # the FP8 GEMV's programs a multiprocessor it aims at (feature ranges x slices of K); 0: 4. Fewer make
    # each program's weight rows more against its per-program work (the row's norm and amax, its slice
    # quantized); benchmarks/quant_gpu_one_row.py sweeps it
    fp8_gemv_programs: int = 0
    # the FP8 GEMV multiplies on the tensor cores (an e4m3 MMA of the rows, padded to 16, with 128
    # weight rows a step); False: on the CUDA cores (convert, multiply, sum). Measured on an H200 at
    # one row (benchmarks/quant_gpu.sh): the CUDA-core steps 12.2 / 9.7 / 48.9 / 33.5 us against the
    # tensor cores' 17.0 / 12.0 / 48.5 / 42.0 (qkv / o / gate_up / down), batch-1 FP8 decode 4.13 ms a
    # token against 6.02, so False
    fp8_gemv_dot: bool = False
    # one row on the CUDA cores in packed half precision (fp8_gemv._packed_steps: ~2 instructions a
    # weight byte against ~7; the plain steps are bound by them, ~2 TB/s at one row where bf16's
    # GEMV reads 4 TB/s). Off until quant_gpu.sh's one_row step has timed it on the device
    fp8_gemv_packed: bool = False
    # the packed steps with e4m3 -> f16 by integer masks and shifts instead of the conversion unit
    # (fp8_gemv._bits_steps: ~3.6 instructions a weight byte, none a conversion), for slices that are
    # whole; the A/B of whether that unit bounds the one-row GEMV. Off until timed
    fp8_gemv_bits: bool = False
    # one row: fp8_quant's one-program launch quantizes the row (its prologue inside) and the GEMV
    # reads the e4m3 row, instead of every program walking the whole row for its norm and amax
    # (down_proj's SiLU-and-mul so: 71 us fused against 33.5 plain on the H200). Off until timed
    fp8_gemv_quantize_first: bool = False
    # one row on the tensor cores' warp MMA over the weight as it lies (fp8_mma_gemv.py: the row quantized
    # first by fp8_quant's launch, then two e4m3 m16n8k32 MMAs a lane for three 16-byte loads, no
    # conversions). Measured on the H200 (`bash benchmarks/quant_gpu.sh mma`): an 8B layer's four
    # linears at one row 79.7 us against the CUDA-core GEMV's 110.1, batch-1 decode 3.01 ms a token
    # against 4.13
    fp8_gemv_mma: bool = True
    # its warps a program, steps of 64 K bytes a warp has in flight, and the programs a multiprocessor
    # its split of K aims at (fp8_mma_gemv.config; 0: never split, the fastest of ten settings on the
    # H100 and the H200: 79.7 us a layer against 85-112); the lines after the first steps asked for
    # into L2 while the row is quantized
    fp8_mma_warps: int = 4
    fp8_mma_unroll: int = 4
    fp8_mma_programs: int = 0
    fp8_mma_prefetch: bool = False
    # its warps ask L2 for their whole stretch of each of their 16 rows at their start (one bulk
    # prefetch a row, sm90), and its registers a thread capped (0: the compiler's choice, 158, which
    # leaves 12 warps a multiprocessor: Nsight Compute on an H100 shows 66-78% of the warps' cycles
    # stalled on memory and 49-82% of DRAM's throughput)
    fp8_mma_bulk_prefetch: bool = False
    fp8_mma_maxnreg: int = 0
    # FP8 calls that take _scaled_mm quantize their rows in one Triton launch (fp8_quant.py), the
    # RMSNorm / add-RMSNorm / SiLU-and-mul before them inside it; False: the contract's torch
    # quantize_per_token after the separate norm / SiLU kernel (for A/B runs)
    fp8_fused_quant: bool = True
    # _scaled_mm with the fp8 tensor cores' own accumulation (use_fast_accum): sm90's fp8 MMA keeps
    # ~14 bits of its running sum, so a K of 4096 drifts ~1e-3 of the output's scale, under bf16's own
    # rounding of the result (the FP8 tests' bounds hold both ways); False promotes partial sums to
    # float32 as _scaled_mm does by default. `bash benchmarks/quant_gpu.sh accum` on an H100: the 8B
    # 256 x 512/256 FP8 run 14,161 / 14,371 out tok/s against 13,682 / 13,699 promoted, 1.042x, so True
    fp8_fast_accum: bool = True
    # int4_linear calls (and the RMSNorm / SiLU-and-mul before one) of at most this many rows take
    # the INT4 GEMV (int4_gemv.py: split K, prologue inside); others the Triton dequant-GEMM.
    # benchmarks/quant_gpu.sh prints the row count up to which it wins ("int4 gemv rule"): measured
    # on an H200, 4 (one decoder layer's linears at 4 rows 375 us against int4.py's 401; at 16 rows
    # the GEMV is 2.6-11x slower)
    int4_gemv_max_rows: int = 4
    # the one-row AWQ GEMV (awq_gemv.py) in packed half precision: two columns an instruction, ~1.6
    # instructions a weight against ~5 in float32, which leave it at ~0.8 TB/s of packed weight on
    # the H200 (qkv / o / gate_up / down 15.4 / 14.5 / 73.8 / 35.9 us against bf16's GEMV 12.3 / 5.6
    # / 55.2 / 28.1 reading 4x the bytes). Off until quant_gpu.sh's one_row step has timed it
    int4_gemv_packed: bool = False
    # the INT4 GEMV's output features a program (a multiple of 64) and K splits a column block
    # (0: int4_gemv.config's rule, about four programs a multiprocessor)
    int4_gemv_block_n: int = 0
    int4_gemv_split_k: int = 0
    # a model's AWQ weights converted at preparation to the contract's AWQ_MMA layout (Marlin-style, in
    # place: the same bytes), whose 1-8 rows take the tensor cores' warp MMA (awq_mma_gemv.py): on the
    # H200 an 8B layer's four linears at 1-8 rows 0.23-0.48x the stored layout's time, batch-1 decode 2.50
    # ms a token against 5.52; more rows go to int4.py's GEMM over AWQ_MMA, 256 x 512/256 at 0.92x the
    # stored layout's throughput (the price of one copy: issue 31 holds a quantized model to 1.1x its
    # packed size). Its warps a program and the
    # programs a multiprocessor its split of the groups aims at (awq_mma_gemv.config; 8 and never split:
    # the fastest of eight settings, 60.0 us a layer against 66-73)
    int4_gemv_mma: bool = True
    int4_mma_warps: int = 8
    int4_mma_programs: int = 0
    # groups a warp of the AWQ MMA GEMV takes an iteration (awq_mma_gemv.config: at most four super-steps),
    # their weights, scales, zeros and x sums loaded a chunk ahead of the MMAs. Timed on an H100
    # (`SWEEPS=awq FORMATS=awq bash benchmarks/quant_gpu.sh mma`): an 8B layer's one-row linears took
    # 66.7 us at 1, 89.3-89.6 at 2 and 4 (8 warps) and 78.4-78.5 (4 warps): Nsight Compute shows why,
    # 218 registers a thread instead of 80, so a third of the warps fit a multiprocessor
    int4_mma_groups: int = 1
    # the AWQ MMA GEMV's warps ask L2 for their whole stretch of weights at their start (one bulk
    # prefetch a warp, sm90) and for their groups' scale and zero lines; and its registers a thread
    # capped (0: the compiler's choice; 80 at one row, which leaves 3 programs of 8 warps a
    # multiprocessor). Nsight Compute on an H100 (`bash benchmarks/quant_gpu.sh ncu`): at one row the
    # warps stall 54-61% of their cycles on memory (long scoreboard), at 37.5% theoretical occupancy
    # and 33-63% of DRAM's throughput: latency-bound, a warp holding one group (1 KiB) in flight
    int4_mma_prefetch: bool = False
    int4_mma_maxnreg: int = 0
    # a group's weights and x loaded an iteration ahead of its MMAs (False: in the iteration, ~24 fewer
    # registers a thread, so more warps resident: with the bulk prefetch the loads come from L2)
    int4_mma_ahead: bool = True
    # AWQ_MMA rows up to this many (at most 8: an x row a column of the MMA's B) take the MMA GEMV, more
    # int4.py's GEMM
    int4_mma_max_rows: int = 8
    # pure-decode steps rotate q and k, write the new key/value and attend in the attention kernel
    # (forward_rotary); False: rotary_write_kv then the attention kernel (two launches a layer)
    decode_rotary_in_attention: bool = True
    # an fp8 cache under bf16 queries: the attention dots run in fp16, q clamped to its range (bf16
    # -> fp16 is exact there, e4m3/e5m2 -> fp16 always: one convert a pair, where -> bf16 adds one an
    # element). The sm90 PTX of the decode kernel: 161 converts instead of 265 (bf16 cache: 51);
    # the 8B 256 x 512/256 run with an fp8 cache is ~4% faster so on the H200
    fp8_dot_in_fp16: bool = True
    # fp8 caches (NVIDIA sm89+): attention converts value tiles to fp16 in the registers they load
    # into, then feeds them to the MMA through shared memory as a bf16 tile goes (ldmatrix). Triton's
    # own cast comes after the shared-memory load instead, where a [keys, head] tile (keys not
    # contiguous) takes one 8-bit load an element: 64 of the decode loop's 100 shared loads. With it
    # fp8 decode attention went from slower than a bf16 cache's to ~25% faster on the H200; keys
    # converted the same way lost that again (their tile is contiguous already): keys keep Triton's cast.
    fp8_values_in_registers: bool = True
    # the decode tiling over an fp8 cache with fp8_values_in_registers (None: ``decode``). The fp8
    # decode loop is latency-bound, so small programs win: at one warp a program, eight share a
    # multiprocessor (two per scheduler's 16K registers; four at 16/64/4/2) and keep that many KV
    # tiles in flight, ~20% faster than 16/64/4/2 on the 8B engine's batch-256 decode launch. With
    # the block ids in registers (table_blocks) 16-key tiles get four buffers at five stages (20.5 KB,
    # 158 registers), a few percent faster again than 16/32/1/3 (whose two buffers at 28.7 KB let
    # only seven programs share a multiprocessor)
    fp8_decode: AttentionTiling | None = AttentionTiling(block_m=16, block_n=16, num_warps=1, num_stages=5, table_blocks=64)
    # ... and when the keys are split over programs (small batches, plan_splits; None: ``fp8_decode``).
    # A split holds as few as 64 keys, four 16-key tiles: all pipeline prologue at five stages, which
    # made batch-1 fp8 decode ~8% slower with 16/16/1/5/64 than with this tiling
    fp8_split_decode: AttentionTiling | None = AttentionTiling(block_m=16, block_n=32, num_warps=1, num_stages=3)
    # the prefill tiling over an fp8 cache with fp8_values_in_registers (None: ``prefill``). Over fp8
    # the 64-key tiles stay the fastest (fp8 tiles are half the bytes, so two buffers still fit); the
    # table in registers gains most over a cached prefix. bf16's 128/32/4/3/64 is slower here except
    # on short fresh prompts
    fp8_prefill: AttentionTiling | None = AttentionTiling(block_m=128, block_n=64, num_warps=4, num_stages=3, table_blocks=64)
    # mixed steps starting with at least this many decodes launch the decode kernel for them and the
    # prefill kernel for the rest (attention.decode_prefix); 0: one prefill launch for every row.
    # In one launch each decode holds a prefill tile for its one token: behind a 16 x 512 prefill the
    # split saves up to ~30% of the step's attention at 240 decodes and loses a little at 16. The
    # decode launch's variant is built by the startup profile step, whose batch starts with decodes
    # (engine.profile_batch), so no variant compiles while serving
    mixed_decode_min: int = 32
    # one-row bf16/fp16 linears (batch-1 decode) as a Triton GEMV (gemv.py), with the norm or SiLU-mul
    # before them in its prologue: faster than separate kernel + cuBLAS at every 1B/8B shape at one
    # row (ties at two, loses at four: batch 1 only); False: cuBLAS
    gemv_batch1: bool = True
    # programmatic dependent launches (pdl.py, NVIDIA sm90+ only) of the GEMV, whose first weight
    # tile loads while the kernel before it finishes (batch-1 decode's small GEMVs are latency-bound),
    # and of the attention kernel and its split merge
    gemv_pdl: bool = True
    attention_pdl: bool = True
    # split decodes merged by each (sequence, kv head)'s last split to finish (split_k.py's counter), in
    # split order, instead of merge_splits_kernel's launch after them: at batch 1 a graph's decode runs
    # every split the longest context needs, nearly all empty, and the merge launch is one of a layer's
    # few on the critical path. Off until timed (`bash benchmarks/quant_gpu.sh mma`'s latency steps)
    attention_merge_in_kernel: bool = False
    # the batch-invariant mode (use_batch_invariant_kernels). Attention: one tiling for prefill and
    # decode launches alike (invariant_attention.py), the decode tiling's, since decodes dominate a
    # run and a prompt token then costs what a decode does; fp8 caches take the fp8 decode tiling
    # (None: ``invariant_attention``). Linears: the batch-invariant GEMM's plan, a kernel and tiling
    # per (N, K) of 16-bit weights (INVARIANT_GEMM_PLAN); other shapes take its default, whose
    # block_n halves for weights of fewer than 64 column tiles so a 256-row decode step still
    # spreads over the multiprocessors, and float32 its block_k halved (invariant_gemm._adapted)
    invariant_attention: AttentionTiling = AttentionTiling(block_m=16, block_n=64, num_warps=4, num_stages=2)
    invariant_fp8_attention: AttentionTiling | None = AttentionTiling(block_m=16, block_n=16, num_warps=1,
                                                                      num_stages=5, table_blocks=64)
    invariant_gemm: GemmPlan = GemmPlan.parse(INVARIANT_GEMM_PLAN)


CUDA_TUNING = KernelTuning()  # the CUDA platform's table; the ``tuning`` option changes a copy of it

TUNING_ENV = "PODIUM_CUDA_TUNING"  # the alias of the tuning option
FUSED_OPS_ENV = "PODIUM_CUDA_FUSED_OPS"  # the alias of the fused_ops option


TILING_FORMS = {"AttentionTiling": (AttentionTiling, "block_m/block_n/num_warps/num_stages[/table_blocks]", (4, 5))}


def _tiling_value(name: str, kind: str, text: str, optional: bool) -> AttentionTiling | None:
    """A tiling field's value, its numbers joined by / (e.g. 16/32/2/2), or none for an optional tiling."""
    if optional and text == "none":
        return None
    cls, form, counts = TILING_FORMS[kind]
    parts = text.split("/")
    if len(parts) not in counts or not all(p.isdigit() for p in parts):
        raise ValueError(f"{name} takes {form}{' or none' if optional else ''}, got {text!r}")
    try:
        return cls(*map(int, parts))
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def parse_tuning(text: str) -> dict:
    """The ``tuning`` option, ``"field=value,..."``, as KernelTuning field changes (A/B runs on the
    device): int and bool fields, attention tilings as m/n/w/s[/t], GEMM tilings as m/n/k/w/s (or
    none where optional), the GEMM plan as gemm_plan.py's text (``invariant_gemm=tma/128/128/64/8/3;
    6144:4096=tma/64/128/64/4/4``). ValueError names what is settable and how."""
    base = KernelTuning()
    changes = {}
    kinds = {f.name: type(getattr(base, f.name)) for f in fields(base)}
    tilings = {f.name: (kind, "None" in str(f.type)) for f in fields(base)  # -> (kind, optional)
               for kind in TILING_FORMS if kind in str(f.type)}
    plans = {f.name for f in fields(base) if "GemmPlan" in str(f.type)}
    settable = sorted(n for n, k in kinds.items() if k in (int, bool) or n in tilings or n in plans)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        kind = kinds.get(name)
        if (kind not in (int, bool) and name not in tilings and name not in plans) or not value:
            raise ValueError(f"cannot set {item!r}; settable: {settable} as name=value")
        if name in plans:
            try:
                changes[name] = GemmPlan.parse(value)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
        elif name in tilings:
            kind, optional = tilings[name]
            changes[name] = _tiling_value(name, kind, value, optional)
        elif kind is bool:
            if value not in ("0", "1", "true", "false"):
                raise ValueError(f"{name} takes 0/1/true/false, got {value!r}")
            changes[name] = value in ("1", "true")
        elif not value.lstrip("-").isdigit():
            raise ValueError(f"{name} takes an integer, got {value!r}")
        else:
            changes[name] = int(value)
    return changes


def parse_fused_ops(text: str) -> tuple[str, ...] | None:
    """The ``fused_ops`` option: None for ``auto`` (the tuning's list), () for ``none`` (the torch
    references), else the named ops (names of ``podium_plugin_api.ops``; ValueError lists them)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names in ((), ("auto",)):
        return None
    if names == ("none",):
        return ()
    unknown = [n for n in names if n not in REFERENCE_OPS]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; ops: {sorted(REFERENCE_OPS)}, or auto, or none")
    return names


def register_cap(registers: int) -> dict:
    """The launch keyword that caps a Triton kernel's registers a thread (``maxnreg``; none for 0, the
    compiler's own choice): fewer registers, more warps resident a multiprocessor."""
    return {"maxnreg": registers} if registers else {}


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
