"""The KV block manager: exact block ids, reference counts, prefix hits and LRU eviction order."""

from __future__ import annotations

import itertools

import pytest

from podium.block_manager import BlockManager, hash_block_tokens
from podium.request import Sequence
from podium.sampling_params import SamplingParams

_seq_ids = itertools.count()


def make_seq(tokens) -> Sequence:
    seq_id = next(_seq_ids)
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", sample_index=0,
                    prompt_token_ids=list(tokens), params=SamplingParams())


def admit_all(bm: BlockManager, seq: Sequence) -> bool:
    """Schedule ``seq`` from waiting with its whole remaining prompt, as the scheduler would."""
    hits = bm.lookup(seq)
    return bm.admit(seq, hits, seq.num_tokens)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """The step ran: advance ``seq`` to ``num_tokens`` computed tokens and commit its full blocks."""
    before = seq.num_computed_tokens
    seq.num_computed_tokens = seq.num_tokens if num_tokens is None else num_tokens
    bm.commit(seq, before)


def test_fresh_blocks_come_out_in_ascending_order_then_fifo():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b, c = make_seq(range(10)), make_seq(range(100, 105)), make_seq(range(200, 213))
    assert admit_all(bm, a) and a.block_table == [0, 1, 2]
    assert admit_all(bm, b) and b.block_table == [3, 4]
    bm.free(a)
    assert a.block_table == [] and bm.free_block_ids() == [5, 6, 7, 2, 1, 0]  # freed tail first
    assert admit_all(bm, c) and c.block_table == [5, 6, 7, 2]
    assert bm.num_free_blocks == 2 and bm.usage == pytest.approx(6 / 8)
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hits == 0  # off: no statistics


def test_allocate_grows_by_whole_blocks_and_refuses_without_change():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_seq(range(3))
    assert admit_all(bm, seq) and seq.block_table == [0]
    assert bm.allocate(seq, 4) and seq.block_table == [0]  # still fits in block 0
    assert bm.allocate(seq, 5) and seq.block_table == [0, 1]
    assert not bm.allocate(seq, 13)  # needs 2 more, 1 free
    assert seq.block_table == [0, 1] and bm.free_block_ids() == [2]
    assert bm.allocate(seq, 12) and seq.block_table == [0, 1, 2]


def test_shared_prefix_hits_exact_counts_and_refcounts():
    bm = BlockManager(num_blocks=10, block_size=4)
    system = list(range(50, 62))  # 12 tokens: 3 full blocks
    a = make_seq(system + [1, 2, 3, 4, 5])  # 17 tokens
    assert admit_all(bm, a) and a.block_table == [0, 1, 2, 3, 4]
    compute(bm, a)  # 4 full blocks committed: the system prompt's 3 and [1, 2, 3, 4]
    b = make_seq(system + [9, 9])  # 14 tokens
    assert bm.lookup(b) == [0, 1, 2]
    assert bm.admit(b, [0, 1, 2], b.num_tokens)
    assert b.block_table == [0, 1, 2, 5]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert [bm.ref_count(i) for i in range(6)] == [2, 2, 2, 1, 1, 1]
    assert bm.prefix_cache_queries == 17 + 14 and bm.prefix_cache_hits == 12
    assert b.block_hashes == a.block_hashes[:3]


def test_fully_cached_block_aligned_prompt_recomputes_its_last_block_privately():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(range(8))
    admit_all(bm, a)
    compute(bm, a)
    b = make_seq(range(8))
    hits = bm.lookup(b)
    assert hits == [0]  # block 1 holds b's last token, which must be computed: not shared
    assert bm.admit(b, hits, 8)
    assert b.block_table == [0, 2] and b.num_computed_tokens == 4
    compute(bm, b)
    assert bm.cached_block(b.block_hashes[1]) == 1  # the first copy stays the cached one
    bm.free(b)
    assert bm.free_block_ids()[-1] == 2  # the private duplicate goes back to the free pool


def test_fully_cached_unaligned_prompt_computes_exactly_one_token():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(range(9))
    admit_all(bm, a)
    compute(bm, a)
    b = make_seq(range(9))
    assert bm.lookup(b) == [0, 1]
    assert bm.admit(b, [0, 1], 9)
    assert b.num_computed_tokens == 8 and b.num_tokens - b.num_computed_tokens == 1
    assert b.block_table == [0, 1, 3]


