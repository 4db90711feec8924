"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts and a prefix cache.

A sequence's K/V lives in ``seq.block_table``: token ``i`` is in block ``block_table[i // block_size]``
at offset ``i % block_size``. Every block is in exactly one of three states:

    free       ref 0, no hash      in ``_free``: FIFO, so fresh blocks come out in ascending id order
    evictable  ref 0, hash cached  in ``_evictable``: LRU, least recently freed first
    in use     ref > 0             in the block tables of ``ref`` sequences (hash cached or not)

Prefix caching: a FULL block whose K/V has been computed is registered under a chained hash
``hash(parent block's hash, its token ids, extra keys)``, so equal hashes mean equal whole prefixes.
A sequence scheduled from the waiting queue looks its full blocks up in order and shares the hits.
It always keeps at least its last token to compute (a token must be computed to sample the next),
so hits stop at block ``(num_tokens - 1) // block_size``: a hit is never written to again, and a
fully cached, block-aligned prompt recomputes its whole last block into a private block instead of
writing into a block other sequences may be reading. Unreferenced cached blocks stay cached until a
fresh block is needed and the free pool is empty; then the least recently freed one is evicted.
A sequence frees its blocks tail first, so a prefix's head outlives its tail.

KV events (for a router that tracks which prefixes a replica holds): after ``enable_events()``
every hash registered in the cache is reported as ``("stored", hash)`` and every hash evicted as
``("evicted", hash)``, in the order they happen; ``take_events()`` hands them over. Off (the
default), recording costs one ``is None`` check per registered or evicted block.

Invariants: ``ref[b]`` == the number of block tables holding ``b``; free + evictable + in use ==
all blocks, disjoint; when every sequence is freed, free + evictable == ``num_blocks``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as TokenSequence

from .lora.request import AdapterRef
from .request import Sequence

# The name and version of ``hash_block_tokens``'s scheme, as a server reports it to a router that
# recomputes the hashes (podium_router.hashing): change both together, and this name with them.
BLOCK_HASH_SCHEME = "podium-blake2b128-chain/1"


def hash_block_tokens(parent_hash: int | None, token_ids: TokenSequence[int],
                      extra_keys: tuple | None = None) -> int:
    """The chained hash of one full block: a 128-bit BLAKE2b digest of the parent hash, the block's
    token ids and ``extra_keys`` (e.g. a LoRA id or image hashes; ``None`` for plain text).

    A cryptographic digest, not ``hash()``: a crafted prompt must not be able to collide with
    another request's prefix and read its K/V.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(16, "little"))
    digest.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        digest.update(extra_keys_text(extra_keys).encode())
    return int.from_bytes(digest.digest(), "little")


def extra_keys_text(extra_keys: tuple) -> str:
    """The text ``hash_block_tokens`` digests (UTF-8) after a block's token ids for ``extra_keys``; a
    server reports it per LoRA adapter so that a router appends exactly these bytes (``podium_router.hashing``)."""
    return repr(extra_keys)


def adapter_extra_keys(lora: AdapterRef | None) -> tuple | None:
    """What besides token ids decides a block's K/V: the LoRA adapter (its registration's key, so
    blocks never pass between adapters, nor to the base model, nor to a later adapter that reuses a
    name or id); None for the base model."""
    return None if lora is None else ("lora", lora.key)


class BlockManager:
    """Hands out KV blocks to sequences and keeps the prefix cache. No tensors: only block ids."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks  # set while the block is in _cached
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens served from the cache
        self.num_evictions = 0
        self._removals = 0  # hashes ever dropped from _cached (evictions, recovery): num_cached_blocks' clock
        self._events: list[tuple[str, int]] | None = None  # recorded only after enable_events()

    # ---- state -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can get now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def cached_block(self, block_hash: int) -> int | None:
        """The block registered under ``block_hash``, or None."""
        return self._cached.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """The plain free pool, in the order it hands blocks out."""
        return list(self._free)

    def evictable_block_ids(self) -> list[int]:
        """Unreferenced cached blocks, in eviction order (least recently freed first)."""
        return list(self._evictable)

    # ---- KV events -----------------------------------------------------------------------------

    def enable_events(self) -> list[int]:
        """Start recording stored/evicted events; returns the hashes cached now (the starting state)."""
        if self._events is None:
            self._events = []
        return list(self._cached)

    def take_events(self) -> list[tuple[str, int]]:
        """The events recorded since the last call, oldest first (empty when recording is off)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    # ---- scheduling a waiting sequence ---------------------------------------------------------

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks that hold ``seq``'s leading full blocks, in order; no side effect but
        hashing. Leaves at least the last token uncached (see the module docstring)."""
        max_hits = self._max_hits(seq)
        hits = []
        for block_hash in seq.block_hashes[:max_hits]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_cached_blocks(self, seq: Sequence) -> int:
        """``len(self.lookup(seq))``, cheap when asked again (a waiting sequence's queued work, every
        step): while no hash has left the cache since the last answer, the blocks found then are
        still there and only the blocks after them are looked up."""
        removals, known = seq.cached_probe
        if removals != self._removals:
            known = 0
        max_hits = self._max_hits(seq)
        hashes, cached = seq.block_hashes, self._cached
        while known < max_hits and hashes[known] in cached:
            known += 1
        seq.cached_probe = (self._removals, known)
        return known

    def _max_hits(self, seq: Sequence) -> int:
        """How many leading blocks of ``seq`` a lookup may find (hashed up to there)."""
        if not self.enable_prefix_caching:
            return 0
        params = seq.params
        if params.prompt_logprobs is not None and seq.sample_index == 0 and not seq.num_output_tokens:
            return 0  # its prompt logprobs are owed: every prompt position must be computed (as vLLM does)
        max_hits = (seq.num_tokens - 1) // self.block_size
        self._hash_full_blocks(seq, max_hits)
        return max_hits

    def admit(self, seq: Sequence, cached_blocks: list[int], num_tokens: int) -> bool:
        """Give a waiting ``seq`` its blocks: share ``cached_blocks`` (from ``lookup``, just before)
        and add fresh blocks so its table covers ``num_tokens`` tokens. Sets
        ``seq.num_computed_tokens`` to the cached tokens. False, changing nothing, if they don't fit."""
        if seq.block_table:
            raise ValueError(f"seq: sequence {seq.seq_id} already holds blocks; free it before admitting it again")
        num_cached = len(cached_blocks) * self.block_size
        if num_tokens <= num_cached:
            raise ValueError(f"num_tokens ({num_tokens}) must exceed the cached tokens ({num_cached})")
        num_revived = sum(1 for b in cached_blocks if self._ref_counts[b] == 0)
        num_fresh = self.blocks_for(num_tokens) - len(cached_blocks)
        if num_fresh > self.num_free_blocks - num_revived:
            return False
        for block_id in cached_blocks:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1
        seq.block_table = list(cached_blocks)
        self._append_fresh(seq.block_table, num_fresh)
        seq.num_computed_tokens = num_cached
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_cached
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached
        return True

    # ---- running sequences ---------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s table to cover ``num_tokens`` tokens; False, changing nothing, if the
        blocks aren't there."""
        num_fresh = -(-num_tokens // self.block_size) - len(seq.block_table)
        if num_fresh <= 0:
            return True
        if num_fresh > len(self._free) + len(self._evictable):
            return False
        self._append_fresh(seq.block_table, num_fresh)
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the tail blocks of ``seq`` past those ``num_tokens`` tokens need (rejected
        speculative tokens' slots), tail first, as ``free`` does."""
        keep = self.blocks_for(num_tokens)
        table = seq.block_table
        while len(table) > keep:
            self._release(table.pop())

    def commit(self, seq: Sequence, num_computed_before: int) -> None:
        """Register the blocks that became full and computed since ``num_computed_before`` (the
        engine has just advanced ``seq.num_computed_tokens``). A hash already cached under
        another block keeps that block; this one stays private."""
        if not self.enable_prefix_caching:
            return
        first = num_computed_before // self.block_size
        end = seq.num_computed_tokens // self.block_size
        if first >= end:
            return
        self._hash_full_blocks(seq, end)
        for block_hash, block_id in zip(seq.block_hashes[first:end], seq.block_table[first:end]):
            if block_hash not in self._cached:
                self._cached[block_hash] = block_id
                self._block_hash[block_id] = block_hash
                if self._events is not None:
                    self._events.append(("stored", block_hash))

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s references, tail first, and clear its table. Its hashes stay (its
        tokens have not changed), ready for a lookup if it is scheduled again."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []

    def release_all(self) -> None:
        """Recovery after a failed step, once no sequence holds a block (``Scheduler.reset``): every
        reference count back to 0 and the pools rebuilt from the prefix cache. Cached blocks stay
        cached (their K/V was complete when they were cached; a step only writes past its
        sequences' computed tokens); an entry that disagrees with its block is dropped with an
        "evicted" event, so a router's view stays true."""
        n = self.num_blocks
        kept = {h: b for h, b in self._cached.items() if 0 <= b < n and self._block_hash[b] == h}
        if self._events is not None:
            self._events.extend(("evicted", h) for h in self._cached if h not in kept)
        self._removals += len(self._cached) - len(kept)
        self._cached = kept
        self._block_hash = [None] * n
        for block_hash, block_id in kept.items():
            self._block_hash[block_id] = block_hash
        self._ref_counts = [0] * n
        # the old orders first (the least recently used evicted first), then the blocks that were held
        evictable = OrderedDict.fromkeys(b for b in self._evictable if self._block_hash[b] is not None)
        evictable.update(OrderedDict.fromkeys(b for b in kept.values() if b not in evictable))
        self._evictable = evictable
        free = [b for b in dict.fromkeys(self._free) if 0 <= b < n and self._block_hash[b] is None]
        seen = set(free)
        self._free = deque(free + [b for b in range(n) if self._block_hash[b] is None and b not in seen])

    def _release(self, block_id: int) -> None:
        count = self._ref_counts[block_id] - 1
        self._ref_counts[block_id] = count
        if count == 0:
            if self._block_hash[block_id] is None:
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None

    # ---- helpers -------------------------------------------------------------------------------

    def _append_fresh(self, block_table: list[int], count: int) -> None:
        for _ in range(count):
            block_id = self._take_fresh()
            self._ref_counts[block_id] = 1
            block_table.append(block_id)

    def _take_fresh(self) -> int:
        if self._free:
            return self._free.popleft()
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._block_hash[block_id]
        del self._cached[block_hash]
        self._removals += 1
        self._block_hash[block_id] = None
        if self._events is not None:
            self._events.append(("evicted", block_hash))
        self.num_evictions += 1
        return block_id

    def _hash_full_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Extend ``seq.block_hashes`` to its first ``num_blocks`` blocks (all full)."""
        hashes, tokens, size = seq.block_hashes, seq.token_ids, self.block_size
        extra_keys = adapter_extra_keys(seq.lora)
        for index in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[index * size:(index + 1) * size], extra_keys))

