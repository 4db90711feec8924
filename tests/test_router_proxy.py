"""The router's failover and pass-through against fake OpenAI servers (not Podium: no replica report,
no KV events), each served by uvicorn on a thread: fast, and each failure made exactly when wanted.
Then LoRA adapters over fake Podium replicas (a replica report listing adapters, KV events as resets):
a request naming an adapter goes only where it is loaded, ``/v1/models`` lists adapters with their
parent, and prefix-aware routing hashes an adapter request with each replica's own key for it."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from router_fixtures import free_port, wait_for

from podium_router.app import create_app
from podium_router.hashing import BLOCK_HASH_SCHEME, block_hashes
from podium_router.settings import ReplicaSpec, RouterSettings

pytestmark = pytest.mark.timeout(120)


HALF_EVENT = 'data: {"choices": [{"index": 0, "te'


def fake_replica(behaviour: str, seen: list) -> FastAPI:
    """An OpenAI-ish server: ``ok`` streams five chunks; ``busy`` answers 503; ``cut`` drops the
    connection after two chunks; ``dead-early`` drops it before the first; ``slow-checks`` streams
    like ``ok`` but takes 1.5 s to answer a health check; ``half`` drops the connection half-way
    through its second event; ``limited`` answers 429 with a Retry-After; ``slow`` streams 200 chunks
    20 ms apart and records ``("aborted", i)`` in ``seen`` if its client goes away at chunk i."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        if behaviour == "slow-checks":
            await asyncio.sleep(1.5)
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append((request.headers.get("x-request-id"), body.get("prompt")))
        if behaviour == "busy":
            return JSONResponse({"error": {"message": "engine dead", "code": None}}, status_code=503)
        if behaviour == "limited":
            return JSONResponse({"error": {"message": "tenant over its limit", "code": "rate_limited"}},
                                status_code=429, headers={"Retry-After": "7"})
        if not body.get("stream"):
            return {"choices": [{"index": 0, "text": "hello", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}

        async def chunks():
            for i in range(5):
                if behaviour == "dead-early" or (behaviour == "cut" and i == 2):
                    raise ConnectionError("the replica died")
                if behaviour == "half" and i == 1:
                    yield HALF_EVENT
                    await asyncio.sleep(0.05)
                    raise ConnectionError("the replica died")
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"

        async def slowly():
            for i in range(200):
                try:
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
                    await asyncio.sleep(0.02)
                except (asyncio.CancelledError, GeneratorExit):
                    seen.append(("aborted", i))
                    raise
            yield "data: [DONE]\n\n"

        return StreamingResponse(slowly() if behaviour == "slow" else chunks(), media_type="text/event-stream")

    return app


class Served:
    """An ASGI app served by uvicorn on a thread of this process."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 20, f"uvicorn on {self.url}", interval=0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def fleet():
    """``fleet(*behaviours, **settings)``: fake replicas and a router over them, all stopped after."""
    started = []

    def make(*behaviours: str, **settings):
        seen: list = []
        replicas = [Served(fake_replica(b, seen)) for b in behaviours]
        router_settings = RouterSettings(replicas=tuple(ReplicaSpec(r.url, b) for r, b in zip(replicas, behaviours)),
                                         poll_interval_s=0.05, **settings)
        router = Served(create_app(router_settings))
        started.extend([router, *replicas])
        wait_for(lambda: len(httpx.get(router.url + "/admin/replicas", headers=_auth(settings)).json()["replicas"])
                 == len(behaviours) and httpx.get(router.url + "/health").status_code == 200, 20, "healthy replicas")
        time.sleep(0.2)  # every replica passes its first check
        return router, seen

    yield make
    for served in started:
        served.stop()


def _auth(settings: dict) -> dict:
    return {"Authorization": f"Bearer {settings['api_key']}"} if settings.get("api_key") else {}


def _stream(url: str, prompt: str = "hi", headers: dict | None = None) -> tuple[int, str, httpx.Headers]:
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": prompt, "stream": True}, timeout=20,
                      headers=headers) as response:
        return response.status_code, response.read().decode(), response.headers


def test_a_replica_answering_503_is_retried_on_another(fleet):
    router, seen = fleet("busy", "ok", policy="round-robin")
    for _ in range(4):
        status, text, headers = _stream(router.url)
        assert status == 200 and headers["x-podium-replica"] == "ok" and text.endswith("data: [DONE]\n\n")
        assert "error" not in text
    metrics = httpx.get(router.url + "/metrics").text
    assert re.search(r'^podium_router:retries_total\{replica="ok"\} [1-9]', metrics, re.M), metrics


def test_a_replica_slow_to_answer_its_checks_stays_in_routing(fleet):
    # a busy host delays the answers (or the router's reading of them): slow is not dead
    router, _ = fleet("slow-checks")
    deadline = time.monotonic() + 4  # many checks at 0.05 s intervals, each answered after 1.5 s
    while time.monotonic() < deadline:
        assert httpx.get(router.url + "/admin/replicas").json()["replicas"][0]["state"] == "healthy"
        time.sleep(0.2)
    status, text, headers = _stream(router.url)
    assert status == 200 and headers["x-podium-replica"] == "slow-checks" and text.endswith("data: [DONE]\n\n")


def test_a_connection_dropped_before_the_first_byte_is_retried(fleet):
    router, _ = fleet("dead-early", "ok", policy="round-robin")
    for _ in range(4):
        status, text, headers = _stream(router.url)
        assert status == 200 and headers["x-podium-replica"] == "ok" and text.count("data: ") == 6


def test_a_stream_cut_mid_way_ends_with_one_error_event(fleet):
    router, _ = fleet("cut")
    status, text, _ = _stream(router.url)
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert status == 200 and len(events) == 4, text
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
    assert json.loads(events[2])["error"]["code"] == "replica_failed" and events[3] == "[DONE]"


def test_a_stream_cut_inside_an_event_ends_that_event_before_the_error_event(fleet):
    router, _ = fleet("half")
    status, text, _ = _stream(router.url)
    first = f"data: {json.dumps({'choices': [{'index': 0, 'text': 't0'}]})}\n\n"
    assert status == 200 and text.startswith(first + HALF_EVENT + "\n\ndata: "), text
    events = text[len(first + HALF_EVENT + "\n\n"):].split("\n\n")
    assert json.loads(events[0][len("data: "):])["error"]["code"] == "replica_failed"
    assert events[1:] == ["data: [DONE]", ""]


def test_streams_pass_through_byte_for_byte_with_the_replicas_content_type(fleet):
    router, _ = fleet("ok")
    replica_url = httpx.get(router.url + "/admin/replicas").json()["replicas"][0]["url"]
    direct, routed = _stream(replica_url, headers={"X-Request-Id": "same"}), _stream(router.url)
    assert routed[:2] == direct[:2] and routed[1].count("data: ") == 6
    assert routed[2]["content-type"] == direct[2]["content-type"] == "text/event-stream; charset=utf-8"
    assert routed[2]["x-podium-replica"] == "ok" and routed[2]["cache-control"] == "no-cache"


def test_a_429_comes_back_as_the_replica_sent_it_with_its_retry_after(fleet):
    router, seen = fleet("limited", "ok", policy="round-robin")
    for _ in range(2):  # (one of the two goes to "limited")
        response = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "t-1"})
        if response.headers["x-podium-replica"] == "limited":
            break
    assert response.status_code == 429 and response.headers["retry-after"] == "7"
    assert response.json()["error"]["code"] == "rate_limited" and response.headers["x-request-id"] == "t-1"
    assert len(seen) <= 2  # not retried on the other replica


def test_a_client_going_away_mid_stream_aborts_the_request_at_the_replica(fleet):
    router, seen = fleet("slow")
    with httpx.stream("POST", router.url + "/v1/completions", json={"prompt": "hi", "stream": True},
                      timeout=20) as response:
        assert next(response.iter_lines()).startswith("data: ")
    # (leaving the block closed the client's connection after its first event)
    aborted = wait_for(lambda: [i for what, i in seen if what == "aborted"], 10, "the replica to see its client go")
    assert aborted[0] < 100  # long before the stream's end (200 chunks)
    wait_for(lambda: re.search(r'^podium_router:requests_total\{outcome="client_gone",replica="slow"\} 1', httpx.get(
        router.url + "/metrics").text, re.M), 10, "the client_gone outcome")


def test_when_every_replica_fails_the_client_gets_a_503_not_a_hang(fleet):
    router, _ = fleet("busy", "dead-early")
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "stream": True}, timeout=20)
    assert response.status_code == 503 and response.json()["error"]["code"] == "replicas_failed"


def test_request_ids_pass_through_and_non_streaming_bodies_are_relayed(fleet):
    router, seen = fleet("ok")
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "abc-1"})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "hello"
    assert response.headers["x-request-id"] == "abc-1" and seen[-1][0] == "abc-1"
    response = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"})
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"]) and seen[-1][0] == \
        response.headers["x-request-id"]
    bad = httpx.post(router.url + "/v1/completions", content=b"{not json")
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    wrong = httpx.get(router.url + "/v1/chat/completions")  # the path is there, for POST only
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed" and len(seen) == 2  # nothing reached a replica


def test_without_kv_events_a_prefix_follows_what_was_routed(fleet):
    router, seen = fleet("ok", "ok2")
    prefix = "A long shared system prompt about the library rules. " * 10
    served = {_stream(router.url, f"{prefix} question {i}")[2]["x-podium-replica"] for i in range(4)}
    assert len(served) == 1  # the approximate record kept every one on the first replica
    other = {_stream(router.url, f"different text {i} " * 20)[2]["x-podium-replica"] for i in range(2)}
    assert other  # (any replica may take unrelated prompts)


def test_the_api_key_guards_everything_but_health_and_metrics(fleet):
    router, _ = fleet("ok", api_key="sesame")
    assert httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(router.url + "/admin/replicas").status_code == 401
    ok = httpx.post(router.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer sesame"})
    assert ok.status_code == 200
    assert httpx.get(router.url + "/health").status_code == 200 and httpx.get(router.url + "/metrics").status_code == 200


# -- LoRA adapters over fake Podium replicas ----------------------------------------------------------
BASE, BLOCK = "base-model", 4


def fake_podium_replica(name: str, state: dict, seen: list) -> FastAPI:
    """A Podium replica as the router sees it: its report lists ``state["adapters"]`` (name -> its
    block_hash_extra) and its KV events hold ``state["cached"]`` (as a reset, every poll); each
    completion is recorded as (replica, model) and answered at once."""
    app = FastAPI()

    @app.get("/podium/v1/replica")
    async def report():
        adapters = [{"name": n, "path": f"/adapters/{n}", "block_hash_extra": extra}
                    for n, extra in state["adapters"].items()]
        return {"version": 1, "model": BASE, "aliases": [], "max_model_len": 64, "platform": "fake", "device": "cpu",
                "kv_capacity_tokens": 4096, "max_num_seqs": 8, "alive": True,
                "load": {"queued_tokens": 0, "running_tokens": 0, "num_running": 0, "num_waiting": 0},
                "prefill": {"tokens": 0, "seconds": 0.0}, "decode": {"steps": 0, "seconds": 0.0},
                "prefix_cache": {"block_hash_scheme": BLOCK_HASH_SCHEME, "block_size": BLOCK, "epoch": name, "seq": 0},
                "lora": {"enabled": True, "adapters": adapters}}

    @app.get("/podium/v1/kv_events")
    async def kv_events():
        await asyncio.sleep(0.05)
        return {"epoch": name, "seq": 0, "reset": True, "block_hashes": sorted(state["cached"])}

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append((name, (await request.json()).get("model")))
        return {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}

    return app


@pytest.fixture
def podium_fleet():
    """``podium_fleet(states, **settings)``: a fake Podium replica per state (named a, b, ...) and a router."""
    started = []

    def make(states: list[dict], **settings):
        seen: list = []
        names = "abcdefgh"[:len(states)]
        replicas = [Served(fake_podium_replica(n, state, seen)) for n, state in zip(names, states)]
        router = Served(create_app(RouterSettings(replicas=tuple(ReplicaSpec(r.url, n) for r, n in zip(replicas, names)),
                                                  poll_interval_s=0.05, **settings)))
        started.extend([router, *replicas])
        wait_for(lambda: all(r["state"] == "healthy" for r in _known(router).values()) and len(_known(router)) ==
                 len(states), 20, "healthy replicas")
        return router, seen

    yield make
    for served in started:
        served.stop()


def _known(router: Served) -> dict[str, dict]:
    return {r["name"]: r for r in httpx.get(router.url + "/admin/replicas").json()["replicas"]}


def _complete(router: Served, model: str | None, prompt="hi") -> httpx.Response:
    return httpx.post(router.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                            **({"model": model} if model else {})}, timeout=20)


def test_an_adapter_is_routed_only_where_it_is_loaded_and_listed_with_its_parent(podium_fleet):
    a, b = {"adapters": {"sql": "('lora', 1)"}, "cached": set()}, {"adapters": {"poet": "('lora', 1)"}, "cached": set()}
    router, seen = podium_fleet([a, b], policy="round-robin")
    for model in ("sql", "poet") * 3 + (BASE, BASE, None, None):
        assert _complete(router, model).status_code == 200
    assert {m: {r for r, asked in seen if asked == m} for m in ("sql", "poet", BASE)} == \
        {"sql": {"a"}, "poet": {"b"}, BASE: {"a", "b"}}
    missing = _complete(router, "nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    cards = {c["id"]: c for c in httpx.get(router.url + "/v1/models").json()["data"]}
    assert set(cards) == {BASE, "sql", "poet"} and "parent" not in cards[BASE]
    assert (cards["sql"]["parent"], cards["sql"]["root"], cards["poet"]["parent"]) == (BASE, "/adapters/sql", BASE)

    # b loads sql and unloads poet (its report changes): sql goes to both, poet nowhere
    b["adapters"] = {"sql": "('lora', 2)"}
    wait_for(lambda: _known(router)["b"]["lora_adapters"] == ["sql"], 10, "b's new report")
    seen.clear()
    for _ in range(4):
        assert _complete(router, "sql").status_code == 200
    assert {r for r, _ in seen} == {"a", "b"}
    assert _complete(router, "poet").status_code == 404
    assert "poet" not in {c["id"] for c in httpx.get(router.url + "/v1/models").json()["data"]}


def test_prefix_routing_hashes_an_adapter_request_with_each_replicas_key(podium_fleet):
    """Both replicas load sql, under their own keys; a cached the prompt's blocks for sql, b for the base
    model and for poet (whose key on b is sql's key on a). Each request goes where its own blocks are:
    hashed as the base model, or with the other replica's key, the router would send sql to b."""
    prompt = list(range(100, 100 + 10 * BLOCK + 1))
    a = {"adapters": {"sql": "('lora', 1)"}, "cached": set(block_hashes(prompt, BLOCK, "('lora', 1)"))}
    b = {"adapters": {"poet": "('lora', 1)", "sql": "('lora', 2)"},
         "cached": set(block_hashes(prompt, BLOCK)) | set(block_hashes(prompt, BLOCK, "('lora', 1)"))}
    router, seen = podium_fleet([a, b])
    wait_for(lambda: [r["cached_blocks"] for r in _known(router).values()] == [10, 20], 10, "the KV events")
    for model in ("sql", BASE, "poet", "sql", BASE):
        assert _complete(router, model, prompt).status_code == 200
    assert seen == [("a", "sql"), ("b", BASE), ("b", "poet"), ("a", "sql"), ("b", BASE)]
