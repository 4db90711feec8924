"""Continuous batching: which sequences compute how many tokens in the next step.

The rule. Each sequence's computed tokens catch up with its tokens: a step computes
``token_ids[num_computed_tokens : num_computed_tokens + k]`` of each scheduled sequence, and when
that reaches the end a token is sampled. Prefill, chunked prefill, prefix-cache hits and decode are
all this one move. A step has a token budget (``max_num_batched_tokens``) and at most
``max_num_seqs`` running sequences. Running sequences go first, oldest first, each taking
``min(uncomputed tokens, budget left)`` tokens, so a long prompt is split into chunks across steps.
A running sequence that cannot get its blocks preempts the newest running sequence not yet
scheduled in this step (itself, if it is the newest): the victim's blocks are freed, it goes back to
the front of the waiting queue and later recomputes (its full blocks are usually still cached).
Then, if nothing was preempted, waiting sequences are admitted in FCFS order while the budget, the
sequence slots and the blocks allow; the first one that doesn't fit stops admission (no skipping).

With prefix caching on, the samples 1..n-1 of a request wait until sample 0 has computed its prompt,
so they find its full blocks in the cache and share them; each computes its own partial last block.
A sequence that can never fit (more tokens than ``max_model_len`` or than the whole cache holds) is
finished with ``"length"`` and reported in ``SchedulerOutput.finished`` rather than block the queue.
Policy ``"priority"`` orders both queues by (priority, arrival), lower value first. Without chunked
prefill (pooling models) a waiting sequence is admitted only when all its tokens fit the step.

Between tenants (``Sequence.tenant``), waiting sequences are admitted by weighted fair queuing on
the tokens each tenant was served (``fair_share.FairQueue``): a tenant flooding the queue delays
only itself; the policy above orders each tenant's own queue. With one tenant nothing changes.

The plan says which blocks each sequence uses. A running sequence holds one of ``max_num_seqs``
block-table rows (taken when it is admitted, given back when it is preempted or finished), and each
scheduled sequence carries the entries its table gained since the last plan that included it
(``new_blocks`` from column ``first_new_block``; the whole table when it was just admitted). A
runner that applies every plan's entries to its own [rows, columns] array holds every running
sequence's table without being told when a sequence leaves: a row's next occupant rewrites it from
column 0, and columns past a sequence's blocks are never read.

Speculative decoding (``podium.spec``). A running sequence in decode (one token to compute) that
carries ``draft_token_ids`` computes that token and its drafts in one step (``drafts``), trimmed to
the budget, ``max_model_len`` and the blocks the sequences behind it may need (``_fit_drafts``). The
engine verifies them and sets ``num_accepted``; ``advance`` then counts only the real token and the
accepted drafts as computed and gives back the blocks that held nothing but rejected drafts.

LoRA (``lora_slots``, a ``lora.slots.SlotTable``). A sequence with an adapter runs only while its
adapter holds one of the device's slots: admission takes one (or stops, FCFS, when every slot is
held by an adapter some running sequence uses) and preemption or finishing gives it back. The
slots assigned in a step go out with its plan (``SchedulerOutput.lora_loads``).
"""

from __future__ import annotations

import itertools
from bisect import insort
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import SCHEDULING_POLICIES as POLICIES
from .fair_share import FairQueue
from .request import Sequence, SequenceStatus

_NO_BLOCKS: list[int] = []  # shared: most steps give a sequence no new block (never mutated)


