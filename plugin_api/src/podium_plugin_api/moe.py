"""Mixture-of-experts in the contract: the expert weights a ``fused_moe`` op reads, and its reference.

A sparse MoE layer routes each token to ``K`` of ``E`` experts; every expert is a gated MLP. The
core computes the routing (``topk_ids`` [T, K], ``topk_weights`` [T, K]) and calls the op table's
``fused_moe(x, experts, topk_weights, topk_ids)``; a platform overrides that op with its kernel.

Expert weights, stacked so that one tensor holds every expert (the layout transformers 5 keeps in
memory, and the one grouped GEMM kernels read)::

    gate_up_proj  [E, 2I, H]   rows 0..I-1 of expert e: its gate projection, rows I..2I-1: its up
    down_proj     [E, H, I]

Parallelism plugs in from outside without changing the layout. Tensor parallelism shards every
expert by its intermediate size: rank r of n keeps rows ``[r*I/n, (r+1)*I/n)`` of the gate half and
the same rows of the up half of ``gate_up_proj`` (-> [E, 2I/n, H]) and those columns of ``down_proj``
(-> [E, H, I/n]); each rank's op output is a partial sum, all-reduced after the layer, like a
row-parallel linear. Expert parallelism keeps a subset of experts per rank: the routing maps ids
of experts held elsewhere to -1, which the op skips (their share arrives with the all-reduce).
"""

from __future__ import annotations

import torch
from torch import nn


class MoEExperts(nn.Module):
    """The stacked weights of ``num_experts`` gated-SiLU experts (module docstring for the layout).

    Passed as a module, not as two tensors, so a platform's ``prepare_model`` can keep its own form
    of the weights beside them (packed per expert, say) and find it again in its ``fused_moe``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size)):
            if int(value) < 1:
                raise ValueError(f"MoEExperts.{name} must be >= 1, got {value}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"


def expert_groups(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(order [T*K], counts [E]): the flat (token, k) assignments sorted by expert (stable, so each
    expert's tokens keep their order) and how many each expert got. Ids < 0 sort last, uncounted."""
    flat = topk_ids.reshape(-1).long()
    keyed = torch.where(flat < 0, num_experts, flat)
    order = torch.argsort(keyed, stable=True)
    counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts]
    return order, counts.tolist()


def fused_moe(
    x: torch.Tensor, experts: MoEExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H], experts (MoEExperts), topk_weights [T, K], topk_ids int [T, K] -> [T, H] in x's dtype.

    Row t is the sum over k of ``topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
    ``e = topk_ids[t, k]``; ids < 0 are skipped. The reference groups the (token, k) assignments by
    expert and runs each expert once over its tokens, summing in float32.
    """
    k = topk_ids.shape[1]
    order, counts = expert_groups(topk_ids, experts.num_experts)
    acc = torch.promote_types(x.dtype, torch.float32)  # float32 sums (float64 for a float64 reference)
    weights = topk_weights.reshape(-1).to(acc)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=acc, device=x.device)  # [T, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        chosen = order[start:start + count]  # flat (token, k) indices routed to this expert
        rows = chosen // k
        gate_up = x.index_select(0, rows) @ experts.gate_up_proj[expert].t()  # [n, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = (torch.nn.functional.silu(gate) * up) @ experts.down_proj[expert].t()  # [n, H]
        out.index_add_(0, rows, hidden.to(acc) * weights[chosen, None])
        start += count
    return out.to(x.dtype)
