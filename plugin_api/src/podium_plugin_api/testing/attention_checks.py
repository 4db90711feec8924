"""Attention conformance: the backend against the reference, and graph replay against eager.

``check_attention`` runs one step of a random ragged batch through ``backend.forward`` (write
the new K/V, then attend) and compares it with ``reference_paged_attention`` in float64. It also
checks that the step left the new tokens' K/V in the cache (``read_kv``) and that ``attend``
alone over that cache gives the same answer as ``forward``.

``check_attention_rotary`` runs ``backend.forward_rotary`` (rotary embedding, write, attend: a
backend may fuse them) on one batch, and the platform's rotary op (the reference where it installs
none) then ``forward`` on an identical one: outputs and stored keys must agree.

``check_graph_capture`` captures a decode step with the platform's ``GraphRunner``, then, as the
core's runner does, copies the next steps' inputs (new queries/keys/values, one token longer
sequences, their new slots) into the captured tensors and replays; each replay must equal an
eager ``forward`` on the same inputs. So a captured step must read sequence lengths, slots and
block tables from those device tensors, not from host values fixed at capture time.
"""

from __future__ import annotations

import torch

from .. import ops
from ..attention import AttentionBackend
from ..metadata import RotaryInputs
from ..platform import GraphCaptureUnsupported, Platform
from .batches import AttentionBatch, AttentionCase, build_batch
from .report import ConformanceError, check_close, dtype_name, guarded


def _prepare(
    platform: Platform, backend: AttentionBackend, case: AttentionCase, dtype: torch.dtype, seed: int
) -> AttentionBatch:
    return guarded(
        f"preparing attention case {case.describe()} ({dtype_name(dtype)}): allocate_kv_cache / write_kv of the cached context / prepare_metadata",
        build_batch,
        platform,
        backend,
        case,
        dtype,
        seed,
    )


def check_attention(
    platform: Platform, backend: AttentionBackend, case: AttentionCase, dtype: torch.dtype, seed: int = 0
) -> None:
    batch = _prepare(platform, backend, case, dtype, seed)
    layer = case.layer()
    what = f"attention {case.describe()}, dtype {dtype_name(dtype)}; query {list(batch.query.shape)}"
    out = guarded(
        f"{what}: backend.forward",
        backend.forward,
        layer,
        batch.query,
        batch.key,
        batch.value,
        batch.kv_cache,
        batch.meta,
    )
    expected = batch.reference_output()
    check_close(out, expected, what=f"{what}: forward vs reference_paged_attention", dtype=dtype, locate=batch.locate)
    stored_k, stored_v = guarded(
        f"{what}: read_kv of the new tokens", backend.read_kv, batch.kv_cache, batch.meta.slot_mapping
    )
    slots = batch.ref_meta.slot_mapping.tolist()

    def locate_slot(index: tuple[int, ...]) -> str:
        return f"new token {index[0]} (slot {slots[index[0]]}), kv head {index[1]}, dim {index[2]}"

    for name, got, want in (("keys", stored_k, batch.key), ("values", stored_v, batch.value)):
        check_close(
            got,
            want,
            what=f"{what}: forward did not store the new tokens' {name} at slot_mapping",
            dtype=dtype,
            locate=locate_slot,
            exact=True,
        )
    again = guarded(f"{what}: backend.attend", backend.attend, layer, batch.query, batch.kv_cache, batch.meta)
    check_close(again, out, what=f"{what}: attend over the written cache vs forward", dtype=dtype, locate=batch.locate)


