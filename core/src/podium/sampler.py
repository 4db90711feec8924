"""Choose the next token of every sequence that samples this step, vectorised over the batch.

One row of ``logits`` per sequence, in order. The processing order follows vLLM:

    raw logits --(logprobs are taken here: log_softmax of the raw model output)
      -> grammar mask (structured output: disallowed tokens -inf) -> logit_bias
      -> min_tokens (EOS / stop ids masked) -> repetition penalty (prompt + output)
      -> presence / frequency penalties (output) -> greedy rows: argmax
      -> temperature -> top-k / top-p (platform op) -> min-p -> random draw

The random draw is by inverse CDF: one uniform number u per row, the token is the first whose
running probability sum exceeds ``u * total`` (one random number per row, where an exponential race
would need one per vocabulary entry: much cheaper on a CPU). A seeded row's u is a counter-based
random stream: a hash of (seed, sample index, output position), so a seed gives the same text
whatever else is in the batch (or after a preemption), sample indices of one seed differ, and all
seeded rows of a step cost one host-to-device copy, no per-row kernel. Unseeded rows share one
torch generator (seeded from the engine seed) and one vectorised draw. In the batch-invariant mode the
running sums are whole units of probability (``exact_draw``), the same in any summation order.

Per-sequence state (seed key, penalty counts) lives here, keyed by ``seq_id``, until ``forget``.
Penalty counts sit in persistent rows of one [slots, V] tensor and are updated each step with only
the tokens appended since the last step. ``sample`` may modify ``logits`` in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from podium_plugin_api.ops import apply_token_bitmask as reference_apply_token_bitmask
from podium_plugin_api.ops import argmax as reference_argmax
from podium_plugin_api.ops import top_k_top_p as reference_top_k_top_p

from .errors import StepFault
from .exact_draw import exact_inverse_cdf
from .outputs import Logprob, PositionLogprobs
from .request import Sequence
from .structured import GrammarMasks, PendingTokens

GREEDY_TEMPERATURE = 1e-5  # at or below this temperature a row is greedy (as in vLLM)
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64: a bijective 64-bit hash whose outputs pass statistical tests for randomness."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(key: int, position: int) -> float:
    """The uniform number in [0, 1) of a seeded stream ``key`` at output ``position``."""
    return (_mix64(key ^ position) >> 11) * 2.0**-53


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


@dataclass
class _SeqState:
    """What the sampler keeps for one sequence between steps (its params never change)."""

    plain: bool  # greedy with nothing to apply: the argmax of the raw logits is the answer
    greedy: bool
    seed_key: int | None  # the random stream of a seeded, non-greedy sequence
    bias_ids: list[int]
    bias_values: list[float]
    min_token_mask: list[int]  # ids masked while num_output_tokens < min_tokens
    constrained: bool = False  # structured output: a grammar masks its logits
    slot: int = -1  # row in the penalty counts, -1: no penalties
    counted: int = 0  # tokens of seq.token_ids already in its counts


@dataclass
class _Batch:
    """This step's per-row parameters, gathered on the host in one pass over the sequences."""

    greedy: list[bool] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    edit_rows: list[int] = field(default_factory=list)  # (row, token, value) edits: bias and min_tokens masks
    edit_ids: list[int] = field(default_factory=list)
    edit_values: list[float] = field(default_factory=list)
    penalty_rows: list[int] = field(default_factory=list)
    seeded_rows: list[int] = field(default_factory=list)
    seeded_uniforms: list[float] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)
    logprob_k: list[int] = field(default_factory=list)
    grammar_rows: list[int] = field(default_factory=list)


