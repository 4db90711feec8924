"""A captured decode step replays exactly like eager after its static metadata tensors change.

The check lives in ``cuda_checks``: the ROCm platform runs the same one with its tuning.
"""

from __future__ import annotations

import pytest
from cuda_checks import check_decode_graph_replay

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("rotary", [False, True], ids=["forward", "forward_rotary"])
def test_decode_graph_replay_equals_eager(gpu, rotary):
    """forward_rotary: rotary, the cache write and attention in one kernel at decode."""
    from podium_cuda import CudaPlatform

    check_decode_graph_replay(CudaPlatform(), gpu, rotary=rotary)
