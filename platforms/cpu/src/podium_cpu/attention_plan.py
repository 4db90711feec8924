"""What one step's attention needs, worked out once per step (not once per layer).

A step's sequences split by query length:

    tokens  (query_len < TILE_MIN_QUERY: decodes): the native kernel attends each (token, kv head)
            as one work item, reading K/V through the block table. Without the kernel, pure decodes
            are batched in torch (one gather per layer for all of them).
    tiled   (prompts, prefill chunks, every other length): the native kernel cuts each into tiles of
            consecutive query tokens and attends each (tile, kv head) flash style (``tiles_for``),
            in the same call as the tokens. Without the kernel: one fused SDPA call per sequence; a
            fresh prefill (no cached context) attends to its own new keys/values without reading
            the cache at all.

In the batch-invariant mode (``tile_min_query=EVERY_TOKEN_ALONE``) every query token goes the tokens
way: a prompt's token is attended exactly as it would be as a decode (one work item, all its keys
scored, then soft-maxed, then summed, in the same order), so its result does not depend on the
chunk it came in, on a cached prefix or on the other sequences of the step.

Everything here is host-side bookkeeping plus a few small index tensors; the first layer of a
step builds it and keeps it in ``meta.extras`` for the other layers (``plan_for``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from podium_plugin_api import AttentionMetadata

TILE_MIN_QUERY = 2  # sequences with this many query tokens or more are tiled (decodes stay tokens)
EVERY_TOKEN_ALONE = 1 << 62  # a tile_min_query that tiles nothing (the batch-invariant mode)
TILE_ROWS = 48  # a tile's query rows (tokens x the query heads of a kv head) aimed at
PLAN_KEY = "podium_cpu.plan"


@dataclass
class Chunk:
    """A sequence with several query tokens (a prompt or a prefill chunk): its query rows [lo, hi) and
    its context; the native kernel tiles it, without the kernel it is one SDPA call."""

    index: int
    lo: int
    hi: int
    seq_len: int
    blocks: torch.Tensor  # int64 [ceil(seq_len / block_size)] its block ids

    @property
    def fresh(self) -> bool:
        """No cached context: every key is one of this step's new tokens."""
        return self.hi - self.lo == self.seq_len


@dataclass
class StepPlan:
    block_size: int
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor  # the metadata's tensor this plan was built from
    num_tokens: int
    max_block: int  # the largest block id any sequence uses (validated against the cache)
    decode_seqs: list[int]
    chunks: list[Chunk]
    # native kernel inputs: the decodes' tokens, int64 [N] each
    tokens: torch.Tensor
    token_seqs: torch.Tensor
    token_positions: torch.Tensor
    max_decode_span: int  # the most keys a decode attends to
    tile_min_query: int = TILE_MIN_QUERY  # what made a sequence a chunk
    cache: dict = field(default_factory=dict)  # derived tensors built on first use (torch decode path)


def build_plan(meta: AttentionMetadata, block_size: int, tile_min_query: int = TILE_MIN_QUERY) -> StepPlan:
    """The plan of ``meta``'s step; uses its host lists when the runner gave them. Sequences with
    fewer than ``tile_min_query`` query tokens go token by token."""
    query_lens = meta.query_lens_host or torch.diff(meta.query_start_loc).tolist()
    seq_lens = meta.seq_lens_host or meta.seq_lens.tolist()
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    tables = meta.block_tables
    tables_host = tables.cpu().numpy()
    decodes, chunks = [], []
    tokens, token_seqs, positions = [], [], []
    max_block, max_span = 0, 1
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        if q <= 0:
            continue
        if q > s:
            raise ValueError(f"sequence {i}: query_len {q} exceeds seq_len {s}")
        used = -(-s // block_size)
        if used > tables.shape[1]:
            raise ValueError(f"sequence {i}: seq_len {s} needs {used} blocks; block_tables has {tables.shape[1]}")
        if q < tile_min_query:
            decodes.append(i)
            tokens.extend(range(starts[i], starts[i] + q))
            token_seqs.extend([i] * q)
            positions.extend(range(s - q, s))
            max_span = max(max_span, s)
        else:
            chunks.append(Chunk(i, starts[i], starts[i] + q, s, tables[i, :used].long()))
        row = tables_host[i, :used]
        max_block = max(max_block, int(row.max()))
        if int(row.min()) < 0:
            raise ValueError(f"sequence {i}: negative block id in block_tables")
    return StepPlan(
        block_size=block_size,
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        block_tables=tables,
        num_tokens=starts[-1],
        max_block=max_block,
        decode_seqs=decodes,
        chunks=chunks,
        tokens=torch.tensor(tokens, dtype=torch.int64),
        token_seqs=torch.tensor(token_seqs, dtype=torch.int64),
        token_positions=torch.tensor(positions, dtype=torch.int64),
        max_decode_span=max_span,
        tile_min_query=tile_min_query,
    )


def plan_for(meta: AttentionMetadata, block_size: int, tile_min_query: int = TILE_MIN_QUERY) -> StepPlan:
    """The step's plan: the stored one while it still describes ``meta``, else a new one.

    It is stored only when the runner gave host lists; a step without them (a captured step whose
    tensors are refilled in place) gets a plan built from its tensors on every call.
    """
    plan = meta.extras.get(PLAN_KEY)
    if (
        plan is not None
        and plan.block_size == block_size
        and plan.tile_min_query == tile_min_query
        and plan.block_tables is meta.block_tables
        and plan.seq_lens == meta.seq_lens_host
        and plan.query_lens == meta.query_lens_host
    ):
        return plan
    plan = build_plan(meta, block_size, tile_min_query)
    if meta.seq_lens_host and meta.query_lens_host:
        meta.extras[PLAN_KEY] = plan
    return plan


def tiles_for(plan: StepPlan, group: int) -> torch.Tensor:
    """The native kernel's prefill tiles of ``plan``'s chunks for a layer whose kv heads
    each serve ``group`` query heads: int64 [num_tiles, 4] rows (sequence, first query row, its
    position, query rows), each about TILE_ROWS / group tokens, the tiles that see the most keys
    first (the kernel hands them out in this order: the long ones do not come last). Cached."""
    key = ("tiles", group)
    if key not in plan.cache:
        size = max(1, TILE_ROWS // group)
        rows = []
        for seq in plan.chunks:
            first_pos = seq.seq_len - (seq.hi - seq.lo)
            for lo in range(seq.lo, seq.hi, size):
                count = min(size, seq.hi - lo)
                rows.append((seq.index, lo, first_pos + lo - seq.lo, count))
        rows.sort(key=lambda r: -(r[2] + r[3]))
        plan.cache[key] = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
    return plan.cache[key]
