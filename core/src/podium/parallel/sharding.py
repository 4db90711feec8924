"""Tensor parallelism as a transformation of the plain model, in two phases (gpt-fast's shape).

The model code never learns about ranks. ``shard_model`` runs on the model built on the ``meta``
device, before any memory is allocated: each layer it knows gets the shapes of rank ``r``'s shard
and the model gets ``weight_slices``, which tells the weight loader which slice of each checkpoint
tensor this rank keeps, so a rank reads only its slices. ``connect_model`` runs after loading: it
wraps the layers whose outputs are partial with the communicator's collectives.

    attention   q|k|v column-parallel by heads: rank r keeps H/n query heads and their KV heads
                (Hkv/n of them; when Hkv < n each KV head is replicated on n/Hkv ranks, as vLLM
                does); o row-parallel, its output all-reduced (its bias on rank 0 only)
    MLP         gate|up column-parallel, down row-parallel, the MLP's output all-reduced
    MoE         every expert sharded by its intermediate size (``podium_plugin_api.moe``), the
                router and the shared expert's gate replicated, the block's output all-reduced once
    embedding   vocab-parallel: rank r holds rows [r*Vp, (r+1)*Vp) (Vp = ceil(V/n), the last rank's
                tail zero); tokens outside its rows read zeros, the rows are all-reduced
    LM head     vocab-parallel (tied: the embedding's shard); logits gathered over the vocab
    norms       replicated (Qwen3's per-head q/k norms too: they act within a head)

An impossible split is a ValueError naming the numbers (9 heads over 2 ranks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..models.layers import Attention, GatedMLP
from ..models.moe import FusedMoE, SparseMoeBlock
from .layers import GatheredLogits, ReducedMlp, ReducedOutput, VocabParallelEmbedding


@dataclass(frozen=True)
class Slices:
    """The part of a checkpoint tensor a rank keeps: ``ranges`` (start, size) along ``dim``, concatenated."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(size for _, size in self.ranges)

    def take(self, tensor) -> torch.Tensor:
        """The slices of ``tensor`` (a tensor, or a lazy one from the loader that reads only them)."""
        parts = [tensor.narrow(self.dim, start, size) for start, size in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def one(dim: int, start: int, size: int) -> Slices:
    return Slices(dim, ((start, size),))


@dataclass(frozen=True)
class Split:
    """Rank ``rank`` of ``size``: its share of heads, intermediate sizes and the vocabulary."""

    rank: int
    size: int

    def even(self, total: int, what: str) -> tuple[int, int]:
        """(start, count) of an evenly divided ``total``; ValueError naming the numbers if it is not."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide the model's {what} ({total}); "
                             f"use a tensor_parallel_size that divides {total}")
        count = total // self.size
        return self.rank * count, count

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count) this rank keeps: split when there are at least as many as ranks,
        else one replicated KV head, the one its query heads attend with."""
        if num_kv_heads >= self.size:
            return self.even(num_kv_heads, "key/value heads")
        if self.size % num_kv_heads:
            raise ValueError(f"tensor_parallel_size={self.size} cannot share the model's {num_kv_heads} key/value "
                             f"heads evenly (it must divide {num_kv_heads} or be a multiple of it)")
        return self.rank * num_kv_heads // self.size, 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(first row, rows held, padded rows Vp): every rank holds Vp rows, the tail past V zero."""
        padded = -(-vocab_size // self.size)
        start = min(self.rank * padded, vocab_size)
        return start, min(padded, vocab_size - start), padded


def check_split(hf_config, size: int) -> None:
    """ValueError naming the numbers if the model's heads cannot be split over ``size`` ranks."""
    split = Split(0, size)
    heads = hf_config.num_attention_heads
    split.even(heads, "attention heads")
    split.kv_heads(heads, getattr(hf_config, "num_key_value_heads", None) or heads)


def shard_model(model: nn.Module, split: Split) -> nn.Module:
    """Give every layer rank ``split.rank``'s shard shapes (the model is on the meta device) and set
    ``model.weight_slices`` {checkpoint name: Slices}. Returns the model."""
    slices: dict[str, Slices] = {}
    with torch.device("meta"):
        for path, module in list(model.named_modules()):
            prefix = f"{path}." if path else ""
            if isinstance(module, Attention):
                _shard_attention(prefix, module, split, slices)
            elif isinstance(module, GatedMLP):
                _shard_mlp(prefix, module, split, slices)
            elif isinstance(module, FusedMoE):
                _shard_experts(prefix, module, split, slices)
        _shard_vocab(model, split, slices)
    model.weight_slices = slices
    return model


def _linear(old: nn.Linear, in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=old.bias is not None, dtype=old.weight.dtype)


def _shard_attention(prefix: str, attn: Attention, split: Split, slices: dict) -> None:
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q_start, q_count = split.even(heads, "attention heads")
    kv_start, kv_count = split.kv_heads(heads, kv_heads)
    q_rows, kv_rows = (q_start * dim, q_count * dim), (kv_start * dim, kv_count * dim)
    q_size, kv_size = q_count * dim, kv_count * dim
    attn.qkv_proj = _linear(attn.qkv_proj, attn.qkv_proj.in_features, q_size + 2 * kv_size)
    attn.o_proj = _linear(attn.o_proj, q_size, attn.o_proj.out_features)
    attn.num_heads, attn.num_kv_heads = q_count, kv_count
    attn.head_splits = [q_count, kv_count, kv_count]
    attn.merged_shards = {"q_proj": ("qkv_proj", 0, q_size), "k_proj": ("qkv_proj", q_size, kv_size),
                          "v_proj": ("qkv_proj", q_size + kv_size, kv_size)}
    attn.spec = dataclasses.replace(attn.spec, num_heads=q_count, num_kv_heads=kv_count)
    full_q, full_kv = heads * dim, kv_heads * dim
    for leaf in ("weight", "bias"):
        slices[f"{prefix}q_proj.{leaf}"] = one(0, *q_rows)
        slices[f"{prefix}k_proj.{leaf}"] = one(0, *kv_rows)
        slices[f"{prefix}v_proj.{leaf}"] = one(0, *kv_rows)
        slices[f"{prefix}qkv_proj.{leaf}"] = Slices(0, (q_rows, (full_q + kv_rows[0], kv_rows[1]),
                                                        (full_q + full_kv + kv_rows[0], kv_rows[1])))
    slices[f"{prefix}o_proj.weight"] = one(1, *q_rows)


def _shard_mlp(prefix: str, mlp: GatedMLP, split: Split, slices: dict) -> None:
    inter = mlp.down_proj.in_features
    start, count = split.even(inter, f"MLP intermediate size ({prefix}down_proj)")
    mlp.gate_up_proj = _linear(mlp.gate_up_proj, mlp.gate_up_proj.in_features, 2 * count)
    mlp.down_proj = _linear(mlp.down_proj, count, mlp.down_proj.out_features)
    mlp.merged_shards = {"gate_proj": ("gate_up_proj", 0, count), "up_proj": ("gate_up_proj", count, count)}
    for leaf in ("weight", "bias"):
        slices[f"{prefix}gate_proj.{leaf}"] = one(0, start, count)
        slices[f"{prefix}up_proj.{leaf}"] = one(0, start, count)
        slices[f"{prefix}gate_up_proj.{leaf}"] = Slices(0, ((start, count), (inter + start, count)))
    slices[f"{prefix}down_proj.weight"] = one(1, start, count)


def _shard_experts(prefix: str, experts: FusedMoE, split: Split, slices: dict) -> None:
    inter, hidden = experts.intermediate_size, experts.hidden_size
    start, count = split.even(inter, f"expert intermediate size ({prefix.rstrip('.')})")
    dtype = experts.gate_up_proj.dtype
    experts.intermediate_size = count
    experts.gate_up_proj = nn.Parameter(torch.empty(experts.num_experts, 2 * count, hidden, dtype=dtype))
    experts.down_proj = nn.Parameter(torch.empty(experts.num_experts, hidden, count, dtype=dtype))
    for expert in range(experts.num_experts):
        slices[f"{prefix}{expert}.gate_proj.weight"] = one(0, start, count)
        slices[f"{prefix}{expert}.up_proj.weight"] = one(0, start, count)
        slices[f"{prefix}{expert}.down_proj.weight"] = one(1, start, count)
    slices[f"{prefix}gate_up_proj"] = Slices(1, ((start, count), (inter + start, count)))  # stacked [E, 2I, H]
    slices[f"{prefix}down_proj"] = one(2, start, count)  # stacked [E, H, I]


def _shard_vocab(model: nn.Module, split: Split, slices: dict) -> None:
    """The token embedding and, untied, the LM head: vocab-parallel (tied: ``reset_buffers`` ties them again)."""
    stack, head = model.model, model.lm_head
    vocab, hidden = stack.embed_tokens.num_embeddings, stack.embed_tokens.embedding_dim
    start, count, padded = split.vocab(vocab)
    dtype = stack.embed_tokens.weight.dtype
    stack.embed_tokens = nn.Embedding(padded, hidden, dtype=dtype, _weight=torch.empty(padded, hidden, dtype=dtype))
    slices["model.embed_tokens.weight"] = one(0, start, count)
    model.lm_head = nn.Linear(hidden, padded, bias=False, dtype=head.weight.dtype)
    if not getattr(model, "tie_word_embeddings", False):
        slices["lm_head.weight"] = one(0, start, count)


def connect_model(model: nn.Module, comm, split: Split, vocab_size: int) -> nn.Module:
    """After loading: wrap the partial outputs with the communicator's collectives, keep each
    row-parallel bias on rank 0 only, zero the vocabulary padding. Returns the model."""
    start, count, padded = split.vocab(vocab_size)
    with torch.no_grad():
        for module in list(model.modules()):
            if isinstance(module, Attention):
                _bias_on_rank_0(module.o_proj, split)
                module.o_proj = ReducedOutput(module.o_proj, comm)
            if isinstance(module, GatedMLP):
                _bias_on_rank_0(module.down_proj, split)
            for name, child in list(module.named_children()):
                if isinstance(child, (GatedMLP, SparseMoeBlock)) and not isinstance(module, SparseMoeBlock):
                    setattr(module, name, ReducedMlp(child, comm))
        stack = model.model
        stack.embed_tokens.weight[count:].zero_()
        model.lm_head.weight[count:].zero_()
        stack.embed_tokens = VocabParallelEmbedding(stack.embed_tokens, start, count, comm)
        model.lm_head = GatheredLogits(model.lm_head, vocab_size, comm)
    return model


def _bias_on_rank_0(linear: nn.Linear, split: Split) -> None:
    """A row-parallel layer's partial outputs are summed: its bias is added by one rank."""
    if linear.bias is not None and split.rank != 0:
        linear.bias.zero_()
