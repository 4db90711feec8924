"""The prefix cache's KV events, from the block manager through the server's log to the router.

The router recomputes block hashes without importing the core (podium_router.hashing); these
tests hold its code and the core's ``hash_block_tokens`` to the same answers, and the scheme names
together, so a change to one fails here until the other follows.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from podium.block_manager import BLOCK_HASH_SCHEME, BlockManager, hash_block_tokens
from podium.request import Sequence
from podium.sampling_params import SamplingParams
from podium_router import hashing
from podium_router.replica import Replica
from podium_server.replica import KVEventLog


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams())


def _compute(bm: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` and compute its whole prompt, as the scheduler and engine would."""
    hits = bm.lookup(seq)
    assert bm.admit(seq, hits, seq.num_tokens)
    before = seq.num_computed_tokens
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq, before)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_router_hashes_equal_the_block_managers(block_size):
    assert hashing.BLOCK_HASH_SCHEME == BLOCK_HASH_SCHEME
    rng = random.Random(block_size)
    for length in (1, block_size, block_size + 1, 5 * block_size + 3):
        tokens = [rng.randrange(0, 200_000) for _ in range(length)]
        bm = BlockManager(64, block_size)
        seq = _seq(0, tokens)
        bm.lookup(seq)  # hashes the blocks a lookup may hit: all full blocks but the last token's
        expected = [f"{h:032x}" for h in seq.block_hashes]
        assert hashing.block_hashes(tokens, block_size) == expected
        parent = None
        for start in range(0, len(tokens) // block_size * block_size, block_size):
            block = tokens[start:start + block_size]
            assert hashing.chained_block_hash(parent, block) == hash_block_tokens(parent, block)
            parent = hash_block_tokens(parent, block)


def test_block_manager_reports_stored_and_evicted_hashes_in_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    assert bm.enable_events() == [] and bm.take_events() == []
    a = _seq(0, [1, 2, 3, 4, 5])  # two full blocks and a partial one
    _compute(bm, a)
    ha = list(a.block_hashes[:2])
    assert bm.take_events() == [("stored", ha[0]), ("stored", ha[1])]
    bm.free(a)  # cached blocks become evictable (tail first), nothing is evicted yet
    assert bm.take_events() == []
    b = _seq(1, [9, 8, 7, 6, 5, 4, 3])  # needs all four blocks: evicts a's, least recently freed first
    _compute(bm, b)
    events = bm.take_events()
    assert [e for e in events if e[0] == "evicted"] == [("evicted", ha[1]), ("evicted", ha[0])]
    stored = [h for kind, h in events if kind == "stored"]
    assert stored == b.block_hashes[:3]
    assert bm.enable_events() == [bm._block_hash[i] for i in b.block_table[:3]]  # the state now


def test_events_are_off_by_default():
    bm = BlockManager(num_blocks=4, block_size=2)
    _compute(bm, _seq(0, [1, 2, 3]))
    assert bm.take_events() == []


def test_event_log_numbers_runs_and_resets_a_poller_it_cannot_continue():
    log = KVEventLog(max_events=3)
    log.append([("stored", 1), ("stored", 2), ("evicted", 1), ("stored", 3)])
    assert log.seq == 3
    since = log.since(0, log.epoch)
    assert since["reset"] is False
    assert [(e["seq"], e["type"], len(e["block_hashes"])) for e in since["events"]] == \
        [(1, "stored", 2), (2, "evicted", 1), (3, "stored", 1)]
    assert log.since(3, log.epoch)["events"] == []
    reset = log.since(0, "another-epoch")  # a restarted replica, or a first poll
    assert reset["reset"] and set(reset["block_hashes"]) == {f"{2:032x}", f"{3:032x}"}
    log.append([("stored", 4)])  # the bounded log drops run 1: a poller at 0 must resync
    assert log.since(0, log.epoch)["reset"] and not log.since(1, log.epoch)["reset"]
    assert log.since(9, log.epoch)["reset"]  # a position from the future


def test_router_replica_follows_the_log_exactly():
    log, replica = KVEventLog(), Replica("http://r")
    replica.exact_prefixes = True
    replica.apply_kv_events(log.since(0, None))
    for batch in ([("stored", 1), ("stored", 2)], [("evicted", 2), ("stored", 5)], [("evicted", 1)]):
        log.append(batch)
        replica.apply_kv_events(log.since(replica.kv_seq, replica.kv_epoch))
        assert replica.cached == set(log.since(0, None)["block_hashes"])
    assert replica.cached == {f"{5:032x}"}


def test_long_poll_wakes_on_new_events():
    async def scenario():
        log = KVEventLog()
        waiter = asyncio.ensure_future(log.wait(0, timeout=5))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        log.append([("stored", 7)])
        await asyncio.wait_for(waiter, 1)
        await log.wait(0, timeout=5)  # already past: returns at once

    asyncio.run(scenario())
