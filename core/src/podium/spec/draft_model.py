"""``draft_model``: a smaller model sharing the target's tokenizer drafts k tokens autoregressively.

After the scheduler has planned a step (and reserved the blocks of each sequence's drafts), the
draft runs on the target's device over the target's block tables (``draft_device``):

1. one forward catches the draft up on every scheduled sequence's tokens it has not fed yet: the
   prompt chunk the target computes this step, the last sampled token, and the last draft of a step
   that accepted them all (``draft_kv``); the last row of each sequence with drafts gives draft 1;
2. then k - 1 one-token forwards (a captured decode graph where the platform has one) feed draft j
   at its position and give draft j + 1.

Drafts are the draft's greedy tokens: a deterministic proposal, so ``verify``'s rule keeps the
target's distribution for sampled requests too (it accepts a draft with the target's probability
of it). A draft's K/V at a rejected position is overwritten when the sequence next computes there.
"""

from __future__ import annotations

import logging

import torch

from ..models.registry import build_model, init_random_weights
from ..platform_setup import check_attention_support
from ..quantization import select_quantization
from ..request import Sequence
from ..runner import StepPlan
from ..scheduler import SchedulerOutput
from .draft_device import DraftDevice
from .draft_kv import DraftCacheState, span_slots

logger = logging.getLogger(__name__)


class DraftModelProposer:
    method = "draft_model"

    def __init__(self, device: DraftDevice, k: int, vocab_limit: int) -> None:
        self.device, self.k = device, k
        self.vocab_limit = vocab_limit  # ids the target knows (a draft's padded vocabulary may be wider)
        self.state: DraftCacheState | None = None  # once attached (the block count is known)

    def ready(self, seq: Sequence) -> bool:
        return True  # the catch-up of step 1 feeds whatever the draft has not seen

    def forget(self, seq: Sequence) -> None:
        if self.state is not None:
            self.state.forget(seq)

    def observe(self, output: SchedulerOutput, hidden) -> None:
        """Nothing after the step: the draft caught up before it."""

    def draft(self, output: SchedulerOutput) -> None:
        """Fill every scheduled sequence's reserved ``drafts`` (see the module docstring)."""
        device, items = self.device, output.scheduled
        if self.state is None:
            self.state = DraftCacheState(device.num_blocks, device.runner.block_size)
        state, table = self.state, device.table
        device.take_tables(output)
        for seq in output.admitted:
            state.admit(seq)
        size = device.runner.block_size
        state.valid[span_slots(table.array, [s.row for s in items], [s.start for s in items],
                               [s.num_new_tokens for s in items], size)] = False  # the target rewrites these
        rows, starts, lens, tokens, samples = [], [], [], [], []
        for i, s in enumerate(items):
            seq, end = s.seq, s.start + s.num_new_tokens - len(s.drafts)
            first = state.start(seq, s.start)
            rows.append(s.row)
            starts.append(first)
            lens.append(end - first)
            tokens.extend(seq.token_ids[first:end])
            state.written[seq.seq_id] = end
            if s.drafts:
                samples.append(i)
        proposals = self._greedy(StepPlan(rows, starts, lens, tokens, samples, []))
        state.valid[span_slots(table.array, rows, starts, lens, size)] = True
        if samples:
            self._autoregress([items[i] for i in samples], proposals)

    def _autoregress(self, drafted: list, first: list[int]) -> None:
        """Drafts 2..d of each drafted sequence, one position per forward."""
        state, size, table = self.state, self.device.runner.block_size, self.device.table
        out = [[token] for token in first]
        for j in range(1, max(len(s.drafts) for s in drafted)):
            active = [n for n, s in enumerate(drafted) if len(s.drafts) > j]
            rows = [drafted[n].row for n in active]
            starts = [drafted[n].start + j for n in active]  # draft j sits right after the last token
            following = self._greedy(StepPlan(rows, starts, [1] * len(active), [out[n][-1] for n in active],
                                              list(range(len(active))), []))
            state.valid[span_slots(table.array, rows, starts, [1] * len(active), size)] = True
            for n, start, token in zip(active, starts, following):
                out[n].append(token)
                state.written[drafted[n].seq.seq_id] = start + 1
        for s, tokens in zip(drafted, out):
            s.drafts[:] = tokens

    def _greedy(self, plan: StepPlan) -> list[int]:
        """The draft's argmax token after each sampling row of ``plan`` (within the target's vocabulary)."""
        logits = self.device.run(plan).logits
        if logits is None:
            return []
        return logits[:, :self.vocab_limit].argmax(dim=-1).tolist()


def check_shared_vocabulary(draft, target, name: str) -> int:
    """The ids both models know; ValueError when the draft does not tokenize exactly as the target."""
    draft_vocab, target_vocab = draft.hf_config.vocab_size, target.hf_config.vocab_size
    if draft.tokenizer is not None and target.tokenizer is not None:
        mine, theirs = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
        if mine != theirs:
            differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
            raise ValueError(f"speculative_config model {name!r} does not share the target's tokenizer ({len(mine)} "
                             f"vs {len(theirs)} tokens; e.g. {differ}); a draft model must use the target's "
                             "vocabulary, token for token")
    elif draft_vocab != target_vocab:
        raise ValueError(f"speculative_config model {name!r} has vocab_size {draft_vocab}, the target {target_vocab}, "
                         "and no tokenizer to compare; a draft model must share the target's vocabulary")
    return min(draft_vocab, target_vocab)


def load_draft_model(source, shard, quantization_methods, name: str) -> DraftDevice:
    """The draft model (``source``: its resolved ``ModelSource``) on the shard's device, in its dtype."""
    platform, config = shard.platform, shard.config
    if source.max_model_len and source.max_model_len < shard.max_model_len:
        raise ValueError(f"speculative_config model {name!r} accepts {source.max_model_len} tokens, the engine "
                         f"max_model_len={shard.max_model_len}; set max_model_len <= {source.max_model_len}")
    method = select_quantization(None, source.quantization, quantization_methods)
    model = build_model(source.hf_config, shard.ops, shard.dtype, shard.device, shard.architectures,
                        quantization=method)
    check_attention_support(model, platform, name)
    weights = source.weights(keep=method.kept_checkpoint_names() if method else frozenset())
    if weights is None:
        init_random_weights(model, config.seed)  # a shape: the weights a target of that shape gets
    else:
        model.load_weights(weights)
    if method is not None:
        with torch.no_grad():
            method.finish(model)
    model = platform.prepare_model(model.eval())
    label = f"draft model {name}" + (f" ({method.describe()})" if method else "")
    return DraftDevice(model, source.hf_config, shard.kv_cache_dtype, shard, label)