class _TokenCounts:
    """Persistent per-sequence token statistics: output counts [S, V] int32, prompt mask [S, V] bool."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.free: list[int] = []

    def acquire(self, prompt_token_ids: list[int]) -> int:
        if not self.free:
            old = self.counts.shape[0]
            new = max(8, 2 * old)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.vocab_size)])
            self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(new - old, self.vocab_size)])
            self.free = list(range(new - 1, old - 1, -1))
        slot = self.free.pop()
        self.counts[slot] = 0
        self.in_prompt[slot] = False
        if prompt_token_ids:
            self.in_prompt[slot, torch.tensor(prompt_token_ids, device=self.device)] = True
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def add(self, slots: list[int], token_ids: list[int]) -> None:
        """counts[slots[i], token_ids[i]] += 1 for every i, in one scatter."""
        if token_ids:
            index = torch.tensor([slots, token_ids], device=self.device)  # [2, M]
            ones = torch.ones(len(token_ids), dtype=torch.int32, device=self.device)
            self.counts.index_put_((index[0], index[1]), ones, accumulate=True)


class Sampler:
    def __init__(self, vocab_size: int, device, ops: dict | None = None, eos_token_ids=(), seed: int = 0,
                 batch_invariant: bool = False) -> None:
        """``batch_invariant``: the draw sums probabilities as integers (``exact_draw``), so a row's
        token does not depend on how the device orders a float running sum for the batch's shape."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.batch_invariant = batch_invariant
        self.device = torch.device(device)
        self.eos_token_ids = [int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size]
        self.seed = seed
        self._top_k_top_p = (ops or {}).get("top_k_top_p", reference_top_k_top_p)
        # the platform's argmax where it has one (a GPU's multi-program kernel); else first_argmax
        argmax = (ops or {}).get("argmax", reference_argmax)
        self._argmax = first_argmax if argmax is reference_argmax else argmax
        self._states: dict[int, _SeqState] = {}
        self._counts = _TokenCounts(vocab_size, self.device)
        self._grammars = GrammarMasks(vocab_size, (ops or {}).get("apply_token_bitmask", reference_apply_token_bitmask))
        self._generator: torch.Generator | None = None  # shared by unseeded rows; made on first use

    # -- per-sequence state ----------------------------------------------------------------------
    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's state (seed key, penalty counts)."""
        state = self._states.pop(seq_id, None)
        if state is not None and state.slot >= 0:
            self._counts.release(state.slot)
        if state is not None and state.constrained:
            self._grammars.forget(seq_id)

    def _state(self, seq: Sequence) -> _SeqState:
        state = self._states.get(seq.seq_id)
        if state is None:
            try:
                state = self._states[seq.seq_id] = self._new_state(seq)
            except Exception as exc:  # this request's parameters: the engine aborts it alone
                raise StepFault(seq.request_id, f"sampling state: {type(exc).__name__}: {exc}") from exc
        return state

    def _new_state(self, seq: Sequence) -> _SeqState:
        p, vocab = seq.params, self.vocab_size
        bias = p.logit_bias or {}
        bad = [t for t in bias if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias has token id(s) {bad[:5]} outside the vocabulary (size {vocab})")
        masked = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
        masked = sorted({t for t in masked if 0 <= t < vocab}) if p.min_tokens > 0 else []
        greedy = p.temperature <= GREEDY_TEMPERATURE
        penalised = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        seed_key = None
        if p.seed is not None and not greedy:
            seed_key = _mix64(_mix64(p.seed & _MASK64) ^ seq.sample_index)
        constrained = seq.grammar is not None
        plain = greedy and not bias and not masked and not penalised and p.logprobs is None and not constrained
        state = _SeqState(plain, greedy, seed_key, list(bias), list(bias.values()), masked, constrained)
        if penalised:
            state.slot = self._counts.acquire(seq.prompt_token_ids)
            state.counted = seq.num_prompt_tokens
        return state

    # -- sampling --------------------------------------------------------------------------------
    def can_defer(self, seqs: list[Sequence], grammars: bool = True) -> bool:
        """Whether ``sample_device`` serves these sequences: none keeps penalty counts or wants
        logprobs, which need every previous token on the host. A grammar's matcher does too, but
        only at sampling time, after the step's forward is launched: ``pending`` hands it the
        previous step's tokens then (``grammars=False``: keep constrained rows out anyway)."""
        for seq in seqs:
            state = self._state(seq)
            if state.slot >= 0 or (state.constrained and not grammars) or seq.params.logprobs is not None:
                return False
        return True

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], pending: PendingTokens | None = None) -> SamplerOutput:
        """logits [N, V] (any float dtype), one row per sequence in ``seqs`` -> one token (and
        logprobs) each. Plain greedy rows take the argmax of the logits as they come; everything
        else computes in float32. ``pending``: the tokens of a step still in flight (seq_id -> token),
        read only when a constrained sequence ends in such a placeholder."""
        self._check(logits, seqs)
        states = [self._state(s) for s in seqs]
        if all(st.plain for st in states):  # the common greedy case: nothing but an argmax
            return SamplerOutput(self._argmax(logits).tolist(), [None] * len(seqs))
        logits = logits.float()
        batch = self._gather(seqs, states)
        raw_logprobs = None
        if batch.logprob_rows:  # [L, V], taken before any edit below
            rows = torch.tensor(batch.logprob_rows, device=logits.device)
            raw_logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
        tokens = self._tokens(logits, seqs, states, batch, pending)  # [N]
        logprobs: list[PositionLogprobs | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            chosen = tokens.index_select(0, rows)  # [L]
            for row, entry in zip(batch.logprob_rows, position_logprobs(raw_logprobs, chosen, batch.logprob_k)):
                logprobs[row] = entry
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, logprobs)

    @torch.inference_mode()
    def greedy_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int] | None:
        """Every row's argmax (rows of the ``seqs`` in any number each) when all of them are plain
        greedy, whose token depends on nothing but the row's logits; else None."""
        if not all(self._state(s).plain for s in seqs):
            return None
        return self._argmax(logits).tolist()

    @torch.inference_mode()
    def sample_device(self, logits: torch.Tensor, seqs: list[Sequence],
                      pending: PendingTokens | None = None) -> torch.Tensor:
        """The tokens [N] (long, on the logits' device) without waiting for them: no host sync
        (but for constrained rows, which wait for ``pending`` while this step's forward runs).
        Only for sequences ``can_defer`` accepts (no penalties, no logprobs)."""
        self._check(logits, seqs)
        states = [self._state(s) for s in seqs]
        if all(st.plain for st in states):
            return self._argmax(logits)
        return self._tokens(logits.float(), seqs, states, self._gather(seqs, states), pending)

    def _check(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(seqs) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [{len(seqs)}, {self.vocab_size}] (sequences, vocab), "
                             f"got {list(logits.shape)}")

    def _tokens(self, logits: torch.Tensor, seqs: list[Sequence], states: list[_SeqState], batch: _Batch,
                pending: PendingTokens | None = None) -> torch.Tensor:
        """Grammar masks, edits (bias, min_tokens), penalties, then the choice of each row -> [N]."""
        if batch.grammar_rows:
            self._grammars.apply(logits, batch.grammar_rows, [seqs[r] for r in batch.grammar_rows], pending)
        if batch.edit_rows:
            index = _on(logits.device, [batch.edit_rows, batch.edit_ids])  # [2, M]
            values = _on(logits.device, batch.edit_values, logits.dtype)
            logits.index_put_((index[0], index[1]), values, accumulate=True)
        if batch.penalty_rows:
            self._apply_penalties(logits, seqs, states, batch.penalty_rows)
        return self._choose(logits, batch)

    def _gather(self, seqs: list[Sequence], states: list[_SeqState]) -> _Batch:
        b = _Batch()
        for row, (seq, st) in enumerate(zip(seqs, states)):
            p = seq.params
            b.greedy.append(st.greedy)
            b.temperature.append(1.0 if st.greedy else p.temperature)
            b.top_k.append(p.top_k)
            b.top_p.append(p.top_p)
            b.min_p.append(p.min_p)
            if st.bias_ids:
                b.edit_rows += [row] * len(st.bias_ids)
                b.edit_ids += st.bias_ids
                b.edit_values += st.bias_values
            if st.min_token_mask and seq.num_output_tokens < p.min_tokens:
                b.edit_rows += [row] * len(st.min_token_mask)
                b.edit_ids += st.min_token_mask
                b.edit_values += [float("-inf")] * len(st.min_token_mask)
            if st.slot >= 0:
                b.penalty_rows.append(row)
            if st.constrained:
                b.grammar_rows.append(row)
            if st.seed_key is not None:
                b.seeded_rows.append(row)
                b.seeded_uniforms.append(seeded_uniform(st.seed_key, seq.num_output_tokens))
            if p.logprobs is not None:
                b.logprob_rows.append(row)
                b.logprob_k.append(p.logprobs)
        return b

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence], states: list[_SeqState],
                         rows: list[int]) -> None:
        """Repetition (HF: over prompt + output), presence and frequency (OpenAI: over output)."""
        slots, new_ids = [], []
        for row in rows:  # bring each sequence's counts up to date with its new tokens
            seq, st = seqs[row], states[row]
            fresh = seq.token_ids[st.counted:]
            slots += [st.slot] * len(fresh)
            new_ids += fresh
            st.counted = seq.num_tokens
        self._counts.add(slots, new_ids)
        device = logits.device
        slot_index = torch.tensor([states[r].slot for r in rows], device=device)
        counts = self._counts.counts.index_select(0, slot_index)  # [R, V] int32
        params = [seqs[r].params for r in rows]
        repetition = frequency = presence = in_prompt = None  # None: no row of this batch uses it
        if any(p.repetition_penalty != 1.0 for p in params):
            in_prompt = self._counts.in_prompt.index_select(0, slot_index)  # [R, V] bool
            repetition = torch.tensor([p.repetition_penalty for p in params], device=device)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
            presence = torch.tensor([p.presence_penalty for p in params], device=device)
        row_index = torch.tensor(rows, device=device)
        penalised = apply_penalties(logits.index_select(0, row_index), counts, in_prompt, repetition, frequency, presence)
        logits.index_copy_(0, row_index, penalised.to(logits.dtype))

    def _choose(self, logits: torch.Tensor, b: _Batch) -> torch.Tensor:
        """Greedy rows: argmax; the others: temperature, top-k/top-p, min-p, then the draw. -> [N]"""
        device = logits.device
        greedy_tokens = self._argmax(logits) if any(b.greedy) else None  # [N]
        if all(b.greedy):
            return greedy_tokens
        temperature = _on(device, b.temperature, logits.dtype)
        top_k = top_p = min_p = None
        if any(k > 0 for k in b.top_k) or any(p < 1.0 for p in b.top_p):
            top_k, top_p = _on(device, b.top_k), _on(device, b.top_p)
        if any(m > 0.0 for m in b.min_p):
            min_p = _on(device, b.min_p)
        probs = sampling_probs(logits, temperature, top_k, top_p, min_p, self._top_k_top_p)  # [N, V]
        sampled = self._draw(probs, b.seeded_rows, b.seeded_uniforms)  # [N]
        if greedy_tokens is None:
            return sampled
        return torch.where(_on(device, b.greedy), greedy_tokens, sampled)

    def _draw(self, probs: torch.Tensor, seeded_rows: list[int], seeded_uniforms: list[float]) -> torch.Tensor:
        """One token per row of probs [N, V] (>= 0, unnormalised) by inverse CDF -> [N] long.

        Each row needs one uniform number: seeded rows bring theirs, the others share one
        vectorised draw. A token of probability 0 adds nothing to the running sum, so it can never
        be the first entry above the target.
        """
        rows, device = probs.shape[0], probs.device
        if seeded_rows:  # [S, 1]
            seeded = torch.tensor(seeded_uniforms, dtype=torch.float32)[:, None].to(device, non_blocking=True)
        if len(seeded_rows) == rows:
            uniform = seeded  # [N, 1]
        else:
            if self._generator is None:
                self._generator = torch.Generator(device=self.device)
                self._generator.manual_seed(self.seed % 2**64)
            uniform = torch.empty(rows, 1, device=device).uniform_(generator=self._generator)  # [N, 1]
            if seeded_rows:
                uniform.index_copy_(0, torch.tensor(seeded_rows).to(device, non_blocking=True), seeded)
        if self.batch_invariant:
            return exact_inverse_cdf(probs, uniform)
        cdf = probs.cumsum(dim=-1)  # [N, V]
        total = cdf[:, -1:]  # [N, 1]
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [N]
        return tokens.clamp_(max=probs.shape[1] - 1)  # only a row of NaNs could run past the end

    # -- prompt logprobs -------------------------------------------------------------------------
    @torch.inference_mode()
    def prompt_logprobs(self, logits: torch.Tensor, token_ids: list[int], k: int) -> list[PositionLogprobs]:
        """logits [P, V] where row i predicts ``token_ids[i]`` -> that token's logprob and rank plus
        the top-k, per row. (The caller adds the ``None`` for a prompt's first position.)"""
        if logits.dim() != 2 or logits.shape[0] != len(token_ids):
            raise ValueError(f"logits must have one row per token id ({len(token_ids)}), got {list(logits.shape)}")
        if not token_ids:
            return []
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [P, V]
        chosen = torch.tensor(token_ids, device=logits.device)
        return position_logprobs(logprobs, chosen, [k] * len(token_ids))


