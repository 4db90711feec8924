"""The scheduler, driven by a simulated engine loop: budgets, chunked prefill, preemption, sharing
for n > 1, no leaks. A fake KV store checks that every token a step reads holds the K/V of exactly
its prefix, so a wrong prefix hit or a write into a shared block fails the test. The loop reads
block ids the way the runner does: from a block-table array kept from the plans' rows and
new-block entries alone, so a plan that misstates a sequence's blocks fails the same check."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from podium.block_manager import BlockManager
from podium.request import Sequence, SequenceStatus
from podium.runner.block_table import BlockTable
from podium.runner.plan import plan_step
from podium.sampling_params import SamplingParams
from podium.scheduler import ScheduledSequence, Scheduler, SchedulerOutput

_seq_ids = itertools.count()


def make_request(tokens, n: int = 1, max_tokens: int = 4, request_id: str | None = None,
                 priority: int = 0) -> list[Sequence]:
    request_id = request_id or f"req{next(_seq_ids)}"
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return [Sequence(seq_id=next(_seq_ids), request_id=request_id, sample_index=i, prompt_token_ids=list(tokens),
                     params=params, priority=priority) for i in range(n)]


class Engine:
    """The engine loop without a model: schedule, 'compute' into a fake KV store, advance, append
    a token to sampled sequences, finish after max_tokens."""

    def __init__(self, num_blocks: int, block_size: int = 4, max_num_seqs: int = 8, token_budget: int = 64,
                 max_model_len: int = 1024, prefix_caching: bool = True, policy: str = "fcfs") -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, token_budget, max_model_len, policy=policy)
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> the prefix it encodes
        self.live: list[Sequence] = []
        self.done: list[Sequence] = []
        self.plans: list[SchedulerOutput] = []
        self.table = BlockTable(max_num_seqs, -(-max_model_len // block_size))  # what a runner holds

    def add(self, seqs: list[Sequence]) -> list[Sequence]:
        for seq in seqs:
            self.sched.add(seq)
            self.live.append(seq)
        return seqs

    def step(self) -> SchedulerOutput:
        plan = self.sched.schedule()
        self.check_plan(plan)
        self.table.apply(plan_step(plan).new_blocks)
        for item in plan.scheduled:
            self.compute(item)
        self.sched.advance(plan)
        for item in plan.scheduled:
            seq = item.seq
            if item.samples and not seq.is_finished:
                seq.append_token(fake_token(seq))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.finish(seq, "length")
        self.collect()
        self.plans.append(plan)
        check_block_invariants(self.bm, self.live)
        return plan

    def run(self, max_steps: int = 1000) -> int:
        for steps in range(1, max_steps + 1):
            self.step()
            if not self.sched.has_unfinished():
                return steps
        raise AssertionError("the scheduler did not finish every request")

    def abort(self, request_id: str) -> list[Sequence]:
        seqs = self.sched.abort(request_id)
        self.collect()
        check_block_invariants(self.bm, self.live)
        return seqs

    def collect(self) -> None:
        self.done += [s for s in self.live if s.is_finished]
        self.live = [s for s in self.live if not s.is_finished]

    def compute(self, item: ScheduledSequence) -> None:
        seq, size = item.seq, self.bm.block_size
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
        assert len(seq.block_table) * size >= end, "the block table must cover the scheduled tokens"
        table = self.table.array[item.row].tolist()  # the blocks as the runner sees them
        assert table[:len(seq.block_table)] == seq.block_table, "the plans misstate the sequence's blocks"
        for pos in range(start):  # what attention reads
            assert self.kv.get((table[pos // size], pos % size)) == tuple(seq.token_ids[:pos + 1])
        for pos in range(start, end):  # what the step writes
            self.kv[(table[pos // size], pos % size)] = tuple(seq.token_ids[:pos + 1])

    def check_plan(self, plan: SchedulerOutput) -> None:
        sched = self.sched
        news = [item.num_new_tokens for item in plan.scheduled]
        assert plan.num_batched_tokens == sum(news) <= sched.token_budget
        assert all(n >= 1 for n in news)
        assert len({id(item.seq) for item in plan.scheduled}) == len(plan.scheduled)
        assert not {id(s) for s in plan.preempted} & {id(item.seq) for item in plan.scheduled}
        assert sched.num_running <= sched.max_num_seqs
        rows = [s.table_row for s in sched.running()]
        assert len(set(rows)) == len(rows) and all(0 <= r < sched.max_num_seqs for r in rows)  # one row each
        for item in plan.scheduled:
            assert item.row == item.seq.table_row
            assert item.seq.status is SequenceStatus.RUNNING
            assert item.samples == (item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens)


def fake_token(seq: Sequence) -> int:
    """A deterministic 'sample' that depends on the sequence's tokens and its sample index."""
    return (sum(seq.token_ids[-3:]) * 7 + seq.sample_index * 3 + seq.num_tokens) % 5


