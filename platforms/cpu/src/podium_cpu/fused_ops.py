"""The CPU platform's overrides of the core's named ops (``podium_plugin_api.ops``).

- rms_norm, fused_add_rms_norm: one native pass each (native/fused_ops.c), bfloat16 and float32.
  They round exactly where the references round but sum squares in their own order (float32
  rounding apart; float32 greedy output stays token-exact with transformers, tested).
- rotary_embedding: native for float32 and bfloat16; bit-identical to the reference.
- silu_and_mul: native for bfloat16 and float32, rounding where torch's silu and mul round (silu
  in float32 of the gate, rounded to the dtype, times up, rounded); its e^x is not libm's, but a
  full sweep of bf16 gates gave torch's results bit for bit (float32: a few ulps).
- rms_norm_linear, silu_and_mul_linear: where the linear is a ``NativeLinear`` that takes
  the batch, one native call: the norm or SiLU-mul runs row by row in the kernel's input pass
  (native/prologue.h, the same row code as the ops alone), so the result is "op, then linear" bit
  for bit, in one call and one OpenMP region instead of two. Other linears: the op, then the linear.
- top_k_top_p: a top-k pre-filter: when every row has a top-k, only the top max(k) logits of each
  row are sorted instead of the whole vocabulary.
- fused_moe: tokens grouped by expert, every expert on packed linears (``moe``).
- gguf_linear, gguf_embedding: GGUF blocks dequantized inside native kernels (``gguf_ops``).
- apply_token_bitmask: one pass writing -inf over the forbidden tokens only, where the reference
  builds a whole [rows, vocab] penalty and adds it (at batch 32 over a 49k vocabulary that was
  about a tenth of a decode step).
- argmax (greedy sampling): one native pass a row keeping each lane's largest logit and where it
  first came; the core's two-pass torch version read the logits twice (about 0.8 ms a step at 32 x
  49k).
Anything outside what a native op handles (other dtypes, odd strides) goes to the reference. The
native ops are what lets a float32 decode step be captured as a CPU graph (graphs.py): every op
of it is a native call.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from podium_plugin_api import ops as reference

from . import gguf_ops, moe
from .linear_packing import NativeLinear
from .native_kernels import NativeKernels

PREFILTER_MAX_FRACTION = 8  # the pre-filter pays when max(top_k) is at most vocab / 8


def cpu_ops(kernels: NativeKernels | None) -> dict[str, Callable]:
    silu_linear = reference.silu_and_mul_linear if kernels is None else partial(silu_and_mul_linear, kernels)
    ops: dict[str, Callable] = {"top_k_top_p": top_k_top_p, "fused_moe": partial(moe.fused_moe, silu_linear)}
    if kernels is not None:
        ops.update(
            rms_norm=partial(rms_norm, kernels),
            fused_add_rms_norm=partial(fused_add_rms_norm, kernels),
            rotary_embedding=partial(rotary_embedding, kernels),
            silu_and_mul=partial(silu_and_mul, kernels),
            rms_norm_linear=partial(rms_norm_linear, kernels),
            silu_and_mul_linear=partial(silu_and_mul_linear, kernels),
            gguf_linear=partial(gguf_ops.gguf_linear, kernels),
            gguf_embedding=partial(gguf_ops.gguf_embedding, kernels),
            apply_token_bitmask=partial(apply_token_bitmask, kernels),
            argmax=partial(argmax, kernels),
        )
    return ops


NATIVE_DTYPES = (torch.bfloat16, torch.float32)


def _native_rows(x: torch.Tensor) -> bool:
    """A 2-D bf16 or float32 CPU tensor whose rows are contiguous (any row stride)."""
    return (x.dtype in NATIVE_DTYPES and x.is_cpu and x.dim() == 2 and x.stride(1) == 1
            and x.stride(0) >= x.shape[1])


def _norm_native(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    ok = _native_rows(x) and weight.dtype == x.dtype and weight.dim() == 1 and weight.shape[0] == x.shape[1]
    ok = ok and weight.is_contiguous()
    if residual is not None:
        ok = ok and _native_rows(residual) and residual.dtype == x.dtype and residual.shape == x.shape
    return ok


def rms_norm(kernels: NativeKernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _norm_native(x, weight, None):
        return reference.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)  # [T, hidden]
    kernels.rms_norm[x.dtype](x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), None,
                              x.shape[0], x.shape[1], float(eps), torch.get_num_threads())
    return out


def fused_add_rms_norm(
    kernels: NativeKernels, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _norm_native(x, weight, residual):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)  # [T, hidden]
    summed = torch.empty(x.shape, dtype=x.dtype)
    kernels.rms_norm[x.dtype](x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
                              out.data_ptr(), summed.data_ptr(), x.shape[0], x.shape[1], float(eps),
                              torch.get_num_threads())
    return out, summed


def _heads(t: torch.Tensor) -> bool:
    """[T, heads, D] with each token's heads contiguous (any token stride)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= t.shape[1] * t.shape[2]