def _on(device: torch.device, values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a tensor on ``device``, copied without waiting for the device's queue (a
    ``torch.tensor(..., device=gpu)`` would synchronise the stream and stall async scheduling)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


ARGMAX_CHUNK = 512


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [N, V] logits, in two passes that vectorise on a CPU.

    torch's CPU argmax over a long row runs ~10x slower than a max (2.7 ms against 0.26 ms for
    32 x 49152 float32 here), so: the max of each 512-wide chunk, the first chunk holding the row's
    max, then the argmax inside that chunk; a ragged tail is compared last. Same answer as argmax:
    the first index of the maximum, NaN counting as the maximum. [N, V] -> [N] int64.
    """
    n, vocab = logits.shape
    main = vocab - vocab % ARGMAX_CHUNK
    if main < 2 * ARGMAX_CHUNK or logits.device.type != "cpu":  # (other devices' argmax is fast)
        return logits.argmax(dim=-1)
    chunks = logits[:, :main].view(n, main // ARGMAX_CHUNK, ARGMAX_CHUNK)  # [N, C, 512]
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [N]
    rows = torch.arange(n, device=logits.device)
    index = best_chunk * ARGMAX_CHUNK + chunks[rows, best_chunk].argmax(dim=-1)  # [N]
    if main == vocab:
        return index
    tail_index = logits[:, main:].argmax(dim=-1) + main  # [N]
    best, tail_best = logits[rows, index], logits[rows, tail_index]
    later = (tail_best > best) | (tail_best.isnan() & ~best.isnan())  # ties keep the earlier index
    return torch.where(later, tail_index, index)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor | None,
                    repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                    presence: torch.Tensor | None) -> torch.Tensor:
    """Penalised logits [R, V] (a new tensor).

    counts [R, V]: how often each token occurs in the output; in_prompt [R, V] bool: whether it
    occurs in the prompt; repetition / frequency / presence [R] (None: off for every row).
    Repetition (Hugging Face) divides the positive and multiplies the negative logits of every
    token seen in prompt or output; frequency and presence (OpenAI) subtract
    ``frequency * count + presence * (count > 0)``.
    """
    in_output = counts > 0  # [R, V]
    if repetition is not None:
        rep = repetition[:, None]  # [R, 1]
        seen = in_output | in_prompt if in_prompt is not None else in_output
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if frequency is not None:
        logits = logits - frequency[:, None] * counts
    if presence is not None:
        logits = logits - presence[:, None] * in_output
    return logits


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None = None,
                   top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None,
                   top_k_top_p=reference_top_k_top_p) -> torch.Tensor:
    """The distribution to draw from: logits [N, V] (divided in place by temperature [N]) ->
    probabilities [N, V] float32, unnormalised where min-p cut, exactly 0 outside each row's
    top-k / top-p / min-p set. ``None`` turns a filter off for every row; per row, top_k <= 0,
    top_p = 1 and min_p = 0 are off."""
    logits = logits.div_(temperature[:, None])
    if top_k is not None or top_p is not None:
        rows = logits.shape[0]
        top_k = top_k if top_k is not None else torch.zeros(rows, dtype=torch.long, device=logits.device)
        top_p = top_p if top_p is not None else torch.ones(rows, device=logits.device)
        logits = top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, V]
    if min_p is not None:  # keep tokens at least min_p times as likely as the most likely one
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def position_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[PositionLogprobs]:
    """logprobs [L, V] (log-softmaxed), chosen [L] token ids, top-k per row -> one dict per row: the
    chosen token first (rank = 1 + number of tokens strictly more likely), then the top-k by rank."""
    chosen = chosen.reshape(-1, 1)  # [L, 1]
    chosen_lp = logprobs.gather(1, chosen)  # [L, 1]
    ranks = (logprobs > chosen_lp).sum(dim=-1, keepdim=True)  # [L, 1]
    k_max = min(max(ks), logprobs.shape[1])
    values, ids = logprobs.topk(k_max, dim=-1)  # [L, k_max]
    # one transfer: float32 holds token ids and ranks exactly (< 2**24)
    packed = torch.cat([chosen.float(), chosen_lp, ranks.float() + 1, values, ids.float()], dim=1).tolist()
    out = []
    for row, k in zip(packed, ks):
        entry = {int(row[0]): Logprob(row[1], int(row[2]))}
        for j in range(min(k, k_max)):
            entry.setdefault(int(row[3 + k_max + j]), Logprob(row[3 + j], j + 1))
        out.append(entry)
    return out