def check_block_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    held = Counter(b for seq in live for b in seq.block_table)
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == [held.get(b, 0) for b in range(bm.num_blocks)]
    free, evictable = bm.free_block_ids(), bm.evictable_block_ids()
    assert len(set(free)) == len(free) and len(set(evictable)) == len(evictable)
    assert not set(free) & set(evictable) and not (set(free) | set(evictable)) & set(held)
    assert len(free) + len(evictable) + len(held) == bm.num_blocks
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table)
        if seq.status is SequenceStatus.WAITING:
            assert seq.block_table == [] and seq.num_computed_tokens == 0


def assert_all_free(engine: Engine) -> None:
    assert not engine.sched.has_unfinished() and engine.sched.num_running == 0 and engine.sched.num_waiting == 0
    assert engine.bm.num_free_blocks == engine.bm.num_blocks and engine.bm.usage == 0.0


# ---- budgets and chunks ----------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    engine = Engine(num_blocks=32, token_budget=10)
    (seq,) = engine.add(make_request(range(25), max_tokens=2))
    chunks = [engine.step() for _ in range(3)]
    assert [[(i.seq, i.num_new_tokens, i.samples) for i in p.scheduled] for p in chunks] == [
        [(seq, 10, False)], [(seq, 10, False)], [(seq, 5, True)]]
    assert seq.num_output_tokens == 1
    assert engine.run() == 1 and seq.finish_reason == "length" and seq.num_output_tokens == 2
    assert_all_free(engine)


def test_running_first_then_waiting_fcfs_and_budget_is_shared():
    engine = Engine(num_blocks=64, token_budget=12)
    (a,) = engine.add(make_request(range(8), max_tokens=5))
    engine.step()  # a: 8 prompt tokens
    (b,) = engine.add(make_request(range(100, 120), max_tokens=2))
    (c,) = engine.add(make_request(range(200, 203), max_tokens=2))
    plan = engine.step()
    assert [(i.seq, i.num_new_tokens) for i in plan.scheduled] == [(a, 1), (b, 11)]  # c waits: no budget left
    plan = engine.step()
    assert [(i.seq, i.num_new_tokens) for i in plan.scheduled] == [(a, 1), (b, 9), (c, 2)]
    engine.run()
    assert_all_free(engine)


def test_max_num_seqs_is_respected():
    engine = Engine(num_blocks=64, max_num_seqs=2)
    seqs = [engine.add(make_request(range(i, i + 3), max_tokens=3))[0] for i in range(5)]
    plan = engine.step()
    assert [i.seq for i in plan.scheduled] == seqs[:2] and engine.sched.num_waiting == 3
    engine.run()
    assert all(s.num_output_tokens == 3 for s in seqs)
    assert_all_free(engine)


def test_priority_policy_admits_lower_values_first_fcfs_within():
    engine = Engine(num_blocks=64, max_num_seqs=1, policy="priority")
    order = [engine.add(make_request([p, 1], max_tokens=1, priority=p))[0] for p in (2, 0, 1, 0)]
    admitted = [engine.step().scheduled[0].seq for _ in range(4)]
    assert admitted == [order[1], order[3], order[2], order[0]]
    assert_all_free(engine)


# ---- prefix caching and n > 1 ---------------------------------------------------------------------


