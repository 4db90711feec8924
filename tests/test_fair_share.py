"""Fair share between tenants in the scheduler: exact admission order on a saturated engine.

Driven by test_scheduler's simulated engine loop (fake KV store, block invariants every step), so
everything the scheduler tests check still holds with tenants. The expected orders follow from the
rule in ``podium.fair_share``: least tokens served per weight first, ties to the earlier arrival.
"""

from __future__ import annotations

import itertools
import random

import pytest
from model_fixtures import single_thread  # noqa: F401 (a fixture)
from test_scheduler import Engine, assert_all_free

from podium.fair_share import FairQueue
from podium.request import Sequence
from podium.sampling_params import SamplingParams
from podium.tenant import Tenant

_ids = itertools.count()
A, B = Tenant("team-a"), Tenant("team-b")


def request(tenant: Tenant, prompt_len: int = 6, max_tokens: int = 3, priority: int = 0) -> Sequence:
    rid = next(_ids)
    # a distinct first token: no prefix-cache hits, so every request costs its whole prompt
    return Sequence(seq_id=rid, request_id=f"r{rid}", sample_index=0, prompt_token_ids=[rid, *range(1, prompt_len)],
                    params=SamplingParams(max_tokens=max_tokens), priority=priority, tenant=tenant)


def admissions(engine: Engine, steps: int | None = None) -> list[list[Sequence]]:
    """The sequences admitted at each step, until every request finished (or ``steps`` steps)."""
    out = []
    while engine.sched.has_unfinished() and (steps is None or len(out) < steps):
        out.append(engine.step().admitted)
    return out


def test_a_flooding_tenant_delays_only_itself():
    engine = Engine(num_blocks=64, block_size=4, max_num_seqs=4, token_budget=32)
    flood = engine.add([request(A) for _ in range(200)])
    few = engine.add([request(B) for _ in range(8)])
    steps = admissions(engine)
    order = [seq for step in steps for seq in step]
    # equal weights, equal requests: the two tenants alternate while both wait, A first (it came first)
    assert order == [*itertools.chain(*zip(flood[:8], few)), *flood[8:]]
    assert steps[0] == [flood[0], few[0], flood[1], few[1]]
    last_b = max(i for i, step in enumerate(steps) if set(step) & set(few))
    assert last_b <= 10, "B's 8 requests must be admitted within the first few steps, not after A's 200"
    assert all(s.finish_reason == "length" and s.num_output_tokens == 3 for s in flood + few)
    assert_all_free(engine)


def test_one_tenant_keeps_plain_fcfs_order():
    fair, plain = Engine(num_blocks=64, max_num_seqs=3), Engine(num_blocks=64, max_num_seqs=3)
    rng = random.Random(1)
    lengths = [(rng.randint(2, 20), rng.randint(1, 6)) for _ in range(30)]
    named = fair.add([request(A, p, m) for p, m in lengths])
    default = plain.add([request(Tenant(), p, m) for p, m in lengths])
    fair_order = [named.index(s) for step in admissions(fair) for s in step]
    plain_order = [default.index(s) for step in admissions(plain) for s in step]
    assert fair_order == plain_order == list(range(30))
    assert fair.sched.tenant_tokens() == {"team-a": 0}  # one tenant: no accounting at all


def test_weights_share_tokens_while_both_wait():
    engine = Engine(num_blocks=256, block_size=4, max_num_seqs=8, token_budget=64)
    heavy, light = Tenant("heavy", weight=3.0), Tenant("light", weight=1.0)
    engine.add([request(heavy, 8, 4) for _ in range(120)])
    engine.add([request(light, 8, 4) for _ in range(120)])
    for _ in range(40):  # both tenants keep a queue through these steps
        engine.step()
        waiting = {s.tenant.name for s in engine.sched.waiting()}
        assert waiting == {"heavy", "light"}
    served = engine.sched.tenant_tokens()
    assert 2.7 <= served["heavy"] / served["light"] <= 3.3, served
    engine.run(max_steps=2000)
    assert_all_free(engine)


def test_priority_orders_each_tenants_own_queue():
    engine = Engine(num_blocks=64, max_num_seqs=1, policy="priority")
    a = engine.add([request(A, 4, 1, priority=p) for p in (2, 0, 1)])
    b = engine.add([request(B, 4, 1, priority=p) for p in (1, 0)])
    order = [s for step in admissions(engine) for s in step]
    assert order == [a[1], b[1], a[2], b[0], a[0]]
    assert_all_free(engine)


