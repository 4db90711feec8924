"""Per-linear cuBLAS / cuBLASLt choice: the choice logic with a scripted timer (any machine), the
real timing and graph capture on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from podium_cuda.blas_choice import (
    MIN_GAIN,
    ROW_CLASSES,
    BlasChoiceLinear,
    choose_blas_libraries,
    lt_classes_for,
    row_class,
)


def test_row_classes_split_at_geometric_midpoints():
    assert [row_class(r) for r in (0, 1, 15, 16, 255, 256, 1447, 1448, 8192, 10**6)] == \
        [1, 1, 1, 256, 256, 256, 256, 8192, 8192, 8192]


def scripted_timer(lt_wins: dict[tuple[int, int], float], calls: list):
    """cuBLAS takes 1.0 ms everywhere; cuBLASLt takes lt_wins[(out, rows)] (default 1.0)."""

    def timer(linear: nn.Linear, rows: int, library: str) -> float:
        calls.append((linear.out_features, linear.in_features, rows, library))
        return lt_wins.get((linear.out_features, rows), 1.0) if library == "cublaslt" else 1.0

    return timer


def test_cublaslt_only_where_it_wins_by_the_margin():
    calls: list = []
    linear = nn.Linear(64, 96, dtype=torch.bfloat16)
    timer = scripted_timer({(96, 1): 0.5, (96, 256): 1 - MIN_GAIN / 2, (96, 8192): 0.9}, calls)
    assert lt_classes_for(linear, timer) == frozenset({1, 8192})  # 256: within the margin, stays on cuBLAS
    assert len(calls) == 2 * len(ROW_CLASSES)


def test_huge_outputs_are_not_timed():
    head = nn.Linear(8, 128256, dtype=torch.bfloat16, device="meta")  # 8192 rows -> 2 GB of logits
    calls: list = []
    assert lt_classes_for(head, scripted_timer({(128256, 8192): 0.1}, calls)) == frozenset()
    assert {rows for _, _, rows, _ in calls} == {1, 256}


def test_model_linears_wrapped_per_shape_sharing_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32, bias=False), nn.ReLU(),
                          nn.Linear(32, 48), nn.Linear(48, 16)).to(torch.bfloat16)
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    expected = model(x)
    calls: list = []
    choices = choose_blas_libraries(model, scripted_timer({(48, 1): 0.5, (16, 256): 0.5}, calls), device_type="cpu")
    # shapes (48, 32, bias) x2, (32, 48, no bias), (16, 48, bias): each timed once per class and library
    assert len(choices) == 3 and len(calls) == 3 * 2 * len(ROW_CLASSES)
    assert isinstance(model[0], BlasChoiceLinear) and isinstance(model[4], BlasChoiceLinear)
    assert isinstance(model[5], BlasChoiceLinear) and type(model[2]) is nn.Linear
    assert model[0].lt_classes == frozenset({1}) and model[5].lt_classes == frozenset({256})
    assert all(a is b for a, b in zip([m.weight for m in model if hasattr(m, "weight")], weights))
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # off the GPU the choice is moot
    assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublas  # restored after calls


def test_float32_linears_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8))
    calls: list = []
    assert choose_blas_libraries(model, scripted_timer({}, calls), device_type="cpu") == {}
    assert calls == [] and type(model[0]) is nn.Linear


@pytest.mark.cuda
def test_on_the_gpu_outputs_match_eager_and_graph_replay(kernel_device):
    if kernel_device != "cuda":
        pytest.skip("times cuBLAS on a GPU")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 1024, bias=False)).cuda().to(torch.bfloat16)
    x = {rows: torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16) for rows in (1, 200, 2048)}
    expected = {rows: model(v) for rows, v in x.items()}
    # force cuBLASLt everywhere so the wrapped path is what runs, whatever the device's timings say
    choose_blas_libraries(model, timer=lambda linear, rows, lib: 0.5 if lib == "cublaslt" else 1.0)
    assert all(isinstance(m, BlasChoiceLinear) for m in model)
    for rows, v in x.items():
        torch.testing.assert_close(model(v), expected[rows], rtol=2e-2, atol=2e-2)
    static = x[200].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(static)
    static.copy_(x[200] * 0.5)
    graph.replay()
    torch.testing.assert_close(out, model(x[200] * 0.5), rtol=0, atol=0)
    choices = choose_blas_libraries(nn.Sequential(nn.Linear(1024, 4096)).cuda().to(torch.bfloat16))
    assert set(choices) == {(4096, 1024, torch.bfloat16, True)}  # the real timer ran on each class
