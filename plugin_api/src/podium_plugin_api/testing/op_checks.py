"""Custom-op conformance: each override against ``podium_plugin_api.ops.REFERENCE_OPS``.

Inputs are random, in the dtype under test, on the platform's device; the reference runs on
the same numbers in float64 on the CPU. ``top_k_top_p`` is compared by the set of tokens it
keeps and their values, since which tokens survive is what sampling depends on; ``argmax`` by
exact equality (ties and NaNs included). The norm/SiLU + linear ops run at 1, 2 and 7
rows, with and without a bias and a residual: a platform may take a different kernel for a
batch-1 decode row than for a prefill chunk, and both must be right. ``fused_moe`` runs
at 1 and 7 tokens, top-1 and top-2 of 4 experts, with an expert no token picks and an id of -1.
``encoder_attention`` runs on one sequence and on a ragged batch (lengths 3, 1, 5, 2), with and
without grouped key/value heads.
``gguf_linear`` and ``gguf_embedding`` run every kept block format at 1, 2 and 7 rows on random blocks;
``gguf_linear`` is compared relative to its largest reference value at bf16's tolerance whatever the
row dtype, since a kernel may quantize the activations to int8 per block as llama.cpp does;
``fp8_linear`` each weight-scale granularity at 1, 2 and 7 rows; ``int4_linear`` AWQ, GPTQ and GPTQ with
act-order at 1, 2 and 7 rows (two groups of 128).
``apply_token_bitmask`` masks every row and a subset of rows in another order, over a vocabulary
that ends mid-word, with all-allowed and all-forbidden words among random ones; it must give the
reference's logits exactly (forbidden tokens -inf, the others untouched).
``lora_shrink`` and ``lora_expand``: the cases of ``lora_cases`` (rows with and without an adapter
slot in one batch); a shrink is compared on the rows that have a slot only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..fp8 import FP8
from ..gguf_blocks import BLOCKS, random_rows
from ..int4 import AWQ, GPTQ, random_packed
from ..lora import LoRAMapping
from ..moe import MoEExperts
from ..ops import REFERENCE_OPS
from .lora_cases import lora_cases
from .report import ConformanceError, check_close, dtype_name, guarded

T, HIDDEN, HEADS, KV_HEADS, HEAD_SIZE, MAX_POS = 7, 96, 4, 2, 32, 64
OUT_FEATURES = 40  # the projection of the *_linear ops: not a multiple of a kernel's usual tile
LINEAR_ROWS = (1, 2, T)
NUM_EXPERTS, EXPERT_SIZE = 4, 24
GGUF_COLUMNS = 256  # one K-quant block, eight legacy ones


def _linear(in_features: int, bias: bool, dtype: torch.dtype, gen: torch.Generator) -> nn.Linear:
    """An nn.Linear with seeded weights (scaled so outputs stay near 1) in ``dtype``, on the CPU."""
    layer = nn.Linear(in_features, OUT_FEATURES, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(OUT_FEATURES, in_features, generator=gen) / in_features**0.5)
        if bias:
            layer.bias.copy_(torch.randn(OUT_FEATURES, generator=gen))
    return layer.requires_grad_(False).to(dtype)


def op_cases(name: str, dtype: torch.dtype, gen: torch.Generator) -> list[tuple[Any, ...]]:
    """Every argument tuple the kit checks op ``name`` with: one (``op_inputs``) for most ops."""
    if name == "rms_norm_linear":
        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        return [(randn(rows, HIDDEN), randn(rows, HIDDEN) if with_residual else None, randn(HIDDEN), 1e-6,
                 _linear(HIDDEN, bias, dtype, gen))
                for rows in LINEAR_ROWS for with_residual, bias in ((True, False), (False, True))]
    if name == "silu_and_mul_linear":
        return [(torch.randn(rows, 2 * HIDDEN, generator=gen).to(dtype), _linear(HIDDEN, bias, dtype, gen))
                for rows in LINEAR_ROWS for bias in (False, True)]
    if name == "apply_token_bitmask":
        return [_bitmask_case(rows, dtype, gen) for rows in (None, [4, 0, 2])]
    if name == "fused_moe":
        return [_moe_case(rows, top_k, dtype, gen) for rows in (1, T) for top_k in (1, 2)]
    if name == "encoder_attention":
        return [_encoder_case(lens, kv_heads, dtype, gen) for lens in ((T,), (3, 1, 5, 2)) for kv_heads in (HEADS, KV_HEADS)]
    if name == "gguf_linear":
        return [(torch.randn(rows, GGUF_COLUMNS, generator=gen).to(dtype),
                 random_rows(ggml_type, OUT_FEATURES, GGUF_COLUMNS, gen), ggml_type)
                for ggml_type in BLOCKS for rows in LINEAR_ROWS]
    if name == "gguf_embedding":
        return [(torch.randint(0, OUT_FEATURES, (rows,), generator=gen),
                 random_rows(ggml_type, OUT_FEATURES, GGUF_COLUMNS, gen), ggml_type, dtype)
                for ggml_type in BLOCKS for rows in LINEAR_ROWS]
    if name in ("lora_shrink", "lora_expand"):
        return lora_cases(name, dtype, gen)
    if name == "fp8_linear":
        return [_fp8_case(rows, granularity, dtype, gen) for granularity in ("tensor", "channel", "block")
                for rows in LINEAR_ROWS]
    if name == "int4_linear":
        return [_int4_case(rows, fmt, act_order, dtype, gen) for fmt, act_order in ((AWQ, False), (GPTQ, False),
                                                                                   (GPTQ, True))
                for rows in LINEAR_ROWS]
    return [op_inputs(name, dtype, gen)]


def _bitmask_case(rows: list[int] | None, dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, ...]:
    batch, vocab = 5, 100  # four words, the last one holding only 4 tokens
    words = -(-vocab // 32)
    count = batch if rows is None else len(rows)
    bitmask = torch.randint(-2**31, 2**31 - 1, (count, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0, 1], bitmask[-1, 2] = -1, 0  # every token of a word allowed; every one forbidden
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    return logits, bitmask, None if rows is None else torch.tensor(rows)


def _int4_case(rows: int, fmt: str, act_order: bool, dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, ...]:
    """x [rows, 256] and random packed INT4 tensors for [256 -> OUT_FEATURES] in groups of 128, a bias."""
    packed = random_packed(fmt, GGUF_COLUMNS, OUT_FEATURES, 128, act_order, gen)
    x = (torch.randn(rows, GGUF_COLUMNS, generator=gen) / 4).to(dtype)
    return (x, packed["qweight"], packed["qzeros"], packed["scales"], packed.get("g_idx"), 128, fmt,
            torch.randn(OUT_FEATURES, generator=gen).to(dtype))


def _fp8_case(rows: int, granularity: str, dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, ...]:
    """x [rows, 256], an e4m3 weight [OUT_FEATURES, 256] and its scale of ``granularity``, a bias."""
    weight = (torch.randn(OUT_FEATURES, GGUF_COLUMNS, generator=gen) * 64).clamp(-448, 448).to(FP8)
    shapes = {"tensor": (1,), "channel": (OUT_FEATURES, 1), "block": (1, GGUF_COLUMNS // 128)}
    scale = torch.rand(shapes[granularity], generator=gen) / 1000 + 1e-4
    bias = torch.randn(OUT_FEATURES, generator=gen).to(dtype)
    return torch.randn(rows, GGUF_COLUMNS, generator=gen).to(dtype), weight, scale, bias


def _moe_case(rows: int, top_k: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, ...]:
    """Random experts (expert 3 never chosen) and routing; the last assignment of row 0 is -1."""
    experts = MoEExperts(NUM_EXPERTS, HIDDEN, EXPERT_SIZE)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) / HIDDEN**0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / EXPERT_SIZE**0.5)
    scores = torch.rand(rows, NUM_EXPERTS - 1, generator=gen)
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    ids[0, -1] = -1
    return torch.randn(rows, HIDDEN, generator=gen).to(dtype), experts.requires_grad_(False).to(dtype), weights, ids


def _encoder_case(lens: tuple[int, ...], kv_heads: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, ...]:
    """A ragged batch of sequences ``lens`` long: one alone, or several of different lengths (one of 1)."""
    tokens = sum(lens)
    starts = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(tokens, heads, HEAD_SIZE, generator=gen).to(dtype) for heads in (HEADS, kv_heads, kv_heads))
    return q, k, v, starts, list(lens), HEAD_SIZE**-0.5


def op_inputs(name: str, dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, ...]:
    """Random arguments for op ``name`` (CPU tensors)."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    if name == "rms_norm":
        return randn(T, HIDDEN), randn(HIDDEN), 1e-6
    if name == "fused_add_rms_norm":
        return randn(T, HIDDEN), randn(T, HIDDEN), randn(HIDDEN), 1e-6
    if name == "rotary_embedding":
        angles = torch.arange(MAX_POS)[:, None] * (10000.0 ** (-torch.arange(0, HEAD_SIZE, 2) / HEAD_SIZE))[None, :]
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)  # [MAX_POS, HEAD_SIZE]
        positions = torch.randint(0, MAX_POS, (T,), generator=gen)
        return positions, randn(T, HEADS, HEAD_SIZE), randn(T, KV_HEADS, HEAD_SIZE), cos_sin
    if name == "silu_and_mul":
        return (randn(T, 2 * HIDDEN),)
    if name == "top_k_top_p":
        # distinct values exactly representable in every dtype: no ties at the top-k boundary
        logits = torch.stack([torch.randperm(50, generator=gen) for _ in range(6)]).sub(25).mul(0.25).to(dtype)
        top_k = torch.tensor([0, 1, 5, 50, 0, 10])
        top_p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.3, 0.8])
        return logits, top_k, top_p
    if name == "argmax":
        # small integers: many ties (the first index must win); row 2 holds NaNs (NaN is the maximum),
        # row 3 an infinity before a NaN; columns past 4096 so that chunked kernels see several chunks
        logits = torch.randint(-4, 4, (5, 5000), generator=gen).to(dtype)
        logits[1, 4321] = 9  # the maximum in a late chunk
        logits[2, 3000], logits[2, 17] = float("nan"), float("nan")
        logits[3, 10], logits[3, 4999] = float("inf"), float("nan")
        return (logits,)
    raise ValueError(f"no kit inputs for op {name!r}; known ops are {sorted(REFERENCE_OPS)}")


