"""The routing rule on replicas described by hand: estimated TTFT = (queued tokens + uncached prompt
tokens) / prefill rate, the minimum under the decode cap; what a bug in any term would change."""

from __future__ import annotations

import pytest

from podium_router.hashing import block_hashes
from podium_router.policy import Router
from podium_router.replica import DRAINING, HEALTHY, UNHEALTHY, Replica

PROMPT = list(range(1000, 1000 + 16 * 40 + 5))  # 40 full blocks and a partial one


def replica(name: str, rate: float | None = 1000.0, queued: int = 0, holds: int = 0, max_num_seqs: int = 8,
            state: str = HEALTHY) -> Replica:
    r = Replica(f"http://{name}", name)
    r.state, r.exact_prefixes, r.max_num_seqs = state, True, max_num_seqs
    r.rate.value = rate
    r.report = {"load": {"queued_tokens": queued}}
    r.cached = set(block_hashes(PROMPT, 16)[:holds])
    return r


def best(router: Router, replicas: list[Replica]) -> str:
    return router.rank(replicas, len(PROMPT), lambda r: block_hashes(PROMPT, r.block_size))[0].replica.name


def test_the_prefix_holder_wins_on_an_idle_fleet():
    fleet = [replica("a"), replica("b", holds=30), replica("c", holds=10)]
    ranked = Router().rank(fleet, len(PROMPT), lambda r: block_hashes(PROMPT, r.block_size))
    assert [c.replica.name for c in ranked] == ["b", "c", "a"]
    assert (ranked[0].cached_tokens, ranked[0].uncached_tokens) == (480, len(PROMPT) - 480)


def test_load_on_the_holder_outweighs_its_prefix():
    # b saves 480 tokens of prefill but has 600 queued: a answers sooner
    assert best(Router(), [replica("a"), replica("b", holds=30, queued=600)]) == "a"
    assert best(Router(), [replica("a"), replica("b", holds=30, queued=400)]) == "b"


def test_the_router_counts_its_own_pending_work_before_the_replica_reports_it():
    a, b = replica("a"), replica("b")
    router = Router()
    first = best(router, [a, b])
    chosen = a if first == "a" else b
    chosen.routed_request(block_hashes(PROMPT, 16), len(PROMPT))  # not yet in any report
    other = best(router, [a, b])
    assert other != first  # ...but it promised to hold the prefix: only its pending work tips it
    chosen.first_byte(len(PROMPT))
    chosen.finished_request(block_hashes(PROMPT, 16))
    assert chosen.pending_prefill == 0 and not chosen.promised


def test_a_slow_replica_takes_work_only_when_it_would_answer_sooner():
    gpu, cpu = replica("gpu", rate=20000.0), replica("cpu", rate=500.0)
    assert best(Router(), [gpu, cpu]) == "gpu"
    gpu.report = {"load": {"queued_tokens": 20000 * 2}}  # two seconds of work ahead on the GPU
    assert best(Router(), [gpu, cpu]) == "cpu"  # 645 tokens at 500/s: 1.3 s


def test_unknown_rates_get_the_mean_of_the_known_ones():
    fleet = [replica("fast", rate=4000.0, queued=2000), replica("new", rate=None, queued=1000)]
    ranked = Router(default_rate=1.0).rank(fleet, len(PROMPT), lambda r: block_hashes(PROMPT, r.block_size))
    assert [c.replica.name for c in ranked] == ["new", "fast"]
    assert ranked[0].ttft_s == pytest.approx((1000 + len(PROMPT)) / 4000.0)


def podium_replica(name: str, platform: str, rate: float, **kwargs) -> Replica:
    r = replica(name, rate=rate, **kwargs)
    r.is_podium, r.model = True, "m"
    r.report = {**r.report, "platform": platform, "device": platform}
    return r


def test_replicas_of_one_hardware_class_share_their_measured_rate():
    # b holds the prefix but its only rate sample came from a slow moment: its class's mean counts,
    # so the 480 cached tokens decide, not the samples' noise
    a, b = podium_replica("a", "cpu", rate=400.0), podium_replica("b", "cpu", rate=100.0, holds=30)
    ranked = Router().rank([a, b], len(PROMPT), lambda r: block_hashes(PROMPT, r.block_size))
    assert [c.replica.name for c in ranked] == ["b", "a"]
    assert ranked[0].ttft_s == pytest.approx((len(PROMPT) - 480) / 250.0)
    # another platform is another class: a GPU beside them keeps its own rate, and so do they
    gpu = podium_replica("gpu", "cuda", rate=20000.0, queued=20000 * 3)  # three seconds of work ahead
    ranked = Router().rank([a, b, gpu], len(PROMPT), lambda r: block_hashes(PROMPT, r.block_size))
    assert [c.replica.name for c in ranked] == ["b", "a", "gpu"]
    assert ranked[2].ttft_s == pytest.approx((60000 + len(PROMPT)) / 20000.0)
    # a replica that is not Podium is a class of its own
    other = replica("other", rate=50.0)
    assert Router().rank([a, other], len(PROMPT), lambda r: block_hashes(PROMPT, r.block_size))[1].ttft_s == \
        pytest.approx(len(PROMPT) / 50.0)


