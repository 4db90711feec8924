"""A draft model (or EAGLE head) on the target's device, with a KV cache laid out like the target's.

The draft's cache has the target's block count and block size, and its runner reads the target's
block-table array (``ModelRunner(table=...)``): a draft token at position p of a sequence lives in
the same block id and slot as the target's token at p. So the scheduler's blocks serve both caches,
one slot mapping addresses both, and rolling back rejected drafts (``BlockManager.truncate``) frees
both at once. ``ModelShard`` builds it after the target's weights (``companion``), sizes the target's
cache with both caches' bytes per block, then ``attach``es it: its cache is allocated and its runner
built over the target's table. Its steps are ordinary ``StepPlan``s: eager, or a captured decode
graph for the one-token steps of autoregressive drafting.
"""

from __future__ import annotations

import copy

import torch

from ..kv_cache import kv_cache_spec
from ..runner import ModelRunner, StepLogits, StepPlan


class DraftDevice:
    def __init__(self, model: torch.nn.Module, hf_config, kv_dtype: torch.dtype, shard, label: str) -> None:
        """``hf_config``: the draft's shape (its layers, KV heads and head size make its cache)."""
        self.model, self.shard, self.label = model, shard, label
        self.spec = kv_cache_spec(hf_config, shard.config.block_size, kv_dtype)
        self.runner: ModelRunner | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.vocab_limit: int | None = None  # a draft model: the ids it may propose (the target's)
        # an EAGLE head: what the target's runner keeps of its hidden states (ModelRunner.keep_hidden)
        self.target_keep = None

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block

    def describe(self) -> str:
        return f"{self.label}, {self.spec.num_layers} layer(s) of KV cache"

    def attach(self, shard) -> None:
        """Allocate the cache with the target's blocks and build the runner over its table."""
        self.num_blocks = shard.num_kv_blocks
        self.kv_caches = shard.platform.allocate_kv_cache(self.spec, self.num_blocks)  # zeroed
        config = shard.config
        if self.target_keep is not None:  # before the target's graphs are captured: they keep it too
            shard.runner.keep_hidden(self.target_keep)
        self.runner = ModelRunner(self.model, shard.platform, self.kv_caches, config.block_size, config.max_num_seqs,
                                  shard.max_model_len, shard.device, table=shard.runner.table)

    def capture_graphs(self, max_batch: int, no_grad) -> None:
        self.runner.capture_graphs(max_batch, no_grad)

    def take_tables(self, output) -> None:
        """Write the step's new block-table entries now: the draft runs before the target's forward,
        which would write them (again) itself."""
        self.runner.table.apply([(s.row, s.first_new_block, s.new_blocks) for s in output.scheduled if s.new_blocks])

    def run(self, plan: StepPlan) -> StepLogits:
        """One draft step (call under the platform's no-grad mode): ``plan.new_blocks`` is empty, the
        target's plan of this step already wrote its table entries."""
        return self.runner.execute(plan)

    @property
    def table(self):
        return self.runner.table


def with_layers(hf_config, num_layers: int):
    """A copy of ``hf_config`` with ``num_hidden_layers`` (an EAGLE head's cache has its own count)."""
    config = copy.copy(hf_config)
    config.num_hidden_layers = num_layers
    return config