def rotary_embedding(
    kernels: NativeKernels, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype, d = query.dtype, query.shape[-1]
    usable = dtype in kernels.rotary and key.dtype == dtype and _heads(query) and _heads(key)
    usable = usable and key.shape[0] == query.shape[0] == positions.shape[0] and key.shape[2] == d and d % 2 == 0
    usable = usable and cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == d and query.is_cpu
    if not usable:
        return reference.rotary_embedding(positions, query, key, cos_sin_cache)
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    table = cos_sin_cache
    if table.dtype != torch.float32 or not table.is_contiguous():
        table = table.float().contiguous()
    q_out, k_out = torch.empty(query.shape, dtype=dtype), torch.empty(key.shape, dtype=dtype)
    rc = kernels.rotary[dtype](query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), q_out.data_ptr(),
                               k_out.data_ptr(), positions.data_ptr(), table.data_ptr(), table.shape[0],
                               query.shape[0], query.shape[1], key.shape[1], d, torch.get_num_threads())
    if rc != 0:  # the kernel checks every position before writing anything
        low, high = torch.aminmax(positions)
        raise ValueError(f"positions must be in [0, {table.shape[0]}), got [{int(low)}, {int(high)}]")
    return q_out, k_out


def silu_and_mul(kernels: NativeKernels, x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]; rows may be strided."""
    if not _native_rows(x) or x.shape[1] % 2:
        return reference.silu_and_mul(x)
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype)  # [T, I]
    kernels.silu_and_mul[x.dtype](x.data_ptr(), x.stride(0), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


def _fused_linear(x: torch.Tensor, linear) -> Callable | None:
    """The native fused entry for input ``x`` into ``linear``, or None (the op, then the linear)."""
    if not isinstance(linear, NativeLinear) or not _native_rows(x) or not linear.takes(x):
        return None
    return linear.kernel.fused


def _run_fused(fused, linear, x, residual=None, norm_weight=None, eps=0.0, summed=None, silu=False) -> torch.Tensor:
    m = x.shape[0]
    out = torch.empty((m, linear.out_features), dtype=x.dtype)  # [T, N]
    bias = None if linear.bias_f32 is None else linear.bias_f32.data_ptr()
    rc = fused(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
               0 if residual is None else residual.stride(0), None if norm_weight is None else norm_weight.data_ptr(),
               float(eps), None if summed is None else summed.data_ptr(), int(silu), m, linear.packed.data_ptr(),
               linear.out_features, linear.in_features, bias, out.data_ptr(), linear.out_features,
               torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"the {linear.kernel_name} linear kernel could not allocate its scratch rows")
    return out


def rms_norm_linear(kernels: NativeKernels, x, residual, weight, eps, linear):
    """(linear(rms_norm(x + residual)), x + residual); one native call into a native linear."""
    fused = _fused_linear(x, linear)
    if fused is None or not _norm_native(x, weight, residual) or x.shape[1] != linear.in_features:
        if residual is None:
            return linear(rms_norm(kernels, x, weight, eps)), x
        normed, summed = fused_add_rms_norm(kernels, x, residual, weight, eps)
        return linear(normed), summed
    if residual is None:
        return _run_fused(fused, linear, x, norm_weight=weight, eps=eps), x
    summed = torch.empty(x.shape, dtype=x.dtype)  # [T, K]
    return _run_fused(fused, linear, x, residual, weight, eps, summed), summed


def silu_and_mul_linear(kernels: NativeKernels, x, linear):
    """linear(silu(gate) * up) for x [T, 2I]; one native call into a native linear."""
    fused = _fused_linear(x, linear)
    if fused is None or x.shape[1] != 2 * linear.in_features:
        return linear(silu_and_mul(kernels, x))
    return _run_fused(fused, linear, x, silu=True)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference's result, sorting only each row's top max(k) logits when every row has a top-k."""
    vocab = logits.shape[-1]
    if logits.dim() != 2 or not bool((top_k > 0).all()):
        return reference.top_k_top_p(logits, top_k, top_p)
    k = top_k.clamp(max=vocab)
    kmax = int(k.max())
    if kmax * PREFILTER_MAX_FRACTION > vocab:
        return reference.top_k_top_p(logits, top_k, top_p)
    top_values, top_index = logits.topk(kmax, dim=-1)  # [B, kmax], sorted descending
    # entries ranked below a row's k are dropped by the reference too: its math on [B, kmax] is the same
    kept = reference.top_k_top_p(top_values, k, top_p)
    return torch.full_like(logits, float("-inf")).scatter_(-1, top_index, kept)


def argmax(kernels: NativeKernels, logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> int64 [B]: each row's first index of its maximum, NaN the maximum (the
    reference's rule), in one native pass over the logits."""
    if not _native_rows(logits) or logits.shape[1] == 0:
        return reference.argmax(logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64)  # [B]
    kernels.argmax[logits.dtype](logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                                 out.data_ptr(), torch.get_num_threads())
    return out


def apply_token_bitmask(kernels: NativeKernels, logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor | None) -> torch.Tensor:
    words = -(-logits.shape[-1] // 32)
    native = (_native_rows(logits) and bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.dim() == 2
              and bitmask.shape[1] == words and (rows is not None or bitmask.shape[0] == logits.shape[0]))
    if not native:
        return reference.apply_token_bitmask(logits, bitmask, rows)
    bitmask = bitmask.contiguous()
    if rows is not None:
        rows = rows.to(torch.int64).contiguous()
        if rows.shape != (bitmask.shape[0],) or bool(((rows < 0) | (rows >= logits.shape[0])).any()):
            raise ValueError(f"apply_token_bitmask: rows must be {bitmask.shape[0]} indices below {logits.shape[0]}")
    kernels.token_bitmask[logits.dtype](logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), words,
                                        None if rows is None else rows.data_ptr(), bitmask.shape[0],
                                        logits.shape[1], torch.get_num_threads())
    return logits
