"""GGUF tensors -> Hugging Face (name, float tensor) pairs: dequantize, rename, un-permute.

Names: llama.cpp's ``blk.N.attn_q.weight`` is HF's ``model.layers.N.self_attn.q_proj.weight``
(table below). Permutation: llama.cpp's converter reorders the rows of Q and K of ``llama``-
architecture files (Llama, Mistral, SmolLM2) so that each head's two rotary halves interleave::

    HF rows of one head:    [x0 x1 ... x(D/2-1) | y0 y1 ... y(D/2-1)]   (neox rotate-half pairs x_i, y_i)
    GGUF rows of that head: [x0 y0 x1 y1 ... ]                           (GPT-J adjacent pairs)

``unpermute_rows`` undoes it: view a head's rows as [D/2, 2], swap to [2, D/2]. Qwen2/Qwen3
files are written in HF order and are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from .gguf_quants import dequantize_blocks
from .gguf_reader import GGUFFile, GGUFTensorInfo

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
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's rope scaling divisors: consumed by the config, not a weight
PERMUTED_ARCHITECTURES = ("llama",)


def hf_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor; ValueError if it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_PATTERN.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in the Llama-family models")


def type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except (ImportError, ValueError):
        return f"type id {ggml_type}"


def dequantize(gguf: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    """One tensor as float32 (F16 stays float16) with shape ``info.shape``."""
    ggml_type = info.ggml_type
    if ggml_type not in FLOAT_TYPES and ggml_type != BF16 and ggml_type not in QUANTIZED_TYPES:
        raise ValueError(
            f"GGUF tensor {info.name!r} is stored as {type_name(ggml_type)}, which Podium cannot dequantize; "
            f"supported types: {', '.join(SUPPORTED_TYPE_NAMES)}"
        )
    raw = gguf.raw(info)  # uint8 [*shape[:-1], row_bytes]
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


def gguf_weights(gguf: GGUFFile, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight of the file as (HF name, tensor), Q/K rows restored to HF order where needed."""
    unknown = [name for name in gguf.tensors if name != ROPE_FREQS and not _maps(name)]
    if unknown:
        raise ValueError(f"GGUF file {gguf.path} has tensors Podium does not know: {', '.join(unknown[:12])}")
    permuted = gguf.architecture in PERMUTED_ARCHITECTURES
    for name, info in gguf.tensors.items():
        if name == ROPE_FREQS:
            continue
        target = hf_name(name)
        tensor = dequantize(gguf, info)
        if permuted and target.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = unpermute_rows(tensor, num_heads)
        elif permuted and target.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = unpermute_rows(tensor, num_kv_heads)
        yield target, tensor


def _maps(gguf_name: str) -> bool:
    try:
        hf_name(gguf_name)
    except ValueError:
        return False
    return True
