"""Calls of the native paged-attention kernel (native/paged_attention.c), one per layer.

A call takes the layer's query, the step's new key/value rows (or none: attend only), the cache
and two small structs:

    Step   the step's batch, the same for every layer: int32 block tables, the decodes' tokens /
           sequences / positions, the prefill tiles of the other sequences, the checked int64
           slots and, when the kernel rotates q and k itself (``forward_rotary``), the rotary
           positions and cos/sin table. Built by the first layer of a step and kept in the plan's
           cache.
    Shape  one layer's strides and attention parameters, kept per (layer, strides, block size).

The kernel first stores the new rows at their slots, then attends every tile and token, in one
OpenMP region. It trusts its arguments: ``kernel_inputs_fit`` and the checks here are the
whole of its validation (shapes, strides, dtypes, block ids, slots).
"""

from __future__ import annotations

import torch

from podium_plugin_api import AttentionLayerSpec, AttentionMetadata, GraphCaptureUnsupported, RotaryInputs

from .attention_plan import StepPlan, tiles_for
from .native_kernels import NativeKernels, Shape, Step


def call_kernel(kernels: NativeKernels, shapes: dict, layer: AttentionLayerSpec, query: torch.Tensor,
                new_rows: tuple[torch.Tensor, torch.Tensor] | None, caches: tuple[int, int, int, int],
                meta: AttentionMetadata, plan: StepPlan, rotary: RotaryInputs | None = None,
                amx: bool = True) -> torch.Tensor:
    """out [T, H, D], every sequence's rows attended.

    ``caches``: (key cache address, value cache address, blocks, block size); ``new_rows``: the
    step's (key, value) [T, Hkv, D], written first, or None. ``rotary`` (with ``new_rows``): query
    and key come unrotated; the kernel rotates them (``rotary_fits`` checked it applies). ``amx``:
    bf16 prefill tiles may run on AMX tiles (where the process can). The caller checked
    ``kernel_inputs_fit``.
    """
    _, _, blocks, block_size = caches
    check_plan(plan, query, blocks)
    step = _step(plan, meta, blocks * block_size, new_rows is not None, rotary, layer.num_heads // layer.num_kv_heads)
    return launch(kernels, shapes, layer, query, new_rows, caches, step, amx)


def launch(kernels: NativeKernels, shapes: dict, layer: AttentionLayerSpec, query: torch.Tensor,
           new_rows: tuple[torch.Tensor, torch.Tensor] | None, caches: tuple[int, int, int, int], step: Step,
           amx: bool = True) -> torch.Tensor:
    """One kernel call over ``step``'s tokens: out [T, H, D] (rows of other tokens uninitialised)."""
    key_ptr, value_ptr, _, block_size = caches
    out = torch.empty(query.shape, dtype=query.dtype)  # [T, H, D]
    if new_rows is None:
        key = value = None
        k_stride = v_stride = 0
    else:
        key, value = new_rows
        k_stride, v_stride = key.stride(0), value.stride(0)
    shape_key = (id(layer), query.stride(0), k_stride, v_stride, block_size, amx)
    entry = shapes.get(shape_key)
    if entry is None or entry[0] is not layer:
        entry = shapes[shape_key] = (layer, _shape(layer, query, k_stride, v_stride, block_size, amx))
    rc = kernels.paged_attention[query.dtype](
        query.data_ptr(), None if key is None else key.data_ptr(), None if value is None else value.data_ptr(),
        key_ptr, value_ptr, out.data_ptr(), step, entry[1], torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("native paged attention could not allocate its scratch buffers")
    return out


def check_plan(plan: StepPlan, query: torch.Tensor, blocks: int) -> None:
    """The step's plan fits the query rows and the cache (every attention path checks this first)."""
    if plan.num_tokens != query.shape[0]:
        raise ValueError(f"query has {query.shape[0]} rows; query_start_loc describes {plan.num_tokens} tokens")
    if plan.max_block >= blocks:
        raise ValueError(f"block_tables use block {plan.max_block}; the cache has {blocks} blocks")


def kernel_inputs_fit(layer: AttentionLayerSpec, query: torch.Tensor, new_rows, hkv: int, head_size: int,
                      num_new: int) -> bool:
    """query [T, H, D] and new key/value rows [num_new, Hkv, D]: each token's heads contiguous."""
    if layer.num_kv_heads != hkv or layer.head_size != head_size or not token_rows(query, layer.num_heads, head_size):
        return False
    return new_rows is None or all(t.shape[0] == num_new and token_rows(t, hkv, head_size) for t in new_rows)


def token_rows(t: torch.Tensor, heads: int, d: int) -> bool:
    """[*, heads, d] with each token's heads contiguous (any token stride)."""
    return (t.dim() == 3 and t.shape[1] == heads and t.shape[2] == d and t.stride(2) == 1 and t.stride(1) == d
            and t.stride(0) >= heads * d)


def _shape(layer: AttentionLayerSpec, query: torch.Tensor, k_stride: int, v_stride: int, block_size: int,
           amx: bool) -> Shape:
    return Shape(
        q_token_stride=query.stride(0), o_token_stride=layer.num_heads * layer.head_size,
        k_token_stride=k_stride, v_token_stride=v_stride,
        num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
        block_size=block_size, window=layer.sliding_window or 0,
        scale=layer.scale, soft_cap=layer.soft_cap or 0.0, amx_tiles=int(amx),
    )


def _step(plan: StepPlan, meta: AttentionMetadata, num_slots: int, writes: bool,
          rotary: RotaryInputs | None, group: int) -> Step:
    """The step's Step struct; built once per (step, cache size, rotary, query heads per kv head), its
    tensors kept in the plan."""
    key = ("native step", num_slots, writes, rotary is not None, group)
    cached = plan.cache.get(key)
    if cached is not None and cached[0] is meta.slot_mapping and (
            rotary is None or (cached[2] is rotary.positions and cached[3] is rotary.cos_sin_cache)):
        return cached[1]
    tables = plan.cache.get("int32 tables")
    if tables is None:
        tables = plan.cache["int32 tables"] = meta.block_tables.to(torch.int32).contiguous()
    slots = checked_slots(meta.slot_mapping, num_slots, plan) if writes else None
    step = Step(
        block_tables=tables.data_ptr(), bt_stride=tables.stride(0),
        tokens=plan.tokens.data_ptr(), seqs=plan.token_seqs.data_ptr(), positions=plan.token_positions.data_ptr(),
        num_tokens=plan.tokens.numel(), max_span=plan.max_decode_span,
        slots=None if slots is None else slots.data_ptr(), num_writes=0 if slots is None else slots.numel(),
    )
    tiles = tiles_for(plan, group)
    if tiles.numel():
        step.tiles, step.num_tiles, step.max_tile = tiles.data_ptr(), tiles.shape[0], int(tiles[:, 3].max())
    positions = None
    if rotary is not None:
        positions = _checked_positions(rotary)
        step.cos_sin, step.rope_positions = rotary.cos_sin_cache.data_ptr(), positions.data_ptr()
    # the tensors the struct points at stay alive with it
    plan.cache[key] = (meta.slot_mapping, step, rotary and rotary.positions, rotary and rotary.cos_sin_cache,
                       slots, positions)
    return step


def captured_step(meta: AttentionMetadata, query: torch.Tensor, block_size: int, writes: bool,
                  rotary: RotaryInputs | None) -> Step:
    """The Step of a decode step being captured as a graph: it points at the step's own tensors,
    which the engine refills before every replay, and plans nothing on the host. Each token is its
    sequence's last (position seq_lens[i] - 1, read by the kernel each call), keys are read through
    ``block_tables`` up to its whole width (``max_span``), new rows go to ``slot_mapping`` and
    rotate at ``rotary.positions``. Nothing is validated: a replayed step's inputs come from the
    engine, as a CUDA graph's do. Built once per (step, writes, rotary), kept in ``meta.extras``."""
    key = ("podium_cpu.captured step", writes, rotary is not None)
    cached = meta.extras.get(key)
    if cached is not None:
        return cached[0]
    tables, seq_lens, slots = meta.block_tables, meta.seq_lens, meta.slot_mapping
    num = seq_lens.shape[0]
    if meta.max_query_len != 1 or query.shape[0] != num:
        raise GraphCaptureUnsupported("only decode steps (one new token a sequence) are captured on the CPU")
    fits = (tables.dtype == torch.int32 and tables.stride(1) == 1 and seq_lens.dtype == torch.int32
            and seq_lens.is_contiguous() and (not writes or (slots.dtype == torch.int64 and slots.is_contiguous())))
    if rotary is not None:
        fits = fits and rotary_fits(rotary, num, query.shape[2]) and rotary.positions.dtype == torch.int64 \
            and rotary.positions.is_contiguous()
    if not fits:
        raise GraphCaptureUnsupported("the step's metadata is not in the dtypes and layouts the kernel reads in place")
    index = torch.arange(num, dtype=torch.int64)  # token i is sequence i's new token
    step = Step(
        block_tables=tables.data_ptr(), bt_stride=tables.stride(0), tokens=index.data_ptr(), seqs=index.data_ptr(),
        num_tokens=num, max_span=tables.shape[1] * block_size, seq_lens=seq_lens.data_ptr(),
        slots=slots.data_ptr() if writes else None, num_writes=num if writes else 0,
    )
    if rotary is not None:
        step.cos_sin, step.rope_positions = rotary.cos_sin_cache.data_ptr(), rotary.positions.data_ptr()
    meta.extras[key] = (step, index)
    return step


def rotary_fits(rotary: RotaryInputs, num_tokens: int, head_size: int) -> bool:
    """The kernel can rotate with these inputs: a float32 [P, D] table, one position per new token."""
    table, positions = rotary.cos_sin_cache, rotary.positions
    return (table.dtype == torch.float32 and table.dim() == 2 and table.shape[1] == head_size and head_size % 2 == 0
            and table.is_contiguous() and table.is_cpu and positions.dim() == 1 and positions.shape[0] == num_tokens
            and not positions.is_floating_point())


def _checked_positions(rotary: RotaryInputs) -> torch.Tensor:
    """The rotary positions as contiguous int64, each a row of the cos/sin table."""
    positions = rotary.positions.to(torch.int64).contiguous()
    rows = rotary.cos_sin_cache.shape[0]
    if positions.numel():
        low, high = torch.aminmax(positions)
        if int(low) < 0 or int(high) >= rows:
            raise ValueError(f"positions must be in [0, {rows}), got [{int(low)}, {int(high)}]")
    return positions


def checked_slots(slot_mapping: torch.Tensor, num_slots: int, plan: StepPlan | None) -> torch.Tensor:
    """slot_mapping as contiguous int64, every slot below ``num_slots``; once per step with a plan."""
    key = ("slots", num_slots)
    cached = plan.cache.get(key) if plan is not None else None
    if cached is not None and cached[0] is slot_mapping:
        return cached[1]
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())}; the cache has {num_slots} slots")
    if plan is not None:
        plan.cache[key] = (slot_mapping, slots)
    return slots
