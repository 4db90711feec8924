"""What the CUDA platform's batch-invariant mode switches (``CudaPlatform.use_batch_invariant_kernels``).

Every op a decoder step runs, per row:
- linears (the LM head too): ``InvariantLinear``, the Triton GEMM whose tiles come from the weight
  alone (invariant_gemm.py), in place of cuBLAS and of the batch-1 GEMV;
- attention: ``InvariantAttentionBackend`` (invariant_attention.py), one kernel and one key order
  for prompt tokens and decodes;
- RMSNorm, rotary, SiLU-and-mul, greedy argmax: the fused Triton kernels, one program a row (a
  norm's sum over the row's columns in one program; rotary and SiLU element by element; argmax
  exact in any order); installed whatever the ``fused_ops`` option says, because the torch
  references' reductions (``mean`` over a row) take a launch shape, hence an order, from the number
  of rows;
- mixture of experts: ``invariant_fused_moe`` (one tiling at every batch size, contributions added
  in a fixed order); the router's softmax / top-k run one row per program in torch;
- top-k / top-p: ``invariant_top_k_top_p`` (an exact integer nucleus sum).
Refused, with the reason: quantized weights (fp8 / GGUF / int4 linears multiply through cuBLAS or
dequantizing kernels tiled by the batch) and encoder (pooling) models, whose attention is torch's
SDPA over a padded batch. Imported only when the mode is used (it imports triton).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .fused_ops import FUSED_OPS
from .invariant_gemm import INVARIANT_DTYPES, use_invariant_linears
from .invariant_sampling import invariant_top_k_top_p
from .moe import invariant_fused_moe
from .tuning import KernelTuning

PER_ROW_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "argmax")


def invariant_ops() -> dict[str, Callable]:
    """The op table overrides of the mode (module docstring); the composites (norm + linear, SiLU +
    linear) are then built from these and the model's InvariantLinears."""
    return {**{name: FUSED_OPS[name] for name in PER_ROW_OPS}, "fused_moe": invariant_fused_moe,
            "top_k_top_p": invariant_top_k_top_p}


def prepare_invariant_model(model: nn.Module, tuning: KernelTuning) -> nn.Module:
    """Refuse what the mode cannot compute per row, then make every linear an InvariantLinear."""
    if not getattr(model, "uses_kv_cache", True):
        raise ValueError("the cuda platform's batch-invariant mode covers decoder models: an encoder's attention "
                         "runs torch's SDPA over a padded batch, whose kernel and order depend on the batch; "
                         "run this model without --batch-invariant")
    tensors = [*model.parameters(), *model.buffers()]
    odd = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.dtype not in INVARIANT_DTYPES})
    if odd:
        raise ValueError(f"the cuda platform's batch-invariant mode multiplies float16/bfloat16/float32 weights; this "
                         f"model holds {', '.join(odd)} tensors (quantized linears run cuBLAS scaled GEMMs or "
                         f"dequantizing kernels tiled by the batch): load it unquantized or run without "
                         f"--batch-invariant")
    use_invariant_linears(model, tuning)
    leftover = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)})
    if leftover:
        raise ValueError(f"the cuda platform's batch-invariant mode has no batch-invariant kernel for {leftover} "
                         "linears; run without --batch-invariant")
    return model

