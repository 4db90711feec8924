"""The prefix cache's KV events, from the block manager through the server's log to the router.

The router recomputes block hashes without importing the core (podium_router.hashing); these
tests hold its code and the core's ``hash_block_tokens`` to the same answers, and the scheme names
together, so a change to one fails here until the other follows. A request with a LoRA adapter
hashes the adapter's key too: the router takes the text the replica reports for it
(``block_hash_extra``) and must land on the block manager's hashes, through a real server as well.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from podium.block_manager import BLOCK_HASH_SCHEME, BlockManager, adapter_extra_keys, extra_keys_text, hash_block_tokens
from podium.lora.request import AdapterRef
from podium.request import Sequence
from podium.sampling_params import SamplingParams
from podium_router import hashing
from podium_router.replica import Replica
from podium_server.replica import KVEventLog


def _seq(seq_id: int, tokens: list[int], lora: AdapterRef | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(), lora=lora)


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


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_router_hashes_of_an_adapter_request_equal_the_block_managers(block_size):
    """With the ``block_hash_extra`` a replica reports for an adapter (its key there), the router's hashes
    are the block manager's for a sequence with that adapter; the base model's and another adapter's differ."""
    rng = random.Random(block_size)
    sql, poet = (AdapterRef(key, name, key, f"/adapters/{name}", 8) for key, name in ((3, "sql"), (4, "poet")))
    extra = extra_keys_text(adapter_extra_keys(sql))
    for length in (block_size + 1, 5 * block_size + 3):
        tokens = [rng.randrange(0, 200_000) for _ in range(length)]
        bm = BlockManager(64, block_size)
        seqs = [_seq(i, tokens, lora) for i, lora in enumerate((sql, poet, None))]
        for seq in seqs:
            bm.lookup(seq)
        expected = [f"{h:032x}" for h in seqs[0].block_hashes]
        assert hashing.block_hashes(tokens, block_size, extra) == expected
        others = {f"{h:032x}" for seq in seqs[1:] for h in seq.block_hashes}
        assert len(expected) == len(seqs[1].block_hashes) == len(seqs[2].block_hashes) and others.isdisjoint(expected)
        assert hashing.block_hashes(tokens, block_size) == [f"{h:032x}" for h in seqs[2].block_hashes]


def test_a_replica_reports_its_adapters_and_the_router_hashes_an_adapter_requests_blocks(tmp_path):
    """``podium serve``'s app over a tiny model with enable_lora: loading an adapter puts it in the
    replica report (with its ``block_hash_extra``), unloading takes it out; a completion naming it
    stores exactly the blocks the router computes for it on that replica (the KV events), the same
    prompt on the base model exactly the router's base-model hashes."""
    from fastapi.testclient import TestClient
    from lora_fixtures import make_adapter
    from model_fixtures import ARCHITECTURES, save_tiny_model

    from podium import LLM
    from podium_router.proxy import Prompt
    from podium_server.app import create_app
    from podium_server.settings import ServerSettings

    model_type, overrides = ARCHITECTURES["llama3-rope-untied"]
    save_tiny_model(model_type, overrides, tmp_path / "base")
    make_adapter(tmp_path / "base", tmp_path / "sql", seed=1, targets=("q_proj", "v_proj"))
    llm = LLM(str(tmp_path / "base"), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64,
              enforce_eager=True, enable_lora=True, max_lora_rank=8)
    prompt = list(range(3, 16))  # 13 tokens: three full blocks a later request could hit
    router_view = Replica("http://replica")

    def stored_by(client, body: dict) -> set[str]:
        before = set(client.get("/podium/v1/kv_events").json()["block_hashes"])  # (a reset: every hash cached)
        assert client.post("/v1/completions", json={**body, "prompt": prompt, "max_tokens": 1}).status_code == 200
        return set(client.get("/podium/v1/kv_events").json()["block_hashes"]) - before

    with TestClient(create_app(ServerSettings(engine_mode="thread"), llm.engine)) as client:
        first = client.get("/podium/v1/replica").json()
        assert first["lora"] == {"enabled": True, "adapters": []}
        # the hardware's identity, which the router groups co-located replicas by: this host's cores
        import socket
        assert first["device_key"] == llm.engine.platform.device_key(0)
        assert first["device_key"].startswith(f"{socket.gethostname()}/cpu:")
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(tmp_path / "sql")})
        assert loaded.status_code == 200, loaded.text
        report = client.get("/podium/v1/replica").json()
        router_view.apply_report(report, 4096)
        assert [a["name"] for a in report["lora"]["adapters"]] == ["sql"] and router_view.serves("sql")
        assert report["lora"]["adapters"][0]["path"] == str(tmp_path / "sql")
        adapter_hashes = Prompt(prompt, "", "sql").hashes(router_view)
        base_hashes = Prompt(prompt, "", report["model"]).hashes(router_view)
        assert len(adapter_hashes) == 3 and not set(adapter_hashes) & set(base_hashes)
        assert stored_by(client, {"model": "sql"}) == set(adapter_hashes)
        assert stored_by(client, {}) == set(base_hashes)
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        router_view.apply_report(client.get("/podium/v1/replica").json(), 4096)
        assert router_view.adapters == {} and not router_view.serves("sql")


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