def _to(args: tuple[Any, ...], device: torch.device | str, float64: bool = False) -> tuple[Any, ...]:
    out = []
    for a in args:
        if isinstance(a, nn.Module):
            a = copy.deepcopy(a).to(device=device, dtype=torch.float64 if float64 else None)
        elif isinstance(a, LoRAMapping):
            a = a.to(device)
        elif isinstance(a, torch.Tensor):
            a = a.to(device, copy=True)  # each side its own: an op may write into its inputs (lora_expand)
            if float64 and a.is_floating_point():
                a = a.double()
        out.append(a)
    return tuple(out)


def _check_top_k_top_p(
    got: torch.Tensor, want: torch.Tensor, args: tuple[Any, ...], what: str, dtype: torch.dtype
) -> None:
    got = got.detach().cpu()
    kept, kept_ref = ~torch.isinf(got), ~torch.isinf(want)
    for row in range(want.shape[0]):
        if not torch.equal(kept[row], kept_ref[row]):
            ours = kept[row].nonzero().flatten().tolist()
            theirs = kept_ref[row].nonzero().flatten().tolist()
            raise ConformanceError(
                f"{what}: row {row} (top_k={int(args[1][row])}, top_p={float(args[2][row])}) keeps tokens {ours}, "
                f"the reference keeps {theirs}"
            )
    check_close(got.masked_fill(~kept, 0), want.masked_fill(~kept_ref, 0), what=f"{what}: kept logits", dtype=dtype)


