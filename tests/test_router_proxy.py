"""The router's failover and pass-through against fake OpenAI servers (not Podium: no replica report,
no KV events), each served by uvicorn on a thread: fast, and each failure made exactly when wanted."""

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
from podium_router.settings import ReplicaSpec, RouterSettings

pytestmark = pytest.mark.timeout(120)


def fake_replica(behaviour: str, seen: list) -> FastAPI:
    """An OpenAI-ish server: ``ok`` streams five chunks; ``busy`` answers 503; ``cut`` drops the
    connection after two chunks; ``dead-early`` drops it before the first; ``slow-checks`` streams
    like ``ok`` but takes 1.5 s to answer a health check."""
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
        if not body.get("stream"):
            return {"choices": [{"index": 0, "text": "hello", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}

        async def chunks():
            for i in range(5):
                if behaviour == "dead-early" or (behaviour == "cut" and i == 2):
                    raise ConnectionError("the replica died")
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
                await asyncio.sleep(0.01)
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

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
