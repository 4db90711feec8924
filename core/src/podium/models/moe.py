"""Sparse mixture-of-experts layers: a top-k softmax router, stacked experts, an optional shared expert.

    router logits [T, E] = gate(x)
    probs = softmax(logits) in float32; top-k of them per token (renormalised to sum 1 where the
            model does: Mixtral always, Qwen-MoE by ``norm_topk_prob``)
    out [T, H] = fused_moe(x, experts, weights, ids)                  (the op table's, per platform)
               + sigmoid(shared_expert_gate(x)) * shared_expert(x)    (Qwen2-MoE only)

The experts are ``podium_plugin_api.moe.MoEExperts``: stacked ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I], the layout transformers 5 keeps in memory and saves in newer checkpoints;
per-expert checkpoint tensors (``experts.N.gate_proj.weight`` ...) are copied into their slices.
That module docstring says how tensor and expert parallelism shard them. The routing weights
stay float32 into the op (transformers rounds Qwen-MoE's to the model dtype first).
"""

from __future__ import annotations

import torch
from torch import nn

from podium_plugin_api.moe import MoEExperts

from .layers import GatedMLP, Ops, RMSNorm


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, K], expert ids int64 [T, K]): softmax, then top-k."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(MoEExperts):
    """Stacked experts computed by the op table's ``fused_moe``; reads per-expert checkpoint names."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops: Ops) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.fused_moe = ops["fused_moe"]

    def checkpoint_pieces(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``N.gate_proj.weight`` / ``N.up_proj.weight`` -> halves of expert N's ``gate_up_proj``;
        ``N.down_proj.weight`` -> expert N's ``down_proj`` (see ``weights``)."""
        size = self.intermediate_size
        pieces = {}
        for expert in range(self.num_experts):
            pieces[f"{expert}.gate_proj.weight"] = ("gate_up_proj", (expert, 0, size))
            pieces[f"{expert}.up_proj.weight"] = ("gate_up_proj", (expert, size, size))
            pieces[f"{expert}.down_proj.weight"] = ("down_proj", (expert,))
        return pieces

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.fused_moe(x, self, weights, ids)  # [T, H]


class SparseMoeBlock(nn.Module):
    """Router + experts (+ a gated shared expert). Parameter names follow transformers' ``mlp.*``."""

    def __init__(self, hidden_size: int, ops: Ops, *, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, ops)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, False, ops)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)  # [T, K] each
        out = self.experts(x, weights, ids)  # [T, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def forward_normed(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None):
        """(self(norm(hidden + residual)), hidden + residual): the decoder layer's MLP half."""
        if residual is None:
            return self(norm(hidden)), hidden
        normed, residual = norm(hidden, residual)
        return self(normed), residual