def check_op(
    name: str, fn: Callable[..., Any], dtype: torch.dtype, device: torch.device, source: str, seed: int = 0
) -> None:
    """Raise ConformanceError unless override ``fn`` of op ``name`` matches the reference."""
    if name not in REFERENCE_OPS:
        raise ConformanceError(f"{source} overrides unknown op {name!r}; known ops are {sorted(REFERENCE_OPS)}")
    for args in op_cases(name, dtype, torch.Generator().manual_seed(seed)):
        _check_case(name, fn, args, dtype, device, source)


def _describe(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return str(list(a.shape))
    if isinstance(a, nn.Linear):
        return f"Linear({a.in_features}, {a.out_features}, bias={a.bias is not None})"
    if isinstance(a, MoEExperts):
        return f"MoEExperts({a.extra_repr()})"
    return repr(a)


def _check_case(name: str, fn: Callable[..., Any], args: tuple[Any, ...], dtype: torch.dtype,
                device: torch.device, source: str) -> None:
    what = f"custom op {name} from {source} ({dtype_name(dtype)}; arguments {', '.join(map(_describe, args))})"
    got = guarded(what, fn, *_to(args, device))
    want = REFERENCE_OPS[name](*_to(args, "cpu", float64=True))
    if name == "top_k_top_p":
        _check_top_k_top_p(got, want, args, what, dtype)
        return
    if name == "argmax":
        got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
        if not isinstance(got, torch.Tensor) or got.dtype != torch.int64 or not torch.equal(got, want):
            raise ConformanceError(f"{what}: returned {got}, the reference (first index of the maximum) {want}")
        return
    if name == "apply_token_bitmask":
        got = got.detach().cpu() if isinstance(got, torch.Tensor) else got
        if not isinstance(got, torch.Tensor) or not torch.equal(got.double(), want):
            raise ConformanceError(f"{what}: the masked logits differ from the reference's (forbidden tokens "
                                   "-inf, every other logit unchanged)")
        return
    if name == "lora_shrink" and isinstance(got, torch.Tensor):  # rows without a slot are left undefined
        used = args[2].token_slots >= 0
        got, want = got.detach().cpu()[used], want[used]
    outputs = want if isinstance(want, tuple) else (want,)
    results = got if isinstance(got, tuple) else (got,)
    if len(results) != len(outputs):
        raise ConformanceError(f"{what}: returned {len(results)} value(s), the reference returns {len(outputs)}")
    if name == "gguf_linear":  # the format's tolerance, relative to the result's scale (module docstring)
        scale = max(outputs[0].abs().max().item(), 1e-30)
        results, outputs, dtype = (results[0].detach().cpu().double() / scale,), (outputs[0] / scale,), torch.bfloat16
    for i, (r, w) in enumerate(zip(results, outputs)):
        label = f"{what}: output {i}" if len(outputs) > 1 else what
        check_close(r, w, what=label, dtype=dtype)
