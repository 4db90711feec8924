"""``Speculator``: speculative decoding as the engine drives it, one call per phase of a step.

    propose(running)   before planning: each running sequence in decode gets its drafts (n-gram)
                       or k reserved slots (a drafter that is ready for it), as many as it can
                       still output
    draft(plan)        after planning, before the target's forward: a drafter fills the reserved
                       drafts the scheduler kept
    (the target verifies: ``verify``; ``record`` counts each sequence's verification)
    observe(plan, h)   after booking and ``Scheduler.advance``: a drafter sees the step (EAGLE
                       mirrors it into its head's cache)

``draft_companion`` builds a drafter's model on the target's device (``ModelShard``'s companion),
refusing what it cannot run. The n-gram proposer also looks the request's predicted output up
(``SamplingParams.prediction``, tokenized once when the request is added).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import InvalidParameter
from ..request import Sequence
from ..scheduler import SchedulerOutput
from .config import SpeculativeConfig
from .draft_device import DraftDevice
from .metrics import SpecDecodingStats
from .ngram import NgramProposer
from .proposer import Drafter, Proposer


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None) -> None:
        self.config, self.k = config, config.num_speculative_tokens
        self.stats = SpecDecodingStats()
        self.proposer: Proposer | None = NgramProposer(config) if drafter is None else None
        self.drafter = drafter
        self._predictions: dict[int, list[int]] = {}  # seq id -> its request's predicted output tokens

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def reads_predictions(self) -> bool:
        """Whether a request's predicted output changes what is proposed (n-gram lookup only)."""
        return self.proposer is not None

    def add(self, seqs: list[Sequence], prediction: str | list[int] | None, tokenizer) -> None:
        """A new request's sequences; ``prediction``: its predicted output (text or token ids), kept
        as tokens where the proposer reads it (InvalidParameter: text without a tokenizer)."""
        if not prediction or not self.reads_predictions:
            return
        if isinstance(prediction, str):
            if tokenizer is None:
                raise InvalidParameter("this model has no tokenizer to read the prediction's text; give its token "
                                       "ids", param="prediction")
            prediction = tokenizer.encode(prediction, add_special_tokens=False)
        tokens = [int(t) for t in prediction]
        for seq in seqs:
            self._predictions[seq.seq_id] = tokens

    def forget(self, seq: Sequence) -> None:
        self._predictions.pop(seq.seq_id, None)
        if self.drafter is not None:
            self.drafter.forget(seq)

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Drafts (or reserved draft slots) for each running sequence in decode (module docstring)."""
        proposer, drafter = self.proposer, self.drafter
        for seq in running:
            k = self.k if seq.num_uncomputed_tokens == 1 else 0
            max_tokens = seq.params.max_tokens
            if k and max_tokens is not None:
                k = min(k, max_tokens - seq.num_output_tokens - 1)  # the step's bonus token is one more
            k = min(k, max_model_len - seq.num_tokens)
            if k <= 0:
                seq.draft_token_ids = []
            elif proposer is not None:
                seq.draft_token_ids = proposer.propose(seq.token_ids, k, self._predictions.get(seq.seq_id),
                                                       seq.num_output_tokens)
            else:
                seq.draft_token_ids = [0] * k if drafter.ready(seq) else []  # filled by ``draft``

    def draft(self, plan: SchedulerOutput) -> None:
        if self.drafter is not None and plan.scheduled:
            self.drafter.draft(plan)

    def observe(self, plan: SchedulerOutput, hidden) -> None:
        if self.drafter is not None:
            self.drafter.observe(plan, hidden)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)


def draft_companion(spec: SpeculativeConfig | None, config, quantization_methods) -> Callable | None:
    """``ModelShard``'s companion for a drafter's method (None for n-gram or no speculation): it
    builds the draft model or head once the target's weights are in, checked against the target."""
    if spec is None or not spec.uses_model:
        return None
    if config.tensor_parallel_size > 1:
        raise ValueError(f"speculative_config method {spec.method!r} with tensor_parallel_size="
                         f"{config.tensor_parallel_size}: a draft model or head runs on one device only; use "
                         "tensor_parallel_size=1, or method 'ngram' (which runs with tensor parallelism)")

    def build(shard) -> DraftDevice:
        if spec.method == "draft_model":
            from ..loader import resolve_model
            from .draft_model import check_shared_vocabulary, load_draft_model

            source = resolve_model(spec.model, None, config.tokenizer_cache)
            limit = check_shared_vocabulary(source, shard.source, spec.model)
            device = load_draft_model(source, shard, quantization_methods, spec.model)
            device.vocab_limit = limit
            return device
        from .eagle_loader import load_eagle_head

        # the head's static hidden buffers hold a whole step (padded shapes included)
        rows = 2 * (shard.token_budget + config.max_num_seqs)
        return load_eagle_head(spec, shard, rows)

    return build


def build_speculator(spec: SpeculativeConfig | None, companion: DraftDevice | None,
                     max_num_seqs: int) -> Speculator | None:
    if spec is None:
        return None
    if not spec.uses_model:
        return Speculator(spec)
    if spec.method == "draft_model":
        from .draft_model import DraftModelProposer

        return Speculator(spec, DraftModelProposer(companion, spec.num_speculative_tokens, companion.vocab_limit))
    from .eagle import EagleProposer

    return Speculator(spec, EagleProposer(companion, spec.method, spec.num_speculative_tokens, max_num_seqs))
