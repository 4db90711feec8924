"""A replayed decode step's inputs in one region: the layout's slices, the host fill, the buffer ring."""

from __future__ import annotations

import numpy as np
import torch

from podium.runner.staging import FIELDS, StagingRing, StepLayout, fill_host


def test_layout_slices_are_disjoint_typed_views_of_one_region():
    layout = StepLayout(size=5, max_blocks=3)
    region = torch.zeros(layout.numel, dtype=torch.long)
    views = layout.views(region)
    assert [views[name].shape for name in FIELDS] == [(5,)] * len(FIELDS)
    assert views["seq_lens"].dtype == torch.int32 and views["seq_lens"].shape == (5,)
    assert views["table"].dtype == torch.int32 and views["table"].numel() >= 5 * 3
    for i, name in enumerate(FIELDS):  # each slice writes its own elements of the region only
        views[name].fill_(i + 1)
    views["seq_lens"].fill_(-7)
    views["table"].fill_(9)
    assert region[:5 * len(FIELDS)].tolist() == [v for i in range(len(FIELDS)) for v in [i + 1] * 5]
    assert views["seq_lens"].tolist() == [-7] * 5 and set(views["table"].tolist()) == {9}


def test_fill_host_writes_the_step_and_pads_the_rest():
    layout = StepLayout(size=4, max_blocks=3)
    host = torch.full((layout.numel,), 123, dtype=torch.long)
    table = np.array([[5, 6], [7, 8]], dtype=np.int32)  # 2 rows, width 2
    fill_host(layout, host, [11, -1], np.array([3, 17]), np.array([40, 81]), np.array([4, 18]), table,
              fill=([1], [0]))
    v = layout.views(host)
    assert v["input_ids"].tolist() == [11, -1, 0, 0]
    assert v["positions"].tolist() == [3, 17, 0, 0]
    assert v["slot_mapping"].tolist() == [40, 81, -1, -1]  # padded rows write nowhere
    assert v["seq_lens"].tolist() == [4, 18, 1, 1]
    assert v["fill_dst"][:1].tolist() == [1] and v["fill_src"][:1].tolist() == [0]
    assert v["table"][:4].tolist() == [5, 6, 7, 8]  # [rows, width], packed
    assert layout.used(2, 2) == layout.table_at + 2 and layout.used(2, 3) == layout.table_at + 3


def test_ring_hands_out_buffers_in_turn_and_grows():
    ring = StagingRing(torch.device("cpu"), pin=False)
    a, first = ring.take(10)
    b, second = ring.take(10)
    c, third = ring.take(5000)
    assert (a, b, c) == (0, 1, 0) and first.data_ptr() != second.data_ptr()
    assert third.numel() >= 5000 and third.dtype == torch.int64
    region = torch.zeros(5000, dtype=torch.long)
    third[:5000] = torch.arange(5000)
    ring.copy(c, region, 3000)
    assert region[:3000].tolist() == list(range(3000)) and not region[3000:].any()
