"""The Triton SGMV LoRA kernels against the contract's pure-torch reference (``podium_plugin_api.lora``).

Mixed steps (rows of several slots, rows without one, an unused slot, an unused slot between used
ones: a block of rows meets several slots), one slot for every row, no adapter at all, inner sizes
of one and three slices, split-K and not, the host's row extent known (an eager step) and not (a
captured graph's mapping), and a CUDA graph replayed for a new mix of slots; the same for the fused
shrink-and-expand (one launch), under each decode tiling the benchmark times. Under
``TRITON_INTERPRET=1`` (no GPU) the sizes stay small and float32 only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from podium_plugin_api.lora import lora_expand as reference_expand
from podium_plugin_api.lora import lora_mapping
from podium_plugin_api.lora import lora_shrink as reference_shrink

pytestmark = pytest.mark.cuda

NUM_SLOTS = 4


def slot_mixes(rows: int, gen: torch.Generator) -> dict[str, list[int]]:
    mixed = torch.randint(-1, NUM_SLOTS - 1, (rows,), generator=gen).tolist()  # slot 3 unused
    mixed[0] = 0
    gap = [(-1, 0, 2)[i] for i in torch.randint(0, 3, (rows,), generator=gen).tolist()]  # slot 1 between used ones
    gap[-1] = 2
    return {"mixed": mixed, "gap": gap, "one-slot": [2] * rows, "none": [-1] * rows}


def sizes(device: str) -> list[tuple[int, int, int]]:
    """(rows, K, N): decode-like and prefill-like, K past one split and N past one tile."""
    if device == "cpu":
        return [(1, 64, 48), (13, 96, 80), (40, 320, 40), (5, 1024, 40)]  # the last one splits K
    return [(1, 4096, 6144), (256, 4096, 6144), (256, 14336, 4096), (2048, 4096, 28672)]


def weights(slots: int, inner: int, k: int, n: int, device: str, dtype, gen):
    lora_a = torch.randn(slots, inner, k, generator=gen) / k**0.5
    lora_b = torch.randn(slots, n, inner, generator=gen) / inner**0.5
    return lora_a.to(device=device, dtype=dtype), lora_b.to(device=device, dtype=dtype)


def mappings(slots: list[int], device: str):
    """The eager mapping (the host's row extent) and a graph's (no extent: every row)."""
    eager = lora_mapping(slots, NUM_SLOTS, device)
    return {"eager": eager, "graph": dataclasses.replace(eager, max_slot_rows=None, num_slotted_rows=None)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner", [16, 48])
def test_shrink_and_expand_equal_the_reference(kernel_device, check_dtype, dtype, inner):
    from podium_cuda.lora import lora_expand, lora_shrink

    check_dtype(dtype)
    gen = torch.Generator().manual_seed(inner)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for rows, k, n in sizes(kernel_device):
        lora_a, lora_b = weights(NUM_SLOTS, inner, k, n, kernel_device, dtype, gen)
        x = torch.randn(rows, k, generator=gen).to(device=kernel_device, dtype=dtype)
        y = torch.randn(rows, n, generator=gen).to(device=kernel_device, dtype=dtype)
        for mix, slots in slot_mixes(rows, gen).items():
            for kind, mapping in mappings(slots, kernel_device).items():
                what = f"{rows} rows, K={k}, N={n}, {mix}, {kind}"
                used = torch.tensor(slots, device=kernel_device) >= 0
                got = lora_shrink(x, lora_a, mapping)
                want = reference_shrink(x.double(), lora_a.double(), mapping)
                assert got.dtype == torch.float32 and got.shape == (rows, inner)
                scale = float(want.abs().max()) or 1.0
                error = float((got.double() - want)[used].abs().max() / scale) if used.any() else 0.0
                assert error < tolerance, f"shrink, {what}: relative error {error}"
                shrunk = want.float()
                out = lora_expand(y.clone(), shrunk, lora_b, mapping)
                expected = reference_expand(y.double(), shrunk.double(), lora_b.double(), mapping)
                error = float((out.double() - expected).abs().max() / expected.abs().max())
                assert error < tolerance, f"expand, {what}: relative error {error}"
                assert torch.equal(out[~used], y[~used]), f"expand, {what}: a row without a slot changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner", [16, 48])
def test_fused_shrink_expand_equals_the_reference(kernel_device, check_dtype, dtype, inner):
    """One launch whose expand pieces wait for their rows' shrink pieces: the reference's sums, rows
    without a slot untouched, for the decode tilings and the prefill one."""
    import podium_cuda.lora as kernels

    check_dtype(dtype)
    gen = torch.Generator().manual_seed(100 + inner)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    # the tiling the engine would take for the rows, and in bf16 (the engine's) the decode ones the
    # benchmark times too (each tiling and split of K compiles anew: the GPU step's time stays short)
    others = [kernels.LoRATiling(16, 64, 64, 4), kernels.LoRATiling(32, 128, 64, 4)] if dtype == torch.bfloat16 else []
    for rows, k, n in sizes(kernel_device):
        lora_a, lora_b = weights(NUM_SLOTS, inner, k, n, kernel_device, dtype, gen)
        x = torch.randn(rows, k, generator=gen).to(device=kernel_device, dtype=dtype)
        y = torch.randn(rows, n, generator=gen).to(device=kernel_device, dtype=dtype)
        for mix, slots in slot_mixes(rows, gen).items():
            for kind, mapping in mappings(slots, kernel_device).items():
                used = torch.tensor(slots, device=kernel_device) >= 0
                expected = reference_expand(y.double(), reference_shrink(x.double(), lora_a.double(), mapping),
                                            lora_b.double(), mapping)
                tilings = [kernels.PREFILL] if rows > 256 else [kernels.DECODE, *others]
                if kernel_device == "cpu" and rows < 40:  # the interpreter: the prefill tiling on few rows too
                    tilings.append(kernels.PREFILL)
                for tiling in tilings:
                    what = f"{rows} rows, K={k}, N={n}, {mix}, {kind}, {tiling}"
                    out = kernels.lora_shrink_expand(y.clone(), x, lora_a, lora_b, mapping, tiling)
                    error = float((out.double() - expected).abs().max() / expected.abs().max())
                    assert error < tolerance, f"fused, {what}: relative error {error}"
                    assert torch.equal(out[~used], y[~used]), f"fused, {what}: a row without a slot changed"


def test_fused_shrink_expand_rejects_mismatched_shapes(kernel_device):
    from podium_cuda.lora import lora_shrink_expand

    lora_a, lora_b = weights(NUM_SLOTS, 16, 64, 48, kernel_device, torch.float32, torch.Generator().manual_seed(0))
    mapping = lora_mapping([0, 1, -1], NUM_SLOTS, kernel_device)
    x, y = torch.zeros(3, 64, device=kernel_device), torch.zeros(3, 48, device=kernel_device)
    with pytest.raises(ValueError, match="disagree"):
        lora_shrink_expand(y, x, lora_a, lora_b[:, :, :8], mapping)
    with pytest.raises(ValueError, match="3 rows, the input 2"):
        lora_shrink_expand(y, x[:2], lora_a, lora_b, mapping)


def test_few_rows_over_a_long_k_split_it():
    """A decode step's rows over K = 1024 leave most programs idle unless K is split (atomics path)."""
    from podium_cuda.lora import _split_k

    assert _split_k(programs=4, k=1024, block_k=64) == 4
    assert _split_k(programs=4, k=14336, block_k=64) == 32
    assert _split_k(programs=512, k=4096, block_k=64) == 1
    assert _split_k(programs=32, k=14336, block_k=64) == 9  # a prefill's 2048 rows in blocks of 64
    assert _split_k(programs=32, k=14336, block_k=64, target=1056) == 32


@pytest.mark.parametrize("fused", [False, True])
def test_a_captured_graph_replays_any_mix_of_slots(gpu, fused):
    """The graph's launches depend on no host value: refill the mapping's memory, replay, get the new mix
    (the fused launch's scratch, its tickets included, zeroed again by each replay)."""
    from podium_cuda.lora import lora_expand, lora_shrink, lora_shrink_expand

    gen = torch.Generator().manual_seed(0)
    rows, k, n, inner = 64, 1024, 512, 16
    lora_a, lora_b = weights(NUM_SLOTS, inner, k, n, gpu, torch.bfloat16, gen)
    x = torch.randn(rows, k, generator=gen).to(gpu, torch.bfloat16)
    y = torch.randn(rows, n, generator=gen).to(gpu, torch.bfloat16)
    first = mappings([-1] * rows, gpu)["graph"]
    static = dataclasses.replace(first, token_slots=first.token_slots.clone(), sorted_rows=first.sorted_rows.clone(),
                                 slot_starts=first.slot_starts.clone())

    def step():
        out = y.clone()
        if fused:
            return lora_shrink_expand(out, x, lora_a, lora_b, static)
        return lora_expand(out, lora_shrink(x, lora_a, static), lora_b, static)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    for seed in range(3):
        slots = slot_mixes(rows, torch.Generator().manual_seed(seed))["mixed"]
        fresh = lora_mapping(slots, NUM_SLOTS, gpu)
        for field in ("token_slots", "sorted_rows", "slot_starts"):
            getattr(static, field).copy_(getattr(fresh, field))
        graph.replay()
        want = reference_expand(y.double(), reference_shrink(x.double(), lora_a.double(), fresh), lora_b.double(), fresh)
        error = float((result.double() - want).abs().max() / want.abs().max())
        assert error < 3e-2, f"replay {seed}: relative error {error}"
