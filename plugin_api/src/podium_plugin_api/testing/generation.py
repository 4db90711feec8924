"""End-to-end check: greedy generation with the tiny model through the platform equals the CPU reference.

On the platform, several sequences of different prompt lengths share every step: long prompts
are prefilled in chunks while shorter ones already decode (mixed batches), and every decode reads
the paged cache allocated by ``allocate_kv_cache`` through the platform's attention backend, with
its custom ops in place. The reference runs the same model densely (no cache: each step recomputes
the whole sequence with causal attention) in float64 on the CPU with the reference ops. The
generated tokens must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..metadata import AttentionLayerSpec, AttentionMetadata, KVCacheSpec
from ..platform import Platform
from ..reference import attend_one, attention_mask
from .batches import random_block_tables
from .report import ConformanceError, dtype_name, guarded
from .tiny_model import TinyConfig, TinyLlama

PROMPT_LENS = (5, 13, 21, 34)
MAX_NEW_TOKENS = 8
CHUNK = 8  # prefill chunk size: the 34-token prompt takes 5 steps while the others decode
BLOCK_SIZE = 16
SEED = 1234


@dataclass
class Sequence:
    tokens: list[int]
    prompt_len: int
    block_table: list[int]
    computed: int = 0  # tokens whose K/V are in the cache
    logits: list[torch.Tensor] = field(default_factory=list)  # one [vocab] per generated token

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


def prompts(cfg: TinyConfig, seed: int = SEED) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def reference_generate(cfg: TinyConfig, prompt_ids: list[list[int]]) -> list[Sequence]:
    """Dense float64 CPU greedy generation, one sequence at a time, no cache."""
    model = TinyLlama(cfg, SEED, torch.float64, "cpu")
    scale = cfg.head_size**-0.5
    out = []
    for ids in prompt_ids:
        seq = Sequence(list(ids), len(ids), [])
        for _ in range(MAX_NEW_TOKENS):
            n = len(seq.tokens)
            mask = attention_mask(n, n, None, "cpu")

            def dense(_layer: int, q, k, v, mask=mask):
                return attend_one(q, k, v, mask, scale, None)

            logits = model.forward(torch.tensor(seq.tokens), torch.arange(n), dense)[-1]
            seq.logits.append(logits)
            seq.tokens.append(int(logits.argmax()))
        out.append(seq)
    return out


def _step_plan(seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
    """(sequence, new tokens this step) for every unfinished sequence: a prefill chunk or one decode."""
    plan = []
    for seq in seqs:
        if len(seq.generated) < MAX_NEW_TOKENS:
            plan.append((seq, min(CHUNK, len(seq.tokens) - seq.computed)))
    return plan


def platform_generate(
    platform: Platform, cfg: TinyConfig, prompt_ids: list[list[int]], dtype: torch.dtype, ops
) -> list[Sequence]:
    """Greedy generation over the platform's paged cache, all sequences batched in every step."""
    device = platform.torch_device()
    backend = platform.attention_backend()
    model = TinyLlama(cfg, SEED, dtype, device, ops)
    layer = AttentionLayerSpec(cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.head_size**-0.5)
    capacities = [len(p) + MAX_NEW_TOKENS for p in prompt_ids]
    tables, num_blocks = random_block_tables(capacities, BLOCK_SIZE, 1, torch.Generator().manual_seed(SEED))
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_size, BLOCK_SIZE, dtype)
    caches = platform.allocate_kv_cache(spec, num_blocks)
    seqs = [Sequence(list(p), len(p), t) for p, t in zip(prompt_ids, tables)]
    while plan := _step_plan(seqs):
        tokens = [t for seq, q in plan for t in seq.tokens[seq.computed : seq.computed + q]]
        positions = [p for seq, q in plan for p in range(seq.computed, seq.computed + q)]
        seq_lens = [seq.computed + q for seq, q in plan]
        meta = AttentionMetadata.from_lengths(
            [q for _, q in plan], seq_lens, [s.block_table for s, _ in plan], BLOCK_SIZE, device
        )
        meta = backend.prepare_metadata(meta)

        def paged(n: int, q, k, v, meta=meta):
            return backend.forward(layer, q, k, v, caches[n], meta)

        logits = model.forward(torch.tensor(tokens, device=device), torch.tensor(positions, device=device), paged)
        last = meta.query_start_loc[1:].long() - 1  # [S] index of each sequence's last new token
        last_logits = logits[last].detach().to("cpu", torch.float64)  # [S, vocab]
        for row, (seq, q) in enumerate(plan):
            seq.computed += q
            if seq.computed == len(seq.tokens):  # prompt done: this step's last logits pick a token
                seq.logits.append(last_logits[row])
                seq.tokens.append(int(last_logits[row].argmax()))
    return seqs


# A reference top-2 logit margin below this is a near tie the dtype cannot resolve: a platform may
# pick either token there, and the rest of that sequence is not compared. float32 is held exact.
TIE_MARGIN = {torch.float32: 0.0, torch.float16: 0.1, torch.bfloat16: 0.5}


def compare(ours: list[Sequence], reference: list[Sequence], what: str, dtype: torch.dtype) -> None:
    for i, (seq, ref) in enumerate(zip(ours, reference)):
        if seq.generated == ref.generated:
            continue
        pos = next(p for p, (a, b) in enumerate(zip(seq.generated, ref.generated)) if a != b)
        top2 = ref.logits[pos].topk(2).values
        margin = float(top2[0] - top2[1])
        if margin < TIE_MARGIN.get(dtype, 0.5):
            continue
        err = float((seq.logits[pos] - ref.logits[pos]).abs().max())
        raise ConformanceError(
            f"{what}: sequence {i} (prompt of {seq.prompt_len} tokens) differs from the CPU float64 reference at "
            f"generated position {pos} (token position {seq.prompt_len + pos}): platform {seq.generated} vs "
            f"reference {ref.generated}; there, logits [{ref.logits[pos].numel()}] max abs error {err:.4g} "
            f"(reference top-2 margin {margin:.4g})"
        )


def generation_dtype(dtypes: tuple[torch.dtype, ...], default: torch.dtype) -> torch.dtype:
    return torch.float32 if torch.float32 in dtypes else default


def check_generation(platform: Platform, dtype: torch.dtype, ops=None, cfg: TinyConfig | None = None) -> None:
    cfg = cfg or TinyConfig()
    prompt_ids = prompts(cfg)
    what = (
        f"end-to-end greedy generation ({cfg.num_layers}-layer tiny Llama, {cfg.num_heads}:{cfg.num_kv_heads} heads, "
        f"head_size {cfg.head_size}, {dtype_name(dtype)}, block_size {BLOCK_SIZE}, prompts {list(PROMPT_LENS)} "
        f"prefilled in chunks of {CHUNK}, {MAX_NEW_TOKENS} new tokens each)"
    )
    ours = guarded(f"{what}: running on the platform", platform_generate, platform, cfg, prompt_ids, dtype, ops)
    compare(ours, reference_generate(cfg, prompt_ids), what, dtype)