def test_shared_system_prompt_hit_counts():
    engine = Engine(num_blocks=64, block_size=4)
    system = list(range(40, 50))  # 10 tokens: 2 full blocks
    (first,) = engine.add(make_request(system + [1, 2, 3], max_tokens=2))
    engine.step()
    later = [engine.add(make_request(system + [9] * k, max_tokens=2))[0] for k in (1, 5)]
    engine.run()
    assert first.num_cached_tokens == 0 and [s.num_cached_tokens for s in later] == [8, 8]
    assert engine.bm.prefix_cache_queries == 13 + 11 + 15
    assert engine.bm.prefix_cache_hits == 16
    assert_all_free(engine)


def test_fully_cached_prompt_still_computes_and_samples():
    engine = Engine(num_blocks=16, block_size=4)
    engine.add(make_request(range(8), max_tokens=1))
    engine.run()
    (again,) = engine.add(make_request(range(8), max_tokens=1))
    plan = engine.step()
    assert [(i.seq, i.num_new_tokens, i.samples) for i in plan.scheduled] == [(again, 4, True)]
    assert again.num_cached_tokens == 4 and again.is_finished
    assert_all_free(engine)


@pytest.mark.parametrize("prompt_len", [10, 12])
def test_n4_samples_share_the_prompts_full_blocks(prompt_len):
    engine = Engine(num_blocks=64, block_size=4)
    seqs = engine.add(make_request(range(prompt_len), n=4, max_tokens=3))
    plan = engine.step()
    assert [i.seq for i in plan.scheduled] == seqs[:1] and engine.sched.num_waiting == 3
    plan = engine.step()
    assert [i.seq for i in plan.scheduled] == seqs
    shared = (prompt_len - 1) // 4  # full blocks that never hold a token still to compute
    tables = [s.block_table for s in seqs]
    assert all(t[:shared] == tables[0][:shared] for t in tables)
    assert len({t[shared] for t in tables}) == 4  # each computes its own last block
    assert [engine.bm.ref_count(b) for b in tables[0][:shared]] == [4] * shared
    assert engine.bm.prefix_cache_hits == 3 * shared * 4
    engine.run()
    assert len({tuple(s.output_token_ids) for s in seqs}) > 1  # they did diverge
    assert_all_free(engine)


def test_n4_without_prefix_caching_computes_each_prompt_at_once():
    engine = Engine(num_blocks=64, block_size=4, prefix_caching=False)
    seqs = engine.add(make_request(range(10), n=4, max_tokens=2))
    plan = engine.step()
    assert [i.seq for i in plan.scheduled] == seqs and plan.num_batched_tokens == 40
    assert len({b for s in seqs for b in s.block_table}) == 12
    engine.run()
    assert_all_free(engine)


def test_outputs_do_not_depend_on_prefix_caching_chunks_or_preemption():
    def outputs(num_preemptions: int = 0, **kwargs) -> list[list[int]]:
        engine = Engine(**kwargs)
        rng = random.Random(7)
        seqs = [s for i in range(6) for s in engine.add(
            make_request([1, 2, 3, 4, 5, 6] + [rng.randrange(5) for _ in range(i * 3)], n=1 + i % 3, max_tokens=9))]
        engine.run()
        assert_all_free(engine)
        assert (engine.sched.num_preemptions > 0) == (num_preemptions > 0)
        return [s.output_token_ids for s in seqs]

    reference = outputs(num_blocks=200, prefix_caching=False)
    assert outputs(num_blocks=200) == reference
    assert outputs(num_blocks=200, token_budget=5) == reference
    assert outputs(num_blocks=12, token_budget=7, num_preemptions=1) == reference
    assert outputs(num_blocks=12, token_budget=7, num_preemptions=1, prefix_caching=False) == reference


# ---- preemption -----------------------------------------------------------------------------------


def test_preemption_frees_the_newest_and_it_resumes_to_completion():
    engine = Engine(num_blocks=6, block_size=4)
    (a,) = engine.add(make_request(range(10), max_tokens=10))  # 3 blocks, grows to 5
    (b,) = engine.add(make_request(range(50, 58), max_tokens=10))  # 2 blocks, then a third
    engine.step()
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    preempted = []
    while not preempted:
        preempted = engine.step().preempted
    assert preempted == [b] and b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    assert b.block_table == [] and b.num_computed_tokens == 0 and engine.sched.num_preemptions == 1
    engine.run()
    assert a.num_output_tokens == b.num_output_tokens == 10
    assert engine.bm.prefix_cache_hits > 0  # b's recompute found its own blocks
    assert_all_free(engine)