@dataclass(init=False, slots=True)
class ScheduledSequence:
    """Compute ``seq.token_ids[start : start + num_new_tokens]`` this step (``start`` is
    ``seq.num_computed_tokens`` when scheduled); ``samples``: a token is sampled after them.
    ``row``: the sequence's block-table row; ``new_blocks``: the block ids its table gained since
    the last plan that carried it, from column ``first_new_block``. All are fixed when scheduled,
    so they still hold after ``advance``. ``drafts``: proposed tokens computed after the sequence's
    own (the last ``len(drafts)`` of ``num_new_tokens``); ``num_accepted``: how many of them the
    engine's verification kept."""

    seq: Sequence
    num_new_tokens: int
    start: int
    samples: bool
    row: int
    first_new_block: int
    new_blocks: list[int]
    drafts: list[int]
    num_accepted: int

    def __init__(self, seq: Sequence, num_new_tokens: int, drafts: list[int] = _NO_BLOCKS) -> None:
        # (one frame: built 256 times a step)
        self.seq = seq
        self.num_new_tokens = num_new_tokens
        self.drafts = drafts
        self.num_accepted = 0
        self.start = start = seq.num_computed_tokens
        self.samples = start + num_new_tokens - len(drafts) == len(seq.token_ids)
        self.row = seq.table_row
        table, planned = seq.block_table, seq.num_planned_blocks
        self.first_new_block = planned
        if planned == len(table):
            self.new_blocks = _NO_BLOCKS
        else:
            self.new_blocks = table[planned:]
            seq.num_planned_blocks = len(table)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    num_batched_tokens: int
    finished: list[Sequence] = field(default_factory=list)  # finished by the scheduler ("length")
    admitted: list[Sequence] = field(default_factory=list)  # moved from waiting to running this step
    lora_loads: list = field(default_factory=list)  # (slot, AdapterRef) assigned this step (lora.slots)
    lora_active: bool = False  # some running sequence has an adapter: the plan carries slots

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, token_budget: int, max_model_len: int,
                 policy: str = "fcfs", chunked_prefill: bool = True, lora_slots=None) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("token_budget", token_budget),
                            ("max_model_len", max_model_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.max_model_len = max_model_len
        self.policy = policy
        # False: a waiting sequence is admitted only with all its tokens in one step (a pooling
        # model's inputs; an encoder's attention needs the whole input at once)
        self.chunked_prefill = chunked_prefill
        if not chunked_prefill and token_budget < max_model_len:
            raise ValueError(f"without chunked prefill the token budget ({token_budget}) must hold a whole "
                             f"sequence of max_model_len={max_model_len} tokens")
        self.lora_slots = lora_slots  # a lora.slots.SlotTable where adapters are served, else None
        self.num_preemptions = 0
        self._max_seq_tokens = min(max_model_len, block_manager.capacity_tokens)
        self._running: list[Sequence] = []  # sorted by _order_key: the oldest first, the victim last
        self._waiting = FairQueue(self._order_key, keep_sorted=policy == "priority")
        self._held: dict[str, list[Sequence]] = {}  # request id -> samples waiting for sample 0's prompt
        self._leaders: dict[str, Sequence] = {}  # request id -> its sample 0, until its prompt is computed
        self._requests: dict[str, list[Sequence]] = {}  # request id -> its unfinished sequences
        self._arrival: dict[int, int] = {}  # seq id -> arrival rank
        self._ranks = itertools.count()
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # block-table rows, lowest taken first

    # ---- state -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + sum(len(held) for held in self._held.values())

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting or self._held)

    def queued_tokens(self) -> int:
        """Tokens every unfinished sequence still has to compute: the work ahead of a new request
        (prompts and chunks not yet prefilled, plus one token per decode). A waiting sequence's
        leading blocks that the prefix cache holds now are not counted: its admission will not
        compute them (a router weighs this against recomputing a prefix elsewhere)."""
        running = sum(len(seq.token_ids) - seq.num_computed_tokens for seq in self._running)
        cached = self.block_manager.num_cached_blocks
        size = self.block_manager.block_size
        waiting = itertools.chain(self._waiting, *self._held.values())
        return running + sum(len(seq.token_ids) - max(seq.num_computed_tokens, size * cached(seq)) for seq in waiting)

    def running_tokens(self) -> int:
        """Tokens of the running sequences (prompt and output so far): the decode load in KV tokens."""
        return sum(len(seq.token_ids) for seq in self._running)

    def running(self) -> list[Sequence]:
        """The running sequences, in scheduling order (a copy)."""
        return list(self._running)

    def waiting(self) -> list[Sequence]:
        """The waiting queue (by tenant, each in admission order), then samples held for their
        sample 0 (a copy)."""
        return [*self._waiting, *(s for held in self._held.values() for s in held)]

    def tenant_tokens(self) -> dict[str, int]:
        """Tokens scheduled per tenant so far (counted only once a second tenant appears)."""
        return self._waiting.tenant_tokens()

    # ---- requests in and out ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, no blocks, no computed tokens)."""
        if seq.seq_id in self._arrival:
            raise ValueError(f"seq: sequence {seq.seq_id} was already added")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"seq: sequence {seq.seq_id} must be new (WAITING, nothing computed, no blocks)")
        if not seq.token_ids:
            raise ValueError(f"seq: sequence {seq.seq_id} has no tokens")
        self._arrival[seq.seq_id] = next(self._ranks)
        self._requests.setdefault(seq.request_id, []).append(seq)
        if self._shares_prompt_blocks(seq):
            if seq.sample_index == 0:
                self._leaders[seq.request_id] = seq
            elif seq.request_id in self._leaders:
                self._held.setdefault(seq.request_id, []).append(seq)
                return
        self._enqueue(seq, front=False)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """End ``seq``: record why, free its blocks, take it off every queue. Idempotent."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            self._release_row(seq)
        elif not self._unhold(seq):
            self._waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)
        self._forget(seq)

    def abort(self, request_id: str, reason: str = "abort") -> list[Sequence]:
        """Finish every unfinished sequence of ``request_id`` with ``reason``; returns them."""
        seqs = list(self._requests.get(request_id, ()))
        for seq in seqs:
            self.finish(seq, reason)
        return seqs

    def reset(self) -> list[Sequence]:
        """Recovery after a failed step: every unfinished sequence goes back to waiting, in arrival
        order, as if preempted (nothing computed, no row, no blocks, trailing placeholders dropped).
        Block references are dropped without bookkeeping: the caller rebuilds the block manager
        (``BlockManager.release_all``). Returns the sequences."""
        seqs = sorted(itertools.chain.from_iterable(self._requests.values()), key=lambda s: self._arrival[s.seq_id])
        for queue in (self._running, self._waiting, self._held, self._leaders, self._requests, self._arrival):
            queue.clear()
        self._free_rows = list(range(self.max_num_seqs - 1, -1, -1))
        size = self.block_manager.block_size
        for seq in seqs:
            if seq.num_pending_tokens:
                del seq.token_ids[-seq.num_pending_tokens:]
                seq.num_pending_tokens = 0
            del seq.block_hashes[len(seq.token_ids) // size:]  # none may cover a placeholder
            if seq.status is SequenceStatus.RUNNING:
                seq.num_preemptions += 1
            seq.status, seq.num_computed_tokens, seq.block_table = SequenceStatus.WAITING, 0, []
            seq.table_row, seq.num_planned_blocks, seq.lora_slot = -1, 0, -1
            self.add(seq)
        if self.lora_slots is not None:
            self.lora_slots.reset()
        return seqs

    # ---- the step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(scheduled=[], preempted=[], num_batched_tokens=0)
        budget = self._schedule_running(self.token_budget, out)
        if self._waiting.multi_tenant:
            self._waiting.charge_plan(out.scheduled)
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        out.num_batched_tokens = self.token_budget - budget
        if self.lora_slots is not None:
            out.lora_loads = self.lora_slots.take_loads()
            out.lora_active = self.lora_slots.num_users > 0
        return out

    def advance(self, plan: SchedulerOutput) -> None:
        """The step ran: count its tokens as computed and cache the blocks that became full."""
        block_manager = self.block_manager
        size = block_manager.block_size if block_manager.enable_prefix_caching else 0
        for item in plan.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:  # finished (aborted) while the step ran
                continue
            computed = item.start + item.num_new_tokens
            if item.drafts:  # rejected drafts' slots are not computed: rewritten by later steps
                computed += item.num_accepted - len(item.drafts)
                block_manager.truncate(seq, len(seq.token_ids))
                seq.num_planned_blocks = min(seq.num_planned_blocks, len(seq.block_table))
            seq.num_computed_tokens = computed
            if size and computed // size != item.start // size:  # a block became full
                block_manager.commit(seq, item.start)
            if self._leaders and self._leaders.get(seq.request_id) is seq \
                    and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._release_held(seq.request_id)

    # ---- helpers -------------------------------------------------------------------------------

    def _schedule_running(self, budget: int, out: SchedulerOutput) -> int:
        running, allocate = self._running, self.block_manager.allocate
        block_size, scheduled = self.block_manager.block_size, out.scheduled
        index = 0
        while index < len(running) and budget > 0:
            seq = running[index]
            num_tokens = len(seq.token_ids)
            if num_tokens > self._max_seq_tokens:
                self._finish_unfit(seq, out)
                continue
            num_new = min(num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute until the engine appends its sampled token
                index += 1
                continue
            if seq.draft_token_ids and num_new == 1:
                drafts = self._fit_drafts(seq, budget, len(running) - index - 1)
                if drafts:
                    scheduled.append(ScheduledSequence(seq, 1 + len(drafts), drafts))
                    budget -= 1 + len(drafts)
                    index += 1
                    continue
            if seq.num_computed_tokens + num_new > len(seq.block_table) * block_size:  # needs a block
                while not allocate(seq, seq.num_computed_tokens + num_new):
                    if self._preempt_newest(out) is seq:
                        return budget
            scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            index += 1
        return budget

    def _fit_drafts(self, seq: Sequence, budget: int, num_behind: int) -> list[int]:
        """The drafts ``seq`` verifies this step: as many as the budget and ``max_model_len`` allow,
        in new blocks only while a free block stays for each of the ``num_behind`` running
        sequences after it (drafts never cost another sequence its step), else in the room its
        last block has left; [] for none."""
        block_manager, num_tokens = self.block_manager, len(seq.token_ids)
        room = min(len(seq.draft_token_ids), budget - 1, self.max_model_len - num_tokens)
        fresh = block_manager.blocks_for(num_tokens + room) - len(seq.block_table)
        if fresh > 0 and block_manager.num_free_blocks - fresh < num_behind:
            room = min(room, len(seq.block_table) * block_manager.block_size - num_tokens)
        if room <= 0 or not block_manager.allocate(seq, num_tokens + room):
            return []
        return seq.draft_token_ids[:room]

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        block_manager, waiting = self.block_manager, self._waiting
        while waiting and budget > 0 and len(self._running) < self.max_num_seqs:
            seq = waiting.head()
            if seq.num_tokens > self._max_seq_tokens:
                self._finish_unfit(seq, out)
                continue
            hits = block_manager.lookup(seq)
            num_cached = len(hits) * block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            if num_new < seq.num_tokens - num_cached and not self.chunked_prefill:
                break  # it fits a later step's budget whole
            if self.lora_slots is not None and not self.lora_slots.acquire(seq):
                break  # every adapter slot is in use by another adapter: it waits for one (lora.slots)
            if not block_manager.admit(seq, hits, num_cached + num_new):
                if self.lora_slots is not None:
                    self.lora_slots.release(seq)
                break
            waiting.pop_head()
            if waiting.multi_tenant:
                waiting.charge(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            seq.table_row = self._free_rows.pop()
            insort(self._running, seq, key=self._order_key)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            out.admitted.append(seq)
            budget -= num_new
        return budget

    def _preempt_newest(self, out: SchedulerOutput) -> Sequence:
        seq = self._running.pop()
        self._release_row(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, front=True)
        out.preempted.append(seq)
        return seq

    def _release_row(self, seq: Sequence) -> None:
        """``seq`` stops running: its row (and adapter slot) go back, and its next admission plans its table anew."""
        self._free_rows.append(seq.table_row)
        seq.table_row = -1
        seq.num_planned_blocks = 0
        if self.lora_slots is not None:
            self.lora_slots.release(seq)

    def _finish_unfit(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.finish(seq, "length")
        out.finished.append(seq)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        self._waiting.push(seq, front)

    def _order_key(self, seq: Sequence) -> int | tuple[int, int]:
        rank = self._arrival[seq.seq_id]
        return (seq.priority, rank) if self.policy == "priority" else rank

    def _shares_prompt_blocks(self, seq: Sequence) -> bool:
        """Whether ``seq``'s samples gain from waiting for sample 0 (it has a full prompt block)."""
        return (self.block_manager.enable_prefix_caching and seq.params.n > 1
                and seq.num_prompt_tokens > self.block_manager.block_size)

    def _release_held(self, request_id: str) -> None:
        """Sample 0 of ``request_id`` has its prompt computed (or is gone): queue its siblings
        ahead of later requests."""
        self._leaders.pop(request_id, None)
        held = self._held.pop(request_id, [])
        for seq in reversed(held):
            self._enqueue(seq, front=True)

    def _unhold(self, seq: Sequence) -> bool:
        held = self._held.get(seq.request_id)
        if held is None or seq not in held:
            return False
        held.remove(seq)
        if not held:
            del self._held[seq.request_id]
        return True

    def _forget(self, seq: Sequence) -> None:
        del self._arrival[seq.seq_id]
        siblings = self._requests[seq.request_id]
        siblings.remove(seq)
        if not siblings:
            del self._requests[seq.request_id]
        if self._leaders.get(seq.request_id) is seq:
            self._release_held(seq.request_id)