def test_an_idle_tenant_earns_no_credit():
    engine = Engine(num_blocks=128, block_size=4, max_num_seqs=4, token_budget=32)
    engine.add([request(B)])
    engine.add([request(A) for _ in range(100)])
    admissions(engine, steps=30)  # B's one request is long done: A's virtual time runs far ahead of B's
    assert engine.sched.tenant_tokens()["team-a"] > 10 * engine.sched.tenant_tokens()["team-b"]
    late = engine.add([request(B) for _ in range(8)])
    following = [s for step in admissions(engine, steps=12) for s in step][:12]
    tenants = "".join("b" if s in late else "a" for s in following)
    # B starts at the virtual clock: it catches up within a request or two, then the tenants
    # alternate; with credit for its idle time it would take all 8 admissions in a row
    assert "bbbbbbbb" not in tenants and "abab" in tenants, tenants
    assert "b" in tenants[:2], tenants
    engine.run()
    assert_all_free(engine)


@pytest.mark.parametrize("seed", range(3))
def test_random_tenants_with_preemption_keep_every_invariant(seed):
    rng = random.Random(seed)
    engine = Engine(num_blocks=24, block_size=4, max_num_seqs=6, token_budget=24,
                    policy=rng.choice(["fcfs", "priority"]))
    tenants = [Tenant(f"t{i}", weight=rng.choice([0.5, 1.0, 4.0])) for i in range(3)]
    seqs = []
    for _ in range(60):
        if rng.random() < 0.5:
            engine.step()
        seqs += engine.add([request(rng.choice(tenants), rng.randint(1, 18), rng.randint(1, 10),
                                    priority=rng.randint(0, 2) if engine.sched.policy == "priority" else 0)])
    engine.run(max_steps=5000)
    assert engine.sched.num_preemptions > 0  # the small cache forces recomputation
    assert all(s.is_finished and s.finish_reason == "length" for s in seqs)
    assert 0 < sum(engine.sched.tenant_tokens().values()) <= sum(p.num_batched_tokens for p in engine.plans)
    assert_all_free(engine)


def test_queue_bookkeeping():
    queue = FairQueue(lambda seq: seq.seq_id, keep_sorted=False)
    a1, a2, b1 = request(A), request(A), request(B)
    for seq in (a1, a2, b1):
        queue.push(seq, front=False)
    assert len(queue) == 3 and queue.head() is a1
    queue.remove(a1)
    assert list(queue) == [a2, b1] and queue.head() is a2
    queue.charge(a2, 10)
    assert queue.head() is b1 and queue.pop_head() is b1 and queue.pop_head() is a2 and not queue
    with pytest.raises(ValueError, match="weight"):
        Tenant("x", weight=0)


def test_the_engine_takes_a_tenant_and_shares_fairly(tmp_path, single_thread):  # noqa: F811
    """A real (tiny, random) model: B's 8 requests get their first tokens while most of A's 200
    still wait, every request completes, greedy outputs equal a run without tenants, nothing leaks."""
    from model_fixtures import save_tiny_model

    from podium import LLM

    save_tiny_model("llama", {}, tmp_path)
    llm = LLM(str(tmp_path), device="cpu", max_num_seqs=4, kv_cache_memory_bytes="4MiB")
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompts = {f"{t}{i}": [1 + i % 90, 2 + i % 7, 3] for t, n in (("a", 200), ("b", 8)) for i in range(n)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy, tenant=Tenant("team-a" if rid[0] == "a" else "team-b"))
    with pytest.raises(ValueError, match="Tenant"):
        engine.add_request("x", [1, 2], greedy, tenant="team-a")
    first_token_step, outputs, step = {}, {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token_step.setdefault(out.request_id, step)
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert len(outputs) == 208
    assert max(first_token_step[f"b{i}"] for i in range(8)) < sorted(first_token_step.values())[40]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    plain = llm.generate([{"prompt_token_ids": prompts[r]} for r in ("a0", "a150", "b7")], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [outputs["a0"], outputs["a150"], outputs["b7"]]