def test_preempted_sequence_goes_to_the_front_of_the_waiting_queue():
    engine = Engine(num_blocks=6, block_size=4, max_num_seqs=2)
    (a,) = engine.add(make_request(range(10), max_tokens=10))
    (b,) = engine.add(make_request(range(50, 58), max_tokens=10))
    (c,) = engine.add(make_request(range(70, 72), max_tokens=10))  # no seq slot for it
    while not engine.step().preempted:
        pass
    assert engine.sched.waiting() == [b, c] and engine.sched.running() == [a]
    engine.run()
    assert_all_free(engine)


def test_admission_is_fcfs_without_skipping_a_head_that_does_not_fit():
    engine = Engine(num_blocks=6, block_size=4)
    (a,) = engine.add(make_request(range(14), max_tokens=3))  # 4 blocks
    engine.step()
    (big,) = engine.add(make_request(range(50, 62), max_tokens=1))  # 3 blocks: only 2 free
    (small,) = engine.add(make_request(range(70, 72), max_tokens=1))  # would fit, must wait behind big
    plan = engine.step()
    assert [i.seq for i in plan.scheduled] == [a] and engine.sched.waiting() == [big, small]
    engine.run()
    assert big.num_output_tokens == small.num_output_tokens == 1
    assert_all_free(engine)


def test_the_newest_running_sequence_preempts_itself():
    engine = Engine(num_blocks=5, block_size=4)
    (a,) = engine.add(make_request(range(8), max_tokens=8))
    (b,) = engine.add(make_request(range(50, 58), max_tokens=8))
    engine.step()
    engine.step()  # both get a third block: a [0, 1, 4]; b cannot
    plans = engine.plans
    assert plans[-1].preempted == [b] and [i.seq for i in plans[-1].scheduled] == [a]
    engine.run()
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert_all_free(engine)


def test_a_sequence_larger_than_the_cache_is_finished_with_length():
    engine = Engine(num_blocks=3, block_size=4)
    (big,) = engine.add(make_request(range(13), max_tokens=2))
    (ok,) = engine.add(make_request(range(3), max_tokens=2))
    plan = engine.step()
    assert plan.finished == [big] and big.finish_reason == "length" and big.block_table == []
    assert [i.seq for i in plan.scheduled] == [ok]
    (grows,) = engine.add(make_request(range(11), max_tokens=5))  # fits, then outgrows 12 slots
    engine.run()
    assert grows.finish_reason == "length" and grows.num_tokens == 13 and grows.num_output_tokens == 2
    assert_all_free(engine)


def test_a_sequence_past_max_model_len_is_finished_with_length():
    engine = Engine(num_blocks=32, max_model_len=10)
    (seq,) = engine.add(make_request(range(8), max_tokens=16))
    engine.run()
    assert seq.finish_reason == "length" and seq.num_tokens == 11  # positions 0..9 computed


# ---- finish and abort ------------------------------------------------------------------------------


def test_abort_mid_prefill_mid_preemption_and_held_samples_leaks_nothing():
    engine = Engine(num_blocks=6, block_size=4, token_budget=6)
    (long,) = engine.add(make_request(range(20), max_tokens=2, request_id="long"))
    engine.step()
    assert 0 < long.num_computed_tokens < long.num_prompt_tokens
    assert engine.abort("long") == [long] and long.finish_reason == "abort"
    assert_all_free(engine)

    (a,) = engine.add(make_request(range(10), max_tokens=12, request_id="a"))
    (b,) = engine.add(make_request(range(50, 58), max_tokens=12, request_id="b"))
    while not engine.step().preempted:
        pass
    assert b.status is SequenceStatus.WAITING
    assert engine.abort("b") == [b] and b.finish_reason == "abort"
    group = engine.add(make_request(range(100, 109), n=3, max_tokens=5, request_id="g"))
    engine.step()
    assert engine.sched.num_waiting >= 2  # samples 1, 2 are held for sample 0's prompt
    assert engine.abort("g") == group and all(s.finish_reason == "abort" for s in group)
    assert engine.abort("g") == [] and engine.abort("nobody") == []
    assert engine.abort("a") == [a]
    assert_all_free(engine)


