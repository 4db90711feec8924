"""The batched LoRA ops of the contract (``podium_plugin_api.lora``), the kit's check of overrides, and
the bookkeeping around them: the row -> slot mapping, the step state the layers read (eager, padded,
a captured graph's fixed region), and the scheduler's slot table (exact slots, eviction order, loads).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from podium.lora.layers import LoRAState
from podium.lora.request import AdapterRef
from podium.lora.slots import SlotTable
from podium.request import Sequence
from podium.sampling_params import SamplingParams
from podium_plugin_api.lora import lora_expand, lora_mapping, lora_shrink, mapping_arrays
from podium_plugin_api.testing.op_checks import check_op
from podium_plugin_api.testing.report import ConformanceError


def per_row(x, lora_a, lora_b, slots) -> torch.Tensor:
    """y's delta row by row in float64: the definition, with no grouping."""
    out = torch.zeros(x.shape[0], lora_b.shape[1], dtype=torch.float64)
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[t] = lora_b[slot].double() @ (lora_a[slot].double() @ x[t].double())
    return out


@pytest.mark.parametrize("slots", [[0], [2, -1, 0, 2, 1, -1, 0], [-1, -1], [1] * 9])
def test_shrink_then_expand_is_each_rows_own_delta(slots):
    gen = torch.Generator().manual_seed(len(slots))
    x, y = torch.randn(len(slots), 24, generator=gen), torch.randn(len(slots), 10, generator=gen)
    lora_a, lora_b = torch.randn(3, 8, 24, generator=gen), torch.randn(3, 10, 8, generator=gen)
    mapping = lora_mapping(slots, 3)
    got = lora_expand(y.clone(), lora_shrink(x, lora_a, mapping), lora_b, mapping)
    want = y.double() + per_row(x, lora_a, lora_b, slots)
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_mapping_groups_rows_by_slot_in_row_order():
    order, starts, most = mapping_arrays(np.array([2, -1, 0, 2, -1, 0, 0]), 4)
    assert order.tolist() == [2, 5, 6, 0, 3, 1, 4]  # slot 0's rows, slot 2's, then the rows without one
    assert starts.tolist() == [0, 3, 3, 5, 5] and most == 3
    with pytest.raises(ValueError, match=r"token slots must be in \[-1, 4\)"):
        mapping_arrays(np.array([0, 4]), 4)


def test_the_kit_accepts_the_reference_and_catches_wrong_overrides():
    for name, fn in (("lora_shrink", lora_shrink), ("lora_expand", lora_expand)):
        for dtype in (torch.float32, torch.bfloat16):
            check_op(name, fn, dtype, torch.device("cpu"), "test")

    def one_slot_for_all(x, lora_a, mapping):  # ignores which slot a row has
        return (x.float() @ lora_a[0].float().t())

    def skips_last_slot_rows(y, shrunk, lora_b, mapping):  # forgets one group
        starts = mapping.slot_starts.tolist()
        for slot in range(mapping.num_slots - 2):
            rows = mapping.sorted_rows[starts[slot]:starts[slot + 1]].long()
            y[rows] += (shrunk[rows] @ lora_b[slot].float().t()).to(y.dtype)
        return y

    for name, fn in (("lora_shrink", one_slot_for_all), ("lora_expand", skips_last_slot_rows)):
        with pytest.raises(ConformanceError, match=f"custom op {name}"):
            check_op(name, fn, torch.float32, torch.device("cpu"), "test")


def test_state_stages_eager_padded_and_graph_mappings():
    state = LoRAState(num_slots=2, device=torch.device("cpu"))
    assert state.mapping_for(5) is None  # nothing staged: no delta
    state.stage(np.array([1, -1, 1], dtype=np.int32), None)
    eager = state.mapping_for(3)
    assert eager.token_slots.tolist() == [1, -1, 1] and eager.slot_starts.tolist() == [0, 0, 2]
    assert eager.max_slot_rows == 2 and eager.num_slotted_rows == 2
    padded = state.mapping_for(5)  # a platform's shaping padded the rows: the extra ones have no slot
    assert padded.token_slots.tolist() == [1, -1, 1, -1, -1] and padded.sorted_rows.tolist()[3:] == [3, 4]
    state.reserve_graphs(4)
    state.capturing = True
    graph = state.mapping_for(2)  # views of the region: what a captured graph reads
    state.capturing = False
    state.stage(np.array([0, 1], dtype=np.int32), graph_rows=2)
    assert state.current is None
    assert graph.token_slots.tolist() == [0, 1] and graph.slot_starts.tolist() == [0, 1, 2]
    assert graph.max_slot_rows is None and graph.num_slotted_rows is None
    state.stage(None, graph_rows=2)  # a step without adapters replays the same graph: its rows say so
    assert graph.token_slots.tolist() == [-1, -1] and graph.slot_starts.tolist() == [0, 0, 0]


def seq(i: int, ref: AdapterRef | None) -> Sequence:
    return Sequence(i, f"r{i}", 0, [1, 2], SamplingParams(), lora=ref)


def test_slot_table_assigns_free_slots_then_the_longest_idle_one():
    a, b, c = (AdapterRef(k, n, k, f"/{n}", 8) for k, n in ((1, "a"), (2, "b"), (3, "c")))
    table = SlotTable(2)
    s1, s2, s3, s4 = seq(1, a), seq(2, b), seq(3, c), seq(4, a)
    assert table.acquire(s1) and table.acquire(s2) and (s1.lora_slot, s2.lora_slot) == (0, 1)
    assert table.take_loads() == [(0, a), (1, b)] and table.take_loads() == []
    assert not table.acquire(s3) and s3.lora_slot == -1  # both slots used by running sequences
    assert table.acquire(s4) and s4.lora_slot == 0 and table.take_loads() == []  # a's slot, no load
    assert table.acquire(seq(9, None))  # the base model needs no slot
    table.release(s2)  # b idle in slot 1
    table.release(s1)
    table.release(s4)  # a idle in slot 0, after b
    assert table.acquire(s3) and s3.lora_slot == 1 and table.take_loads() == [(1, c)]  # b idled first
    assert table.holder(0) == a and table.num_users == 1
    table.reset()
    assert table.num_users == 0 and table.holder(0) is None