def test_replicas_sharing_a_device_count_its_queue_as_one():
    """Servers on one GPU (one device_key) time-share it: the holder of the prefix keeps the request
    whatever is queued on it, since a neighbour on the same card waits behind the same work; on
    separate devices the same queue sends it to the idle one."""
    def on(name: str, key: str | None, **kwargs) -> Replica:
        r = podium_replica(name, "cuda", rate=1000.0, **kwargs)
        if key:
            r.report = {**r.report, "device_key": key}
        return r

    shared = [on("a", "cuda:GPU-1"), on("b", "cuda:GPU-1", holds=30, queued=600), on("c", "cuda:GPU-1")]
    ranked = Router().rank(shared, len(PROMPT), lambda r: block_hashes(PROMPT, r.block_size))
    assert [c.replica.name for c in ranked][0] == "b"
    assert ranked[0].ttft_s == pytest.approx((600 + len(PROMPT) - 480) / 1000.0)
    assert ranked[1].ttft_s == pytest.approx((600 + len(PROMPT)) / 1000.0)  # the neighbours' queue is b's
    # one device each (other keys, or none reported): the idle replica answers sooner, as before
    for keys in (("cuda:GPU-1", "cuda:GPU-2", "cuda:GPU-3"), (None, None, None)):
        apart = [on("a", keys[0]), on("b", keys[1], holds=30, queued=600), on("c", keys[2])]
        assert best(Router(), apart) in ("a", "c")
    # two cards: b's neighbour a shares its queue, c on the other card is idle
    mixed = [on("a", "cuda:GPU-1"), on("b", "cuda:GPU-1", holds=30, queued=600), on("c", "cuda:GPU-2")]
    assert best(Router(), mixed) == "c"
    assert best(Router(), [on("a", "cuda:GPU-1"), on("b", "cuda:GPU-1", holds=30, queued=600)]) == "b"


def test_replicas_at_their_decode_cap_come_last():
    a, b = replica("a", max_num_seqs=2, holds=40), replica("b")
    a.in_flight = 2
    assert best(Router(), [a, b]) == "b"
    b.in_flight = 8
    assert best(Router(), [a, b]) == "a"  # everyone is capped: the rule decides again


def test_only_healthy_replicas_are_ranked():
    fleet = [replica("a", state=UNHEALTHY), replica("b", state=DRAINING), replica("c")]
    assert [c.replica.name for c in Router().rank(fleet, 10, lambda r: [])] == ["c"]
    assert Router().rank(fleet[:2], 10, lambda r: []) == []


def test_ties_rotate_over_the_fleet_and_round_robin_ignores_everything():
    fleet = [replica("a"), replica("b"), replica("c")]
    router = Router()
    assert {best(router, fleet) for _ in range(3)} == {"a", "b", "c"}
    rr = Router("round-robin")
    fleet[0].cached = set(block_hashes(PROMPT, 16))
    assert [best(rr, fleet) for _ in range(3)] == ["a", "b", "c"]


def test_without_kv_events_the_router_remembers_what_it_routed():
    r = Replica("http://other")
    r.apply_unreported(approx_capacity_tokens=16 * 8)
    hashes = block_hashes(PROMPT, 16)
    assert r.cached_blocks(hashes) == 0
    r.routed_request(hashes, len(PROMPT))
    r.finished_request(hashes)
    assert r.cached_blocks(hashes) == 0  # capacity 8 blocks: the LRU kept the last 8, not the head
    r.routed_request(hashes[:8], 16 * 8)
    r.finished_request(hashes[:8])
    assert r.cached_blocks(hashes) == 8


def test_running_decodes_and_full_slots_count_against_a_holder():
    holder, idle = replica("holder", holds=40, max_num_seqs=4), replica("idle")
    holder.report = {"load": {"queued_tokens": 4, "num_running": 4, "num_waiting": 2}}
    holder.step_time.value, holder.decode_time.value = 0.05, 2.0
    router = Router()
    ranked = router.rank([holder, idle], len(PROMPT), lambda r: block_hashes(PROMPT, r.block_size))
    # holder: (4 + 5) / 1000 + one decode step + 3 requests to finish first, one every 2.0 / 4 s
    assert ranked[0].replica.name == "idle"
    assert ranked[1].ttft_s == pytest.approx(9 / 1000 + 0.05 + 3 * 2.0 / 4)
    holder.report = {"load": {"queued_tokens": 2, "num_running": 2, "num_waiting": 0}}  # free slots
    assert best(router, [holder, idle]) == "holder"  # 0.007 + 0.05 < 0.645


def test_bad_settings_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="policy must be one of ttft, round-robin"):
        Router("random")
    with pytest.raises(ValueError, match="default_rate must be > 0"):
        Router(default_rate=0)


@pytest.mark.parametrize("with_ids", [True, False])
def test_a_replica_without_kv_events_keeps_each_models_prefixes_apart(with_ids):
    """Not Podium: the router's approximate record of what it routed there. A prompt routed under model
    ``sql`` counts as held for ``sql`` again, never for ``poet`` or for a request naming no model (such a
    replica does not say which of its models are LoRA adapters), with token ids or with text only."""
    from podium_router.proxy import Prompt

    other = Replica("http://other", "other")
    other.apply_unreported(approx_capacity_tokens=4096)

    def prompt(model):
        return Prompt(PROMPT, "", model) if with_ids else Prompt(None, "x" * 40 * 64 + "y", model)

    sent = prompt("sql").hashes(other)
    assert len(sent) == 40
    other.routed_request(sent, len(PROMPT))
    other.finished_request(sent)
    assert other.cached_blocks(prompt("sql").hashes(other)) == 40
    assert other.cached_blocks(prompt("poet").hashes(other)) == 0
    assert other.cached_blocks(prompt(None).hashes(other)) == 0
