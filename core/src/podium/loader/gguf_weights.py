"""GGUF tensors -> Hugging Face (name, float tensor) pairs: dequantize, rename, un-permute.

Names: llama.cpp's ``blk.N.attn_q.weight`` is HF's ``model.layers.N.self_attn.q_proj.weight``
(table below). Permutation: llama.cpp's converter reorders the rows of Q and K of ``llama``-
architecture files (Llama, Mistral, SmolLM2) so that each head's two rotary halves interleave::

    HF rows of one head:    [x0 x1 ... x(D/2-1) | y0 y1 ... y(D/2-1)]   (neox rotate-half pairs x_i, y_i)
    GGUF rows of that head: [x0 y0 x1 y1 ... ]                           (GPT-J adjacent pairs)

``unpermute_rows`` undoes it: view a head's rows as [D/2, 2], swap to [2, D/2]. Qwen2/Qwen3
files are written in HF order and are left alone.

Per architecture (llama.cpp's converter, undone here):
- experts: ``ffn_{gate,up,down}_exps`` hold every expert stacked ([E, I, H] / [E, H, I]); each
  expert's slice becomes ``mlp.experts.N.{gate,up,down}_proj.weight``; the router is ``ffn_gate_inp``,
  Qwen2-MoE's shared expert ``ffn_*_shexp`` and its gate ``ffn_gate_inp_shexp`` (a vector: [1, H] here);
- gemma2/gemma3: norms are stored as ``1 + weight`` (Gemma's norm scales by that): 1 is subtracted;
  ``ffn_norm`` is the pre-feedforward norm there, ``post_attention_norm`` / ``post_ffw_norm`` the others;
- phi3: the merged ``attn_qkv`` and ``ffn_up`` (gate rows then up rows) are Podium's own merged
  projections; its longrope factor tensors belong to the config.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import numpy as np
import torch

from .gguf_quants import dequantize_blocks
from .gguf_reader import GGUFFile, GGUFTensorInfo
from .lazy import LazyTensor

# ggml type ids (gguf.GGMLQuantizationType) Podium dequantizes
FLOAT_TYPES = {0: torch.float32, 1: torch.float16}  # F32, F16: read as they are
BF16 = 30
QUANTIZED_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K",
                   13: "Q5_K", 14: "Q6_K"}
SUPPORTED_TYPE_NAMES = ("F32", "F16", "BF16", *QUANTIZED_TYPES.values())

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_STACKED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GEMMA_NAMES = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_NAMES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's rope scaling divisors: consumed by the config, not a weight
CONFIG_TENSORS = (ROPE_FREQS, "rope_factors_long.weight", "rope_factors_short.weight")
PERMUTED_ARCHITECTURES = ("llama",)
NORM_PLUS_ONE_ARCHITECTURES = ("gemma2", "gemma3")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face parameter name of a GGUF tensor (stacked experts: ``...experts.{}.gate_proj.weight``,
    to format with each expert's index); ValueError if it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_PATTERN.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        names = {**_BLOCK_NAMES, **_MOE_NAMES, **_ARCH_NAMES.get(arch, {})}
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
        if part in _STACKED_EXPERTS:
            return f"model.layers.{layer}.mlp.experts.{{}}.{_STACKED_EXPERTS[part]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in {arch!r} models")


def type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type id {ggml_type}"


def dequantize(gguf: GGUFFile, info: GGUFTensorInfo, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """One tensor as float32 (F16 stays float16) with shape ``info.shape``; ``rows`` (start, count):
    only those rows of a 2-D tensor (its quantized blocks run along rows, so only they are read)."""
    ggml_type = info.ggml_type
    if ggml_type not in FLOAT_TYPES and ggml_type != BF16 and ggml_type not in QUANTIZED_TYPES:
        raise ValueError(
            f"GGUF tensor {info.name!r} is stored as {type_name(ggml_type)}, which Podium cannot dequantize; "
            f"supported types: {', '.join(SUPPORTED_TYPE_NAMES)}"
        )
    raw = gguf.raw(info)  # uint8 [*shape[:-1], row_bytes]
    if rows is not None:
        raw = raw[rows[0]:rows[0] + rows[1]]
        info = dataclasses.replace(info, shape=(rows[1], *info.shape[1:]))
    if ggml_type in FLOAT_TYPES:
        dtype = FLOAT_TYPES[ggml_type]
        return torch.from_numpy(np.array(raw)).view(dtype).reshape(info.shape)
    if ggml_type == BF16:
        return torch.from_numpy(np.array(raw)).view(torch.bfloat16).reshape(info.shape).float()
    fast = dequantize_blocks(raw, ggml_type)  # Q4_0, Q4_1, Q8_0 in torch (gguf_quants)
    if fast is not None:
        return fast.reshape(info.shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(raw, GGMLQuantizationType(ggml_type))  # float32 [*shape]
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleave (module docstring). weight [num_heads * D, ...]."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {num_heads} heads of even size")
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])  # [H, D/2, 2, ...]
    return per_head.transpose(1, 2).reshape(weight.shape)  # [H, 2, D/2, ...] -> [H*D, ...]


def tensor_types(gguf: GGUFFile) -> dict[str, int]:
    """{HF name: ggml type id} of the file's block-quantized 2-D tensors (stacked experts left out):
    what a GGUF quantization method may keep in its blocks."""
    arch = gguf.architecture
    types = {}
    for name, info in gguf.tensors.items():
        if info.ggml_type in QUANTIZED_TYPES and len(info.shape) == 2 and name not in CONFIG_TENSORS \
                and _maps(name, arch) and "{}" not in hf_name(name, arch):
            types[hf_name(name, arch)] = info.ggml_type
    return types


def gguf_weights(gguf: GGUFFile, num_heads: int, num_kv_heads: int, lazy: bool = False,
                 keep: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the file as (HF name, tensor), restored to HF's conventions (module docstring).

    ``lazy``: the 2-D weights as ``LazyTensor`` whose row slices dequantize only those rows (a
    tensor-parallel rank's shard); q/k slices must hold whole heads (llama.cpp permutes within one).
    ``keep``: these names as their stored block bytes, uint8 [rows, row_bytes] (rows permuted alike),
    read whole (a quantization method keeps them; it does not run tensor-parallel)."""
    arch = gguf.architecture
    unknown = [name for name in gguf.tensors if name not in CONFIG_TENSORS and not _maps(name, arch)]
    if unknown:
        raise ValueError(f"GGUF file {gguf.path} has tensors Podium does not know: {', '.join(unknown[:12])}")
    permuted = arch in PERMUTED_ARCHITECTURES
    for name, info in gguf.tensors.items():
        if name in CONFIG_TENSORS:
            continue
        target = hf_name(name, arch)
        if target in keep:
            tensor = torch.from_numpy(np.array(gguf.raw(info)))
        elif lazy and len(info.shape) == 2 and "{}" not in target and not target.endswith("norm.weight") \
                and not target.endswith("shared_expert_gate.weight"):
            yield target, _lazy_rows(gguf, info, target, num_heads if permuted else 0, num_kv_heads if permuted else 0)
            continue
        else:
            tensor = dequantize(gguf, info)
        if permuted and target.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = unpermute_rows(tensor, num_heads)
        elif permuted and target.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = unpermute_rows(tensor, num_kv_heads)
        elif arch in NORM_PLUS_ONE_ARCHITECTURES and target.endswith("norm.weight"):
            tensor = tensor - 1
        elif target.endswith("shared_expert_gate.weight"):
            tensor = tensor.reshape(1, -1)  # [H] -> [1, H]
        if "{}" in target:  # stacked experts [E, ...]: one tensor per expert
            yield from ((target.format(expert), tensor[expert]) for expert in range(tensor.shape[0]))
        else:
            yield target, tensor


