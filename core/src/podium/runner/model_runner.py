"""``ModelRunner``: executes step plans on this process's device, returning the logits to sample.

The pieces, one concept each:

    plan.py         StepPlan: the step as plain ints (rows, lengths, tokens, block-table entries)
    block_table.py  the host block-table array, kept from the plans alone
    batch.py        a plan's flat batch on the host; its attention metadata on the device
    eager.py        a step run eagerly, shaped as the platform asks (``StepShaping``)
    graphs.py       captured decode steps and their replay (inputs staged by one copy: staging.py)
    verify_graphs.py  captured speculative verify steps (rows padded to k + 1 tokens)
    deferred.py     async scheduling: tokens sampled on the device, read a step later
    sampling.py     sampling now: tokens and logprobs for the engine

Per step the runner writes the plan's new block-table entries, builds the flat batch (for T new
tokens of S sequences: input ids, positions and slots [T]; query_start_loc [S + 1], seq_lens [S],
block tables [S, W]), replays a captured graph when the step is pure decode and a captured size
holds it (a verify step of decodes with drafts: a captured verify graph), else runs the model
eagerly, and returns the logits of the rows that sample. Sampling is
the caller's (the engine's): ``execute`` is the per-device half of a step.

Tensor and pipeline parallelism plug in here without reshaping it. Tensor parallelism (issue 26)
runs one worker process per rank, each with its own ``ModelRunner`` over its shard of the model
(the model transformed by sharded linears and all-reduces; the runner does not know) and its own
KV cache. Rank 0 owns the scheduler: each step it builds the ``StepPlan`` (plain lists, picklable)
and broadcasts it; every rank calls ``execute(plan, feed_tokens)``, so every block table stays the
same with no release messages; only rank 0 samples (``sampling`` / ``deferred``) and, with async
scheduling, broadcasts the sampled tokens that the next step's placeholders read (``feed_tokens``).
LoRA (``lora``: a ``podium.lora.step.LoRAStep`` where adapters are served) plugs in the same way:
before the forward the runner writes the plan's new slot loads and stages each row's adapter slot,
which the model's adapted projections read. Where the platform can capture the adapters' ops, the
decode graphs include them and a second set (``base_graphs``) is captured without them, which the
steps in which no row has an adapter replay: they then run exactly the plain model's kernels (with
the adapters' launches in the graphs, whose programs then all return at once, the base model ran at
0.935x an engine without LoRA on an H200). Where the platform cannot capture the adapters' ops, the
graphs leave them out and serve only steps without adapters.
Pipeline parallelism would split ``execute`` at a layer boundary: the same plan goes to every stage,
a stage's hidden states go to the next, and the last stage returns the logits; data-parallel
replicas are separate engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from podium_plugin_api import Platform

from .batch import host_batch
from .block_table import BlockTable
from .eager import EagerStep
from .graphs import DecodeGraphs
from .plan import StepPlan
from .verify_graphs import VerifyGraphs


@dataclass
class StepLogits:
    """What a step computed for sampling: on the device, or the host where the platform samples there."""

    logits: torch.Tensor | None  # [N, V]: the sequences of ``plan.samples``, in order (None: none samples)
    prompt_logits: list[torch.Tensor]  # [rows, V] per ``plan.prompt_spans`` entry
    num_tokens: int
    used_graph: bool
    # what ``ModelRunner.keep_hidden`` kept of the step's hidden states [T, ...], in token order
    # (None: nothing is kept; the default)
    hidden: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, platform: Platform, kv_caches: list[torch.Tensor], block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device, table: BlockTable | None = None,
                 lora=None) -> None:
        """``table``: another runner's block table to read (a speculative draft's cache is indexed
        by the target's tables, so both see the same blocks); None: this runner's own. ``lora``: a
        ``podium.lora.step.LoRAStep`` where adapters are served, or None."""
        self.model, self.platform, self.kv_caches = model, platform, kv_caches
        self.backend = platform.attention_backend()
        self.shaping = platform.step_shaping()
        self.block_size, self.device = block_size, device
        self.table = table if table is not None else BlockTable(max_num_seqs, -(-max_model_len // block_size))
        self.eager = EagerStep(model, self.backend, kv_caches, self.table, self.shaping, block_size, device)
        self.decode_graphs = DecodeGraphs(model, self.backend, kv_caches, self.table, self.shaping, block_size,
                                          device, platform.capabilities().pinned_memory)
        self.verify_graphs = VerifyGraphs(self.decode_graphs)  # speculative verify steps (k + 1 tokens a row)
        self.lora = lora
        # with adapters in decode_graphs: the same steps captured without them (None: not captured)
        self.base_graphs: DecodeGraphs | None = None
        self._graph_args = (model, self.backend, kv_caches, self.table, self.shaping, block_size, device,
                            platform.capabilities().pinned_memory)
        self.last_used_graph = False

    def keep_hidden(self, keep) -> None:
        """Keep ``keep(hidden [T', H]) -> [T', ...]`` of every later step (eager or replayed) in
        ``StepLogits.hidden``: what a speculative draft head reads of the target. Set before graphs
        are captured (their outputs then include it); without it a step keeps nothing."""
        self.eager.keep = self.decode_graphs.keep = keep

    @property
    def graphs(self) -> dict:
        """Captured decode steps by batch size."""
        return self.decode_graphs.captured

    def execute(self, plan: StepPlan, feed_tokens: torch.Tensor | None = None) -> StepLogits:
        """Run ``plan``. ``feed_tokens``: the previous step's sampled tokens [N] on the device, where
        its placeholders (``plan.fill``) take them. Call under the platform's no-grad mode."""
        self.table.apply(plan.new_blocks)
        if plan.fill is not None and feed_tokens is None:
            raise RuntimeError("the plan has placeholder tokens but no step's tokens were given to fill them")
        batch = host_batch(plan, self.table, self.block_size)
        size = self.decode_graphs.size_for(plan.num_seqs) if plan.is_pure_decode else None
        verify = self.verify_graphs.size_for(plan) if plan.sample_drafts and not plan.prompt_spans else None
        graphs = self.decode_graphs
        if self.lora is not None:
            size, graphs = self._stage_lora(plan, size)
            verify = None  # verify graphs are captured without the adapters' ops
        self.last_used_graph = size is not None or verify is not None
        if verify is not None:
            logits, hidden = self.verify_graphs.replay(verify, batch)
            return StepLogits(logits, [], plan.num_tokens, True, hidden)
        if size is None:
            logits, prompt, hidden = self.eager.run(plan, batch, feed_tokens)
            return StepLogits(logits, prompt, plan.num_tokens, False, hidden)
        logits, hidden = graphs.replay(size, plan, batch, feed_tokens)
        logits = logits[:plan.num_seqs] if plan.samples else None
        if logits is not None and len(plan.samples) != plan.num_seqs:
            logits = logits[torch.tensor(plan.samples, dtype=torch.long).to(logits.device, non_blocking=True)]
        return StepLogits(logits, [], plan.num_tokens, True, None if hidden is None else hidden[:plan.num_tokens])

    def hidden_states(self, plan: StepPlan) -> torch.Tensor:
        """Run ``plan`` eagerly and return the hidden states of its tokens [T, hidden] (a pooling
        model's step: no logits, nothing sampled). Call under the platform's no-grad mode."""
        self.table.apply(plan.new_blocks)
        batch = host_batch(plan, self.table, self.block_size)
        if self.lora is not None:
            self._stage_lora(plan, None)
        hidden, _ = self.eager.forward(plan, batch, None)
        return hidden[:plan.num_tokens]

    def capture_graphs(self, max_batch: int, no_grad) -> float:
        """Capture decode graphs up to ``max_batch`` sequences where the platform can; returns seconds."""
        runner = self.platform.graph_runner()
        if runner is None:
            return 0.0
        if self.lora is None:
            seconds = self.decode_graphs.capture(runner, max_batch, no_grad)
        else:
            seconds = self._capture_with_lora(runner, max_batch, no_grad)
        self.platform.synchronize()
        return seconds

    def capture_verify_graphs(self, k: int, max_batch: int, no_grad) -> float:
        """Capture speculative verify steps (every row its last token and up to ``k`` drafts) for
        up to ``max_batch`` sequences where the platform can (``verify_graphs``); returns seconds."""
        runner = self.platform.graph_runner()
        if runner is None or self.lora is not None:  # (with adapters, verify steps run eagerly)
            return 0.0
        seconds = self.verify_graphs.capture(runner, k, max_batch, no_grad)
        self.platform.synchronize()
        return seconds

    def _stage_lora(self, plan: StepPlan, size: int | None) -> tuple[int | None, DecodeGraphs]:
        """Write the plan's slot loads, stage its rows' slots; the graph size it may replay (None:
        eager) and the graphs that replay it."""
        lora = self.lora
        if plan.lora_loads:
            lora.load(plan.lora_loads)
        if size is not None and plan.lora_slots is None and self.base_graphs is not None:
            lora.stage(None, plan.query_lens, None)  # (its graphs read no mapping)
            return size, self.base_graphs
        if size is not None and not lora.graph_serves(plan.lora_slots):
            size = None
        lora.stage(plan.lora_slots, plan.query_lens, size)
        return size, self.decode_graphs

    def _capture_with_lora(self, runner, max_batch: int, no_grad) -> float:
        """Capture with the adapters' ops in the graphs, then the same steps without them
        (``base_graphs``); where the platform cannot capture the adapters' ops, only the graphs
        without them (they then replay only steps in which no row has an adapter)."""
        state = self.lora.state
        state.reserve_graphs(max_batch)
        state.capturing = True
        try:
            seconds = self.decode_graphs.capture(runner, max_batch, no_grad)
            state.capture_adapters = False
            if not self.decode_graphs.captured:
                self.lora.graphs_have_adapters = False
                seconds += self.decode_graphs.capture(runner, max_batch, no_grad)
            else:
                base = DecodeGraphs(*self._graph_args)
                base.keep = self.decode_graphs.keep
                seconds += base.capture(runner, max_batch, no_grad)
                self.base_graphs = base if base.captured else None
        finally:
            state.capturing = False
            state.capture_adapters = self.lora.graphs_have_adapters
        return seconds
