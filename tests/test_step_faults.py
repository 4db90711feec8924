"""Request isolation in the engine: parameters bounded before a step, faults inside a step.

A fault pinned to one request (``StepFault``) aborts that request only; any other exception fails
the requests of the step it happened in; every other request completes with exactly the output it
has alone (greedy and seeded sampling do not depend on the batch, nor on the recompute the
recovery causes), every block is free at the end, and the prefix cache's KV events still describe
the cache. A tiny random Llama keeps this fast.
"""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import TINY, save_tiny_model

from podium.engine import MAX_CONSECUTIVE_FAULTS, LLMEngine
from podium.errors import EngineDead, InvalidParameter, StepFault
from podium.outputs import PoolingRequestOutput
from podium.pooling_params import PoolingParams
from podium.sampling_params import SamplingParams
from podium.tenant import Tenant

VOCAB = TINY["vocab_size"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", {}, folder, seed=3)
    return str(folder)


def make_engine(model_dir: str, **kwargs) -> LLMEngine:
    torch.set_num_threads(1)
    options = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=24, max_num_seqs=8, max_model_len=64,
                   max_num_batched_tokens=32, enforce_eager=True)
    return LLMEngine(model=model_dir, **{**options, **kwargs})


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], fault=None) -> tuple[dict, dict]:
    """Add ``requests`` and step until all end; returns (tokens of each finished request, errors)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    engine.fault_injector = fault
    done, errors = {}, {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            elif out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    engine.fault_injector = None
    assert not engine.has_unfinished_requests()
    return done, errors


def all_free(engine: LLMEngine) -> bool:
    stats = engine.stats()
    return stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def random_requests(rng: random.Random, count: int) -> dict[str, tuple[list[int], SamplingParams]]:
    shared = [rng.randrange(VOCAB) for _ in range(9)]  # a common prefix: prefix-cache hits
    requests = {}
    for i in range(count):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))]
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(4, 20), ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=0.9, top_k=7, seed=i, n=2, max_tokens=rng.randint(3, 12),
                                    ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=2, max_tokens=10, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.7, seed=100 + i, min_tokens=3, max_tokens=rng.randint(5, 15))
        requests[f"r{i}"] = (prompt, params)
    return requests


# -- parameters bounded before a step ------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("top_k", 2**63), ("seed", 2**64), ("max_tokens", 2**70),
                                          ("min_tokens", 2**63), ("logprobs", 2**63), ("n", 2**64)])
def test_integers_beyond_int64_are_the_callers_error(field, value):
    with pytest.raises(InvalidParameter, match="64-bit") as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_token_ids_beyond_int64_are_refused():
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(stop_token_ids=[2**64])
    assert info.value.param == "stop_token_ids"
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(logit_bias={2**63: 1.0})
    assert info.value.param == "logit_bias"


def test_top_k_is_clamped_to_the_vocabulary_and_samples_as_off(model_dir):
    engine = make_engine(model_dir)
    prompt = [5, 6, 7, 8]
    huge, off = [SamplingParams(temperature=1.0, top_k=k, seed=9, max_tokens=12, ignore_eos=True)
                 for k in (2**63 - 1, 0)]
    done, errors = run(engine, {"huge": (prompt, huge)})
    assert not errors and huge.top_k == VOCAB
    reference, _ = run(engine, {"off": (prompt, off)})
    assert done["huge"] == reference["off"]


@pytest.mark.parametrize("params, field", [(dict(logprobs=VOCAB + 1), "logprobs"),
                                           (dict(prompt_logprobs=VOCAB + 1), "prompt_logprobs"),
                                           (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
                                           (dict(logit_bias={1: float("nan")}), "logit_bias")])
def test_parameters_the_vocabulary_cannot_honour_are_refused_when_added(model_dir, params, field):
    engine = make_engine(model_dir)
    with pytest.raises(InvalidParameter) as info:
        engine.add_request("bad", [1, 2, 3], SamplingParams(**params))
    assert info.value.param == field and not engine.has_unfinished_requests()


# -- faults inside a step ----------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_random_faults_fail_only_their_requests(model_dir, async_scheduling):
    """Faults injected into random steps of a busy engine (preemptions, prefix hits, n=2, penalties;
    with async scheduling, a step in flight whose tokens are not read yet)."""
    rng = random.Random(1)
    requests = random_requests(rng, 20)
    engine = make_engine(model_dir, async_scheduling=async_scheduling)
    assert engine.async_scheduling == async_scheduling
    solo = {rid: run(engine, {rid: item})[0][rid] for rid, item in requests.items()}
    assert all_free(engine)
    recorded = set(engine.enable_kv_events())  # the cache now; the events must keep this true
    expected_failures: set[str] = set()
    fault_steps = sorted(rng.sample(range(1, 40), 7))  # random busy steps; one fault is not pinned
    unpinned_step = rng.choice(fault_steps[2:])
    faults = {"pinned": 0, "step": 0}
    steps = iter(range(10**6))

    def inject(plan) -> None:
        step = next(steps)
        in_step = sorted({s.seq.request_id for s in plan.scheduled})
        if step not in fault_steps or not in_step:
            return
        if step != unpinned_step:
            victim = rng.choice(in_step)
            expected_failures.add(victim)
            faults["pinned"] += 1
            raise StepFault(victim, "injected fault")
        expected_failures.update(in_step)
        faults["step"] += 1
        raise RuntimeError("injected step fault")

    done, errors = run(engine, requests, inject)
    assert faults["pinned"] and faults["step"], faults  # both kinds happened
    assert set(errors) == expected_failures
    assert set(done) == set(requests) - expected_failures and len(done) >= len(requests) // 3
    assert engine.stats().num_preemptions > 0  # the cache ran short too: recovery met preempted sequences
    for rid, tokens in done.items():
        assert tokens == solo[rid], rid
    assert all_free(engine)
    for kind, block_hash in engine.take_kv_events():
        (recorded.add if kind == "stored" else recorded.discard)(block_hash)
    assert recorded == set(engine.enable_kv_events())


def test_pinned_fault_names_the_problem_and_the_next_requests_succeed(model_dir):
    engine = make_engine(model_dir)
    requests = {f"q{i}": ([1 + i, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                for i in range(4)}
    solo = {rid: run(engine, {rid: item})[0][rid] for rid, item in requests.items()}

    def inject(plan) -> None:
        if any(s.seq.request_id == "q2" for s in plan.scheduled) and engine.stats().num_running == 4:
            raise StepFault("q2", "bad things in q2")

    done, errors = run(engine, requests, inject)
    assert list(errors) == ["q2"] and "bad things in q2" in errors["q2"]
    assert done == {rid: solo[rid] for rid in requests if rid != "q2"}
    again, errors = run(engine, {"later": requests["q2"]})
    assert not errors and again["later"] == solo["q2"] and all_free(engine)


def test_a_sampler_fault_is_pinned_to_its_request(model_dir, monkeypatch):
    engine = make_engine(model_dir)
    original = engine.sampler._new_state

    def broken(seq):
        if seq.request_id == "bad":
            raise OverflowError("cannot hold this parameter")
        return original(seq)

    monkeypatch.setattr(engine.sampler, "_new_state", broken)
    good = SamplingParams(temperature=0.5, seed=1, max_tokens=5, ignore_eos=True)
    done, errors = run(engine, {"good": ([3, 4, 5], good), "bad": ([3, 4, 6], good)})
    assert list(errors) == ["bad"] and "OverflowError" in errors["bad"] and list(done) == ["good"]
    assert all_free(engine)


def test_steps_failing_in_a_row_declare_the_engine_dead(model_dir):
    engine = make_engine(model_dir)

    def always(plan) -> None:
        raise RuntimeError("device lost")

    engine.fault_injector = always
    for i in range(MAX_CONSECUTIVE_FAULTS - 1):
        engine.add_request(f"d{i}", [1, 2], SamplingParams(max_tokens=3))
        assert [o.request_id for o in engine.step() if o.error] == [f"d{i}"]
    engine.add_request("last", [1, 2], SamplingParams(max_tokens=3))
    with pytest.raises(EngineDead, match="device lost"):
        engine.step()


# -- the state rebuilt after a fault -------------------------------------------------------------
def test_release_all_keeps_consistent_cache_entries_and_reports_the_dropped_ones():
    from podium.block_manager import BlockManager
    from podium.request import Sequence

    bm = BlockManager(num_blocks=6, block_size=2)
    bm.enable_events()
    seq = Sequence(0, "a", 0, [1, 2, 3, 4, 5], SamplingParams())
    assert bm.admit(seq, bm.lookup(seq), 5)  # blocks 0, 1, 2; 0 and 1 become full and cached
    seq.num_computed_tokens = 5
    bm.commit(seq, 0)
    good, bad = seq.block_hashes[:2]
    assert bm.take_events() == [("stored", good), ("stored", bad)]
    bm._block_hash[1] = None  # an entry that disagrees with its block (a step died half-way)
    bm.release_all()  # the sequence's references are gone with it (Scheduler.reset)
    assert bm.take_events() == [("evicted", bad)]
    assert bm.cached_block(good) == 0 and bm.cached_block(bad) is None
    assert bm.evictable_block_ids() == [0] and sorted(bm.free_block_ids()) == [1, 2, 3, 4, 5]
    assert bm.num_free_blocks == 6 and all(bm.ref_count(b) == 0 for b in range(6))


def test_scheduler_reset_puts_every_sequence_back_to_waiting_in_arrival_order():
    from podium.block_manager import BlockManager
    from podium.request import Sequence, SequenceStatus
    from podium.scheduler import Scheduler

    bm = BlockManager(num_blocks=16, block_size=2)
    scheduler = Scheduler(bm, max_num_seqs=4, token_budget=64, max_model_len=32)
    seqs = [Sequence(i, f"r{i}", 0, [1 + i, 2, 3], SamplingParams()) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    plan = scheduler.schedule()
    scheduler.advance(plan)
    seqs[1].token_ids += [7, -1]  # a sampled token and a placeholder of a step in flight
    seqs[1].num_pending_tokens = 1
    assert scheduler.reset() == seqs
    bm.release_all()
    assert [s.status for s in seqs] == [SequenceStatus.WAITING] * 3 and scheduler.waiting() == seqs
    assert seqs[1].token_ids == [2, 2, 3, 7] and seqs[1].num_pending_tokens == 0
    assert all(s.num_computed_tokens == 0 and not s.block_table and s.table_row == -1 for s in seqs)
    assert bm.num_free_blocks == 16 and scheduler.num_running == 0
    again = scheduler.schedule()  # and they run again, from their whole tables
    assert [s.seq for s in again.scheduled] == seqs and all(s.first_new_block == 0 for s in again.scheduled)


def test_scheduler_reset_keeps_the_tenants_fair_share():
    """A recovery empties the fair queue and refills it; each tenant keeps its virtual time, so the
    tenant that was served less is still admitted first."""
    from podium.block_manager import BlockManager
    from podium.request import Sequence
    from podium.scheduler import Scheduler
    from podium.tenant import Tenant

    bm = BlockManager(num_blocks=32, block_size=2)
    scheduler = Scheduler(bm, max_num_seqs=1, token_budget=64, max_model_len=32)
    heavy, light = Tenant("heavy"), Tenant("light")
    seqs = [Sequence(0, "h0", 0, [1, 2, 3, 4, 5, 6], SamplingParams(), tenant=heavy),
            Sequence(1, "l0", 0, [3, 4], SamplingParams(), tenant=light)]
    for seq in seqs:
        scheduler.add(seq)
    plan = scheduler.schedule()  # one row: heavy's (the first to arrive) is served 6 tokens
    assert [s.seq for s in plan.scheduled] == seqs[:1]
    scheduler.advance(plan)
    served = scheduler.tenant_tokens()
    assert served == {"heavy": 6, "light": 0}
    assert scheduler.reset() == seqs
    bm.release_all()
    assert scheduler.tenant_tokens() == served and scheduler.num_waiting == 2
    assert [s.seq for s in scheduler.schedule().scheduled] == seqs[1:]  # light is behind: it goes first


# -- pooling requests in a failed step ---------------------------------------------------------------
@pytest.fixture(scope="module")
def pooling_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    save_tiny_model("qwen3", {"head_dim": 32, "tie_word_embeddings": True}, folder, seed=5)
    return str(folder)


def embed_all(engine: LLMEngine, prompts: dict[str, tuple[list[int], Tenant]], fault=None) -> tuple[dict, dict]:
    """Add embedding requests and step until all end; returns (each finished embedding, errors)."""
    for rid, (prompt, tenant) in prompts.items():
        engine.add_request(rid, prompt, PoolingParams(), tenant=tenant)
    engine.fault_injector = fault
    done, errors = {}, {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert isinstance(out, PoolingRequestOutput) and out.finished
            if out.error is not None:
                errors[out.request_id] = out.error
            else:
                done[out.request_id] = out.outputs.data
    engine.fault_injector = None
    assert not engine.has_unfinished_requests()
    return done, errors


def test_a_failed_step_fails_its_pooling_requests_only(pooling_dir):
    """A decoder run as a pooling model (its K/V written into blocks held for one step), two tenants
    in the fair queue: a fault pinned to one embedding request fails it alone, a fault pinned to
    none fails that step's requests, each as a pooling output carrying the error; every other
    request gets the embedding it gets alone, every block is free, and the engine goes on."""
    engine = LLMEngine(model=pooling_dir, device="cpu", dtype="float32", runner="pooling", block_size=4,
                       num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    rng = random.Random(4)
    tenants = [Tenant("a"), Tenant("b")]
    prompts = {f"e{i}": ([rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))], tenants[i % 2])
               for i in range(8)}
    solo = {rid: embed_all(engine, {rid: item})[0][rid] for rid, item in prompts.items()}
    expected: set[str] = set()

    def inject(plan) -> None:
        in_step = sorted(s.seq.request_id for s in plan.scheduled)
        if "e1" in in_step and "e1" not in expected:
            expected.add("e1")
            raise StepFault("e1", "bad things in e1")
        if "e5" in in_step and "e5" not in expected:
            expected.update(in_step)
            raise RuntimeError("injected step fault")

    done, errors = embed_all(engine, prompts, inject)
    assert {"e1", "e5"} <= expected and len(expected) == 3  # the unpinned fault met a step of two
    assert set(errors) == expected and "bad things in e1" in errors["e1"]
    assert all("RuntimeError: injected step fault" in errors[rid] for rid in expected - {"e1"})
    assert set(done) == set(prompts) - expected
    for rid, vector in done.items():
        torch.testing.assert_close(vector, solo[rid], atol=1e-6, rtol=1e-5)
    assert all_free(engine)
    again, errors = embed_all(engine, {"later": prompts["e1"]})
    assert not errors and torch.equal(again["later"], solo["e1"]) and all_free(engine)
