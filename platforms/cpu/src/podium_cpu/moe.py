"""The CPU platform's mixture-of-experts op: tokens grouped by expert, each expert on packed linears.

What was chosen and why. The contract's reference already groups the (token, k) assignments by
expert and runs one matmul pair per expert, which is the right shape of work on a CPU (each
expert's weights stream from memory once a step, whatever the batch). What it loses is the
per-call weight reorder: a bf16 ``x @ w.t()`` hands oneDNN a plain [out, in] weight which it
re-blocks on every call, a whole extra pass over the expert's weights (the dense linears measured
that at about a third of a decode step's matmul time; see ``linear_packing``). So at load
(``pack_experts``, from ``prepare_model``) every expert's two projections become the same packed
linears the dense layers get (``pack_linear_layers`` with the platform's rules, ``linear_choice``:
a native kernel or oneDNN's packed matmul per dtype), and the op runs gate|up on them and
SiLU-mul with the down projection through the platform's ``silu_and_mul_linear`` (one native call
where the linear is native). A grouped GEMM over all experts in one kernel, as on GPUs, would buy
nothing here: a CPU runs the experts one after another either way, and per-expert calls keep the
kernels the dense layers were tuned with. ``benchmarks/moe_cpu.py`` measures it against the reference.

The packed copies sit beside the stacked parameters (``cpu_experts`` on the ``MoEExperts`` module),
as the dense layers' packed weights do; results match the reference to within bf16 rounding
(float32: the same sums in another order), checked in ``tests/test_cpu_moe.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from podium_plugin_api import ops as reference
from podium_plugin_api.moe import MoEExperts, expert_groups

PACKED_ATTRIBUTE = "cpu_experts"


class PackedExperts(nn.Module):
    """Each expert's gate|up [2I, H] and down [H, I] projections as the platform's packed linears."""

    def __init__(self, experts: MoEExperts, pack: Callable[[nn.Module], int]) -> None:
        super().__init__()
        self.dtype = experts.gate_up_proj.dtype
        self.gate_up = nn.ModuleList(_linear(w) for w in experts.gate_up_proj.detach())
        self.down = nn.ModuleList(_linear(w) for w in experts.down_proj.detach())
        self.packed = pack(self) == 2 * experts.num_experts  # every expert got a packed linear


def _linear(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear over ``weight`` [out, in] (a view of the stacked parameter: no copy)."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def pack_experts(model: nn.Module, pack: Callable[[nn.Module], int]) -> int:
    """Give every CPU ``MoEExperts`` in ``model`` its packed linears; returns how many were packed.

    ``pack`` replaces the ``nn.Linear`` children of a module (the platform's ``pack_linear_layers``
    with its rules bound) and returns how many it replaced. Modules whose dtype nothing packs keep
    the reference path."""
    count = 0
    for module in model.modules():
        if isinstance(module, MoEExperts) and module.gate_up_proj.device.type == "cpu":
            packed = PackedExperts(module, pack)
            if packed.packed:
                object.__setattr__(module, PACKED_ATTRIBUTE, packed)  # not a submodule: state_dict unchanged
                count += 1
    return count


def fused_moe(silu_and_mul_linear: Callable, x: torch.Tensor, experts: MoEExperts, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The contract's ``fused_moe`` on packed experts (module docstring); the reference elsewhere.

    ``silu_and_mul_linear`` is the platform's op of that name (bound by ``cpu_ops``)."""
    packed: PackedExperts | None = getattr(experts, PACKED_ATTRIBUTE, None)
    if packed is None or x.dtype != packed.dtype or x.dim() != 2 or not x.is_cpu:
        return reference.fused_moe(x, experts, topk_weights, topk_ids)
    k = topk_ids.shape[1]
    order, counts = expert_groups(topk_ids, experts.num_experts)
    weights = topk_weights.reshape(-1).float()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)  # [T, H]
    x = x.contiguous()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        chosen = order[start:start + count]  # flat (token, k) indices routed to this expert
        rows = chosen // k
        gate_up = packed.gate_up[expert](x.index_select(0, rows))  # [n, 2I]
        hidden = silu_and_mul_linear(gate_up, packed.down[expert])  # [n, H]
        out.index_add_(0, rows, hidden.float() * weights[chosen, None])
        start += count
    return out.to(x.dtype)
