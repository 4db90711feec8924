"""The CPU platform's batch-invariant mode: what it switches, what it refuses, and that the default
mode is left as it was. The end-to-end property (SmolLM2 in bf16) is tests/test_batch_invariant.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from podium_cpu import CpuPlatform
from podium_cpu.attention_plan import EVERY_TOKEN_ALONE, TILE_MIN_QUERY, build_plan
from podium_cpu.linear_choice import linear_rules
from podium_cpu.native_kernels import load_kernels
from podium_plugin_api import AttentionMetadata
from podium_plugin_api import ops as reference

KERNELS, WHY = load_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason=f"native kernels did not build: {WHY}")


def activated(attention: str = "auto", invariant: bool = False) -> CpuPlatform:
    platform = CpuPlatform()
    platform.activate({"attention": attention, "kv_cache_commit": False, "linears": "auto", "amx": True, "amx_plain_weights": False})
    if invariant:
        platform.use_batch_invariant_kernels()
    return platform


def test_the_default_mode_is_unchanged():
    """Without the mode: the same linear rules as before it existed, prefill chunks tiled."""
    platform = activated()
    assert platform.linear_rules() == linear_rules(*load_kernels())
    assert platform.attention_backend().tile_min_query == TILE_MIN_QUERY == 2
    assert platform.capabilities().extra["batch_invariant"] != "on"


@needs_kernels
def test_the_mode_runs_one_native_kernel_for_every_batch():
    platform = activated(invariant=True)
    caps = platform.capabilities()
    assert caps.batch_invariant and caps.extra["batch_invariant"] == "on"
    rules = platform.linear_rules()
    assert torch.bfloat16 in rules and torch.float32 in rules
    for dtype, rule in rules.items():
        assert rule.native is not None and rule.native.max_rows is None, dtype
        for rows in (1, 255, 257, 4096):  # AMX used to hand over to oneDNN above 256 rows
            assert platform.linear_kernel(dtype, 576, 1536, rows).native, (dtype, rows)
    assert platform.attention_backend().tile_min_query == EVERY_TOKEN_ALONE


@needs_kernels
def test_the_mode_refuses_a_dtype_without_a_native_linear():
    platform = activated(invariant=True)
    model = nn.Sequential(nn.Linear(8, 8)).half()
    with pytest.raises(ValueError, match="no native linear for float16"):
        platform.prepare_model(model)


@pytest.mark.parametrize("attention", ["torch", "ipex"])
def test_the_mode_refuses_another_attention_with_the_reason(attention):
    platform = activated(attention) if attention == "torch" else CpuPlatform()
    if attention == "ipex":
        platform._attention = "ipex"  # activate() would load IPEX; the refusal is decided before that
    assert not platform.capabilities().batch_invariant
    assert "attention option is" in platform.capabilities().extra["batch_invariant"]
    with pytest.raises(NotImplementedError, match="prefill and decode paths reduce in different orders"):
        platform.use_batch_invariant_kernels()


def test_every_prompt_token_goes_the_decode_way_in_the_mode():
    """The plan: with EVERY_TOKEN_ALONE a 5-token prefill chunk after 3 cached tokens is five tokens at
    positions 3..7, exactly what five decodes would be; by default it is one tiled chunk."""
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 5, 6]), seq_lens=torch.tensor([8, 4]), slot_mapping=torch.arange(6),
        block_tables=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), max_query_len=5, max_seq_len=8,
        query_lens_host=[5, 1], seq_lens_host=[8, 4])
    tiled = build_plan(meta, block_size=4)
    assert [c.index for c in tiled.chunks] == [0] and tiled.decode_seqs == [1]
    alone = build_plan(meta, block_size=4, tile_min_query=EVERY_TOKEN_ALONE)
    assert alone.chunks == [] and alone.decode_seqs == [0, 1]
    assert alone.tokens.tolist() == [0, 1, 2, 3, 4, 5]
    assert alone.token_positions.tolist() == [3, 4, 5, 6, 7, 3]
    assert alone.token_seqs.tolist() == [0, 0, 0, 0, 0, 1]


def test_top_k_keeps_the_same_tied_tokens_alone_and_among_rows_without_one():
    """bf16 logits tie often. The default op's pre-filter (taken when every row has a top-k) ranks
    ties by a partial sort, the reference by a full sort, so a row alone (pre-filter) and beside a
    row without top-k (reference) may keep different tokens at its k-th rank. The mode's op table
    has no pre-filter: the same tokens either way."""
    logits = (torch.randn(2, 4096, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16().float()
    top_k, top_p = torch.tensor([40, 0]), torch.tensor([1.0, 1.0])

    def kept(ops, rows):
        top_k_top_p = ops.get("top_k_top_p", reference.top_k_top_p)
        return top_k_top_p(logits[:rows], top_k[:rows], top_p[:rows])[0] > float("-inf")

    default, invariant = activated().custom_ops(), activated(invariant=True).custom_ops()
    assert "top_k_top_p" in default and "top_k_top_p" not in invariant
    assert not torch.equal(kept(default, 1), kept(default, 2))  # what the mode removes, on these logits
    assert torch.equal(kept(invariant, 1), kept(invariant, 2))