def rotary_table(max_positions: int, head_size: int) -> torch.Tensor:
    """[max_positions, head_size] float32 cos | sin of the usual rope frequencies (base 10000)."""
    inv_freq = 10000.0 ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def check_attention_rotary(
    platform: Platform, backend: AttentionBackend, case: AttentionCase, dtype: torch.dtype, seed: int = 0
) -> None:
    fused, plain = _prepare(platform, backend, case, dtype, seed), _prepare(platform, backend, case, dtype, seed)
    device = platform.torch_device()
    positions = torch.cat([torch.arange(s - q, s) for q, s in case.seqs]).to(device)  # [T]
    table = rotary_table(max(s for _, s in case.seqs) + 3, case.head_size).to(device)
    layer = case.layer()
    what = f"attention with rotary {case.describe()}, dtype {dtype_name(dtype)}"
    # the rotary op the model would pass: the platform's own when it installs one (a backend may
    # fuse exactly that op), else the reference
    rotate = ops.build_op_table(guarded(f"{what}: platform.custom_ops", platform.custom_ops))["rotary_embedding"]
    got = guarded(f"{what}: backend.forward_rotary", backend.forward_rotary, layer, fused.query, fused.key,
                  fused.value, fused.kv_cache, fused.meta, RotaryInputs(positions, table, rotate))
    query, key = rotate(positions, plain.query, plain.key, table)
    want = guarded(f"{what}: rotary_embedding then backend.forward", backend.forward, layer, query, key,
                   plain.value, plain.kv_cache, plain.meta)
    check_close(got, want, what=f"{what}: forward_rotary vs rotary_embedding + forward", dtype=dtype,
                locate=fused.locate)
    for name, kv in (("keys", 0), ("values", 1)):
        stored = backend.read_kv(fused.kv_cache, fused.meta.slot_mapping)[kv]
        check_close(stored, backend.read_kv(plain.kv_cache, plain.meta.slot_mapping)[kv],
                    what=f"{what}: forward_rotary stored other {name} than rotary_embedding + forward", dtype=dtype)


GRAPH_CASE = AttentionCase("graph-decode", ((1, 7), (1, 16), (1, 30), (1, 45)))


def _advance(batch: AttentionBatch, seq_lens: list[int], gen: torch.Generator) -> None:
    """Copy a decode step's inputs (sequences now ``seq_lens`` long) into the batch's tensors."""
    bs = batch.case.block_size
    tables = batch.ref_meta.block_tables.tolist()
    slots = [tables[i][(s - 1) // bs] * bs + (s - 1) % bs for i, s in enumerate(seq_lens)]
    for tensor in (batch.query, batch.key, batch.value):
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
    for meta in (batch.meta, batch.ref_meta):
        meta.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        meta.slot_mapping.copy_(torch.tensor(slots, dtype=torch.int64))
        meta.seq_lens_host[:] = seq_lens


def check_graph_capture(platform: Platform, backend: AttentionBackend, dtype: torch.dtype, seed: int = 0) -> str | None:
    """None when replays equal eager forwards; the reason when the runner declines to capture
    (``GraphCaptureUnsupported``: the engine then runs eagerly, a supported outcome, so not a failure)."""
    runner = guarded("graph_runner()", platform.graph_runner)
    if runner is None:
        raise ConformanceError(
            "capabilities().graph_capture is True but graph_runner() returned None; return a GraphRunner"
        )
    # capture at step 0, replay steps 1 and 2: tables and max_seq_len leave room for two more tokens
    case = AttentionCase(GRAPH_CASE.name, tuple((1, s + 2) for _, s in GRAPH_CASE.seqs))
    batch = _prepare(platform, backend, case, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    _advance(batch, [s for _, s in GRAPH_CASE.seqs], gen)
    layer = case.layer()
    what = f"graph capture of a decode step ({GRAPH_CASE.describe()}, dtype {dtype_name(dtype)})"

    def step() -> torch.Tensor:
        return backend.forward(layer, batch.query, batch.key, batch.value, batch.kv_cache, batch.meta)

    try:
        replay = guarded(f"{what}: GraphRunner.capture", runner.capture, step)
    except ConformanceError as exc:
        if isinstance(exc.__cause__, GraphCaptureUnsupported):
            return f"{what}: the platform does not capture it ({exc.__cause__})"
        raise
    platform.synchronize()
    for n in (1, 2):
        seq_lens = [s + n for _, s in GRAPH_CASE.seqs]
        _advance(batch, seq_lens, gen)
        replayed = guarded(f"{what}: replay {n}", replay)
        platform.synchronize()
        if isinstance(replayed, torch.Tensor):
            replayed = replayed.detach().clone()  # a captured graph's output is overwritten by the next replay
        eager = step()

        def locate(index: tuple[int, ...], lens: list[int] = seq_lens) -> str:
            return f"sequence {index[0]} (decode at position {lens[index[0]] - 1}), head {index[1]}, dim {index[2]}"

        check_close(
            replayed,
            eager,
            what=f"{what}: replay {n} (every sequence {n} token(s) longer) vs eager forward",
            dtype=dtype,
            locate=locate,
        )