def _lazy_rows(gguf: GGUFFile, info: GGUFTensorInfo, target: str, num_heads: int, num_kv_heads: int) -> LazyTensor:
    """A 2-D GGUF weight read by row slices; q/k rows un-permuted per head (``num_heads`` 0: not permuted)."""
    heads = num_heads if target.endswith(("q_proj.weight", "q_proj.bias")) else \
        num_kv_heads if target.endswith(("k_proj.weight", "k_proj.bias")) else 0
    per_head = info.shape[0] // heads if heads else 0

    def load() -> torch.Tensor:
        tensor = dequantize(gguf, info)
        return unpermute_rows(tensor, heads) if heads else tensor

    def read(dim: int, start: int, size: int) -> torch.Tensor | None:
        if dim != 0:
            return None  # columns of every row: the whole tensor is dequantized
        if heads and (start % per_head or size % per_head):
            raise ValueError(f"GGUF tensor {info.name!r}: rows [{start}, {start + size}) split a head of {per_head} rows")
        tensor = dequantize(gguf, info, (start, size))
        return unpermute_rows(tensor, size // per_head) if heads else tensor

    return LazyTensor(tuple(info.shape), load, read)


def _maps(gguf_name: str, arch: str) -> bool:
    try:
        hf_name(gguf_name, arch)
    except ValueError:
        return False
    return True
