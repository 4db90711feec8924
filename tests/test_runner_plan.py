"""The runner's step plan: plain, picklable data that says everything a rank needs, blocks included.

What tensor parallelism will rely on (issue 26): rank 0 pickles each plan and the other ranks run it.
Here a second "rank" replays the unpickled plans into its own block-table array and must hold the
same tables as the engine's runner at every step, through chunked prefill, preemption, prefix hits,
async placeholders and finished sequences, without any release message.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from model_fixtures import save_tiny_model

import podium.engine
from podium import LLM, SamplingParams
from podium.runner import ModelRunner, StepPlan
from podium.runner.block_table import BlockTable


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_model("llama", {"tie_word_embeddings": True}, folder)
    return str(folder)


def plain(value) -> bool:
    """Only ints, lists, tuples and None: what a broadcast can carry without the engine's objects."""
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    return value is None or type(value) is int


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_plans_pickle_and_rebuild_the_runners_block_tables(tiny, monkeypatch, async_scheduling):
    llm = LLM(tiny, device="cpu", dtype="float32", block_size=4, num_kv_blocks=14, max_num_seqs=4, max_model_len=48,
              max_num_batched_tokens=24, enforce_eager=True, async_scheduling=async_scheduling)
    engine = llm.engine
    runner = engine.runner
    other_rank = BlockTable(*runner.table.array.shape)
    plans: list[StepPlan] = []
    build = podium.engine.plan_step

    def broadcast(output, feed_rows):
        plan = build(output, feed_rows)
        received = pickle.loads(pickle.dumps(plan))
        assert received == plan and all(plain(getattr(plan, f)) for f in plan.__slots__), plan
        other_rank.apply(received.new_blocks)
        plans.append(plan)
        return plan

    def check_tables(*args, **kwargs):
        out = execute(*args, **kwargs)
        rows = [s.table_row for s in engine.scheduler.running()]
        assert np.array_equal(other_rank.array[rows], runner.table.array[rows])
        for seq in engine.scheduler.running():  # the runner's rows are the scheduler's tables
            assert runner.table.array[seq.table_row, :len(seq.block_table)].tolist() == seq.block_table
        return out

    execute = runner.execute
    monkeypatch.setattr(podium.engine, "plan_step", broadcast)
    monkeypatch.setattr(runner, "execute", check_tables)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 90 + 1 for j in range(n)]} for i, n in enumerate([9, 17, 5, 13, 9])]
    prompts.append(prompts[0])  # a prefix hit
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outputs)
    assert engine.stats().num_preemptions > 0  # 14 blocks of 4 tokens cannot hold six 20-token sequences
    assert any(len(p.new_blocks) for p in plans) and any(not p.is_pure_decode for p in plans)
    assert any(p.fill for p in plans) == async_scheduling  # placeholders name the previous step's rows
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_the_runner_keeps_no_mirror_to_release():
    assert not hasattr(ModelRunner, "release")
