"""The CUDA platform's batch-invariant mode: what it switches, what it refuses, that the default mode
is left as it was, and its MoE and top-k/top-p ops. The kernels' own properties: test_invariant_attention.py
and test_invariant_gemm.py; the engine on the GPU: benchmarks/invariant_gpu.sh."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from podium_cuda.platform import CUBLAS_WORKSPACE_ENV, CudaPlatform
from podium_plugin_api import ops as reference
from podium_plugin_api.moe import MoEExperts

pytest.importorskip("triton", reason="the CUDA platform's kernels need triton")


@pytest.fixture
def activated(monkeypatch):
    monkeypatch.setenv(CUBLAS_WORKSPACE_ENV, ":0:0")  # activate() sets it where unset: keep the process as it was

    def make(invariant: bool = False, fused_ops=None) -> CudaPlatform:
        platform = CudaPlatform()
        platform.activate({"tuning": {}, "fused_ops": fused_ops, "compile_log": False})
        if invariant:
            platform.use_batch_invariant_kernels()
        return platform

    return make


class TinyDecoder(nn.Module):
    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16, dtype=dtype)
        self.proj = nn.Linear(16, 16, dtype=dtype)
        self.lm_head = nn.Linear(16, 32, bias=False, dtype=dtype)
        self.lm_head.weight = self.embed.weight  # tied


def test_the_default_mode_is_unchanged(activated):
    from podium_cuda.attention import TritonAttentionBackend
    from podium_cuda.gemv import BatchOneLinear

    platform = activated()
    caps = platform.capabilities()
    assert caps.batch_invariant and caps.extra["batch_invariant"] == "available (--batch-invariant)"
    assert type(platform.attention_backend()) is TritonAttentionBackend
    assert tuple(platform.custom_ops()) == platform.tuning().fused_ops
    model = platform.prepare_model(TinyDecoder())
    assert type(model.proj) is BatchOneLinear and type(model.lm_head) is BatchOneLinear


def test_the_mode_switches_attention_ops_and_linears(activated):
    from podium_cuda.invariant_attention import InvariantAttentionBackend
    from podium_cuda.invariant_gemm import InvariantLinear
    from podium_cuda.invariant_mode import PER_ROW_OPS
    from podium_cuda.invariant_sampling import invariant_top_k_top_p
    from podium_cuda.moe import invariant_fused_moe

    platform = activated(invariant=True, fused_ops=())  # the fused_ops option does not apply in the mode
    assert platform.capabilities().extra["batch_invariant"] == "on"
    assert type(platform.attention_backend()) is InvariantAttentionBackend
    ops = platform.custom_ops()
    assert set(ops) == {*PER_ROW_OPS, "fused_moe", "top_k_top_p"}  # no batch-1 GEMV, no quantized linears
    assert ops["fused_moe"] is invariant_fused_moe and ops["top_k_top_p"] is invariant_top_k_top_p
    model = TinyDecoder()
    embedding = model.embed.weight
    model = platform.prepare_model(model)
    assert type(model.proj) is InvariantLinear and type(model.lm_head) is InvariantLinear
    assert model.lm_head.weight is embedding  # still tied
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]


def test_the_mode_refuses_quantized_weights_and_encoders(activated):
    platform = activated(invariant=True)
    quantized = TinyDecoder()
    quantized.proj.weight = nn.Parameter(quantized.proj.weight.to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ValueError, match="holds float8_e4m3fn tensors"):
        platform.prepare_model(quantized)
    encoder = TinyDecoder()
    encoder.uses_kv_cache = False
    with pytest.raises(ValueError, match="covers decoder models"):
        platform.prepare_model(encoder)


def test_rocm_does_not_offer_the_mode():
    from podium_rocm.platform import ROCM_BATCH_INVARIANT, RocmPlatform

    with pytest.raises(NotImplementedError, match="checked on NVIDIA GPUs"):
        RocmPlatform().use_batch_invariant_kernels()
    assert "not offered" in ROCM_BATCH_INVARIANT


@pytest.mark.cuda
def test_invariant_moe_rows_do_not_depend_on_the_batch(kernel_device):
    """Token 0 alone and first among 1-70 others (its assignments lead their experts' blocks, so even
    the interpreter's BLAS, which rounds by row place, sees it alike); the batch sizes cross
    ``moe_tiling``'s thresholds, where the default op changes tiles; against fused_moe's reference."""
    from podium_cuda.moe import invariant_fused_moe, moe_tiling

    gen = torch.Generator().manual_seed(7)
    experts = MoEExperts(8, 32, 48)
    experts.gate_up_proj.data = (torch.randn(8, 96, 32, generator=gen) / 32**0.5).to(kernel_device)
    experts.down_proj.data = (torch.randn(8, 32, 48, generator=gen) / 48**0.5).to(kernel_device)
    x = torch.randn(71, 32, generator=gen).to(kernel_device)
    weights, ids = _route(torch.randn(71, 8, generator=gen).to(kernel_device), 2)
    alone = invariant_fused_moe(x[:1], experts, weights[:1], ids[:1])
    assert len({moe_tiling(2 * n, 8) for n in (1, 9, 71)}) > 1  # the default would change tiles here
    for n in (2, 9, 71):
        assert torch.equal(invariant_fused_moe(x[:n], experts, weights[:n], ids[:n])[:1], alone), n
    want = reference.fused_moe(x.double(), _double(experts), weights.double(), ids)
    got = invariant_fused_moe(x, experts, weights, ids)
    assert (got.double() - want).norm() / want.norm() < 1e-5


def _route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _double(experts: MoEExperts) -> MoEExperts:
    copy = MoEExperts(experts.num_experts, experts.hidden_size, experts.intermediate_size)
    copy.gate_up_proj.data, copy.down_proj.data = experts.gate_up_proj.double(), experts.down_proj.double()
    return copy


def _nucleus_float64(logits: torch.Tensor, k: int, p: float) -> set[int]:
    """The tokens top-k / top-p keep, from exact float64 sums: the best k, then those whose mass
    strictly above them is below p (the best one always)."""
    order = logits.double().argsort(descending=True, stable=True)[:k]
    probs = torch.softmax(logits.double()[order], dim=0)
    above = torch.cumsum(probs, 0) - probs
    return {int(t) for t, a in zip(order, above) if a < p} | {int(order[0])}


def test_invariant_top_k_top_p_keeps_the_nucleus_and_ignores_the_batch():
    from podium_cuda.invariant_sampling import invariant_top_k_top_p

    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(40, 500, generator=gen) * 3
    top_k = torch.randint(0, 60, (40,), generator=gen)
    top_p = torch.rand(40, generator=gen) * 0.9 + 0.05
    top_p[::7] = 1.0  # off
    out = invariant_top_k_top_p(logits, top_k, top_p)
    for row in range(40):
        kept = {int(t) for t in torch.nonzero(out[row] > float("-inf"))}
        k = int(top_k[row]) if top_k[row] > 0 else 500
        assert kept == _nucleus_float64(logits[row], k, float(top_p[row]) if top_p[row] < 1 else 2.0), (seed, row)
        assert torch.equal(out[row][out[row] > float("-inf")], logits[row][out[row] > float("-inf")])
        alone = invariant_top_k_top_p(logits[row:row + 1], top_k[row:row + 1], top_p[row:row + 1])
        assert torch.equal(alone[0], out[row]), (seed, row)