def test_lru_eviction_order_least_recently_freed_first_tail_before_head():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq(range(12)), make_seq(range(100, 108))
    admit_all(bm, a), compute(bm, a)
    admit_all(bm, b), compute(bm, b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    hashes = {0: a.block_hashes[0], 1: a.block_hashes[1], 2: a.block_hashes[2],
              3: b.block_hashes[0], 4: b.block_hashes[1]}
    bm.free(a)
    bm.free(b)
    assert bm.evictable_block_ids() == [2, 1, 0, 4, 3]
    assert bm.free_block_ids() == [5] and bm.num_free_blocks == 6 and bm.usage == 0.0

    c = make_seq(range(200, 212))  # 3 fresh blocks: the free one, then evict 2, then 1
    admit_all(bm, c)
    assert c.block_table == [5, 2, 1]
    assert bm.num_evictions == 2
    assert bm.cached_block(hashes[2]) is None and bm.cached_block(hashes[1]) is None
    assert [bm.cached_block(hashes[i]) for i in (0, 3, 4)] == [0, 3, 4]
    assert bm.evictable_block_ids() == [0, 4, 3]

    d = make_seq([*range(4), 7])  # a's first block is still cached: a hit revives it
    assert bm.lookup(d) == [0]
    assert bm.admit(d, [0], 5) and d.block_table == [0, 4]  # 4 is the next eviction
    assert bm.evictable_block_ids() == [3] and bm.cached_block(hashes[4]) is None
    assert bm.prefix_cache_hits == 4 and bm.prefix_cache_queries == 12 + 8 + 12 + 5

    bm.free(d)  # freed again: now the most recently freed
    assert bm.evictable_block_ids() == [3, 0]
    bm.free(c)
    assert bm.num_free_blocks == 6


def test_num_cached_blocks_follows_stores_and_evictions_like_lookup():
    bm = BlockManager(num_blocks=6, block_size=4)
    waiting = make_seq([*range(12), 99])  # 3 full blocks that a (below) computes, then its own token
    assert bm.num_cached_blocks(waiting) == len(bm.lookup(waiting)) == 0
    a = make_seq(range(8))
    admit_all(bm, a), compute(bm, a)  # stores 2 of waiting's blocks: found on the next ask
    assert bm.num_cached_blocks(waiting) == len(bm.lookup(waiting)) == 2
    grown = make_seq(range(12))
    admit_all(bm, grown), compute(bm, grown)  # shares a's 2 blocks, stores the 3rd
    assert bm.num_cached_blocks(waiting) == len(bm.lookup(waiting)) == 3
    bm.free(a), bm.free(grown)
    assert bm.evictable_block_ids() == [2, 1, 0]
    other = make_seq(range(100, 116))  # 4 fresh blocks: the 3 free ones, then evicts block 2
    admit_all(bm, other)
    assert bm.num_evictions == 1
    assert bm.num_cached_blocks(waiting) == len(bm.lookup(waiting)) == 2
    bm.free(other)
    assert bm.num_cached_blocks(make_seq(range(3))) == 0  # no full block before its last token


def test_admit_counts_revived_blocks_against_the_free_pool():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(range(8))
    admit_all(bm, a), compute(bm, a)
    bm.free(a)  # blocks 1, 0 evictable; block 2 free
    b = make_seq([*range(4), 5, 5, 5, 5, 5, 5, 5, 5, 5])  # hits block 0, needs 3 fresh: 1 free + 1 evictable
    hits = bm.lookup(b)
    assert hits == [0]
    assert not bm.admit(b, hits, 13)  # 0 revived leaves 2 blocks for 3 fresh
    assert b.block_table == [] and bm.evictable_block_ids() == [1, 0] and bm.free_block_ids() == [2]
    assert bm.prefix_cache_queries == 8  # a refused admission is not a query
    assert bm.admit(b, hits, 12) and b.block_table == [0, 2, 1]


def test_duplicate_content_keeps_the_first_cached_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(range(10)), make_seq(range(10))
    admit_all(bm, a), admit_all(bm, b)  # same step: neither is cached yet
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    compute(bm, a), compute(bm, b)
    assert a.block_hashes == b.block_hashes
    assert [bm.cached_block(h) for h in b.block_hashes] == [0, 1]
    bm.free(b)
    bm.free(a)
    assert bm.free_block_ids() == [6, 7, 5, 4, 3, 2]
    assert bm.evictable_block_ids() == [1, 0]
    assert bm.num_free_blocks == 8


def test_chunked_commit_registers_blocks_as_they_fill():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(11))
    assert bm.admit(a, [], 6)
    assert a.block_table == [0, 1]
    compute(bm, a, 6)
    assert len(a.block_hashes) == 1 and bm.cached_block(a.block_hashes[0]) == 0
    assert bm.allocate(a, 11) and a.block_table == [0, 1, 2]
    compute(bm, a, 11)
    assert [bm.cached_block(h) for h in a.block_hashes] == [0, 1]
    a.append_token(99)  # decode: the block fills at 12 computed tokens
    compute(bm, a, 12)
    assert len(a.block_hashes) == 3 and bm.cached_block(a.block_hashes[2]) == 2


def test_freed_sequence_keeps_hashes_and_finds_its_own_blocks_again():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(10))
    admit_all(bm, a), compute(bm, a)
    a.append_token(7), a.append_token(8)  # 12 tokens, last one not computed
    bm.free(a)  # as a preemption does
    a.num_computed_tokens = 0
    hits = bm.lookup(a)
    assert hits == [0, 1]  # block 2 (tokens 8..11) was never full-and-computed
    assert bm.admit(a, hits, 12) and a.num_computed_tokens == 8
    assert a.block_table == [0, 1, 3]


def test_hash_chain_depends_on_parent_tokens_and_extra_keys():
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, (1, 2, 3, 4))  # deterministic, any sequence type
    assert root != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(root, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(root, [5, 6]) != hash_block_tokens(root, [5, 6], ("lora", 1))
    assert 0 <= root < 2**128
    bm = BlockManager(num_blocks=8, block_size=2)
    x, y = make_seq([1, 2, 3, 4, 0]), make_seq([9, 2, 3, 4, 0])
    bm.lookup(x), bm.lookup(y)
    assert x.block_hashes[0] != y.block_hashes[0] and x.block_hashes[1] != y.block_hashes[1]


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = make_seq(range(9)), make_seq(range(9))
    admit_all(bm, a), compute(bm, a)
    assert bm.lookup(b) == [] and a.block_hashes == []
    bm.free(a)
    assert bm.evictable_block_ids() == [] and bm.num_free_blocks == 8


@pytest.mark.parametrize("kwargs, name", [({"num_blocks": 0}, "num_blocks"), ({"num_blocks": 4, "block_size": 0}, "block_size")])
def test_bad_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BlockManager(**kwargs)


def test_admit_refuses_a_sequence_that_holds_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(3))
    admit_all(bm, a)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.admit(a, [], 3)
