"""The ROCm tuning table: launch parameters of podium-cuda's Triton kernels for AMD Instinct GPUs.

The kernels are podium_cuda's (portable Triton, no vendor intrinsics); only their launch
parameters change, through ``podium_cuda.tuning.KernelTuning``. Nothing here imports triton.

Written for CDNA3 (MI300X: 304 compute units, 4 SIMDs each, 64-lane wavefronts, 64 KiB of LDS
per CU, 512 VGPRs per lane, 16x16 / 32x32 MFMA matrix instructions). These values follow AMD's
published guidance for Triton on MI300X and the arithmetic below; they have NOT been timed on an
AMD GPU (we have none). On the H200 they are only proven correct, through the test-only switch
(platforms/rocm/NOTES.md says what ran where).

Rules of thumb behind them:
- One Triton "warp" is a 64-lane wavefront on CDNA, so ``num_warps=4`` is 256 threads: one
  wavefront per SIMD of a CU. Kernels that are pure data movement take half CUDA's warps to keep
  the same 128 threads per program.
- AMD's Triton "stream pipeliner" treats ``num_stages`` differently from NVIDIA's: AMD recommends
  2 for kernels with a single GEMM and 1 for kernels that fuse two GEMMs (attention: QK^T, then PV)
  or none. A second stage of the K and V tiles would also take the whole LDS at head size 128
  (2 stages x (64 x 128 keys + 64 x 128 values) x 2 bytes = 64 KiB), leaving one program per CU.
- Occupancy on AMD is steered with ``waves_per_eu`` (a VGPR budget hint), not by shared memory;
  podium-cuda's launchers pass only ``num_warps``/``num_stages``, so no such hint is set.
"""

from __future__ import annotations

from dataclasses import replace

from podium_cuda.tuning import AttentionTiling, KernelTuning, SplitPolicy

from .detection import RocmDevice

CDNA3_COMPUTE_UNITS = 304  # MI300X / MI325X; used when the device does not say

ROCM_TUNING = KernelTuning(
    # Prefill / mixed steps: 128 query rows x 64 keys a tile. Per 256-lane program: fp32 accumulator
    # 128 x 128 (head 128) = 64 VGPRs a lane, the 128 x 64 score tile 32 more: two wavefronts fit
    # per SIMD (waves_per_eu 2). One stage (two fused GEMMs, see above). Heads over 128 halve the
    # rows (podium_cuda's launcher) so the accumulator stays at the same size.
    prefill=AttentionTiling(block_m=128, block_n=64, num_warps=4, num_stages=1),
    # Pure decode: 16 rows is one 16x16 MFMA tile (a token's GQA group of up to 16 query heads in
    # one program); 64 keys a tile (BLOCK_N 64) is a 16 KiB K tile at head 128 in bf16, 64 bytes per
    # lane: wide loads over the scattered cache blocks. Memory-bound: one stage, rely on occupancy
    # (the decode tile needs few registers) rather than an LDS double buffer to hide latency.
    decode=AttentionTiling(block_m=16, block_n=64, num_warps=4, num_stages=1),
    # Flash-decoding splits until two programs per CU are in flight (2 x 304 on MI300X; tuning_for
    # uses the device's own CU count). At least 128 keys (two 64-key tiles) a split, so a split's
    # loop is not all prologue and the extra merge launch pays off; not timed.
    split=SplitPolicy(target_programs=2 * CDNA3_COMPUTE_UNITS, min_keys_per_split=128, max_splits=64),
    # merge of splits, KV write, RMSNorm/rotary/SiLU-and-mul: pure data movement, 2 wavefronts =
    # 128 lanes, the same threads per program as CUDA's 4 warps of 32
    reduce_num_warps=2,
    kv_write_num_warps=2,
    elementwise_num_warps=2,
    max_head_size=256,
    # Each fused op replaces several torch elementwise kernels (each a full pass over HBM) with
    # one pass; that gain does not depend on the vendor. Not timed on AMD. fused_moe: the reference's
    # per-expert loop reads counts on the host, which a HIP graph cannot capture (Triton's grouped
    # GEMMs with CUDA's tilings; not timed on AMD either); lora_shrink / lora_expand likewise (the
    # segmented GEMMs of podium_cuda.lora)
    fused_ops=("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "fused_moe", "lora_shrink",
               "lora_expand"),
    # the batch-1 GEMV (podium_cuda.gemv) was tuned on the H200's 132 SMs; not timed on AMD, so hipBLAS
    gemv_batch1=False,
    # programmatic dependent launch is an NVIDIA sm90 feature (pdl.py); off here, also when the ROCm
    # path is forced onto an NVIDIA GPU for testing
    gemv_pdl=False,
    attention_pdl=False,
    # the fp8 tile converts are NVIDIA PTX (sm89+); the ROCm backend lists no fp8 cache anyway
    # (fp8_decode, fp8_split_decode and fp8_prefill, the tilings of that path, then never apply)
    fp8_values_in_registers=False,
    # mixed steps' decodes in the decode launch were timed on the H200 only: one launch here
    mixed_decode_min=0,
)


def tuning_for(device: RocmDevice) -> KernelTuning:
    """ROCM_TUNING fitted to the device: splits sized to its compute units; 32-lane wavefronts
    (RDNA) get CUDA's warp counts for the data-movement kernels (a warp is 32 threads there too)."""
    tuning = ROCM_TUNING
    if device.compute_units:
        tuning = replace(tuning, split=replace(tuning.split, target_programs=2 * device.compute_units))
    if device.arch.wavefront_size == 32:
        tuning = replace(tuning, reduce_num_warps=4, kv_write_num_warps=4, elementwise_num_warps=4)
    return tuning