def test_abort_between_schedule_and_advance_is_skipped():
    engine = Engine(num_blocks=16)
    (a,) = engine.add(make_request(range(6), request_id="a"))
    plan = engine.sched.schedule()
    engine.sched.abort("a")
    engine.sched.advance(plan)
    assert a.num_computed_tokens == 0 and engine.bm.num_free_blocks == 16


def test_finish_is_idempotent_and_sets_reasons():
    engine = Engine(num_blocks=16)
    (a,) = engine.add(make_request(range(6)))
    engine.step()
    engine.sched.finish(a, "stop", stop_reason="###")
    engine.sched.finish(a, "abort")
    assert (a.finish_reason, a.stop_reason, a.status) == ("stop", "###", SequenceStatus.FINISHED)
    assert engine.bm.num_free_blocks == 16 and not engine.sched.has_unfinished()


def test_bad_arguments_are_rejected():
    bm = BlockManager(8, 4)
    with pytest.raises(ValueError, match="token_budget"):
        Scheduler(bm, 4, 0, 100)
    with pytest.raises(ValueError, match="policy"):
        Scheduler(bm, 4, 8, 100, policy="lifo")
    sched = Scheduler(bm, 4, 8, 100)
    (seq,) = make_request([1, 2])
    sched.add(seq)
    with pytest.raises(ValueError, match="already added"):
        sched.add(seq)


# ---- random property test ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_every_invariant(seed):
    rng = random.Random(seed)
    engine = Engine(num_blocks=rng.randint(6, 24), block_size=rng.choice([1, 2, 4]), max_num_seqs=rng.randint(1, 6),
                    token_budget=rng.randint(1, 24), max_model_len=rng.randint(12, 40),
                    prefix_caching=rng.random() < 0.8)
    prefixes = [[rng.randrange(3) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    requests = []
    for _ in range(150):
        roll = rng.random()
        if roll < 0.25:
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(1, 10))]
            seqs = engine.add(make_request(prompt, n=rng.choice([1, 1, 2, 3]), max_tokens=rng.randint(1, 12)))
            requests.append(seqs[0].request_id)
        elif roll < 0.3 and requests:
            engine.abort(rng.choice(requests))
        else:
            engine.step()
    engine.run(max_steps=2000)
    assert_all_free(engine)
    assert all(s.finish_reason in ("length", "abort") for s in engine.done)
    for seq in engine.done:  # each output is its own prompt's continuation, whatever the batch did
        alone = Sequence(seq_id=-1, request_id="x", sample_index=seq.sample_index,
                         prompt_token_ids=seq.prompt_token_ids, params=seq.params)
        for _ in range(seq.num_output_tokens):
            alone.append_token(fake_token(alone))
        assert alone.token_ids == seq.token_ids


def test_without_chunked_prefill_a_sequence_waits_for_a_step_it_fits_whole():
    """Pooling models' scheduling: inputs of [10, 7, 9] tokens under a 12-token budget run whole, one
    step each (chunked prefill would give the second one 2 tokens in step 1), in arrival order."""
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, token_budget=12, max_model_len=12, chunked_prefill=False)
    seqs = [make_request(range(1, n + 1))[0] for n in (10, 7, 9)]
    for seq in seqs:
        sched.add(seq)
    for seq in seqs:
        plan = sched.schedule()
        assert [(s.seq, s.num_new_tokens) for s in plan.scheduled] == [(seq, seq.num_tokens)]
        sched.finish(seq, "stop")  # a pooling input finishes after its one step
    assert bm.num_free_blocks == 64 and not sched.has_unfinished()
    with pytest.raises(ValueError, match="token budget .* must hold a whole sequence"):
        Scheduler(bm, max_num_seqs=8, token_budget=8, max_model_len=12, chunked_prefill=False)
