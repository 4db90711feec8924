"""The server as a shared service: request ids, tenants with limits, the audit log, exemplars.

Against the scripted engine on a thread (fast, every output known exactly; scripted_engine.py),
with real sockets (uvicorn on a thread), so headers, status codes and concurrency are real.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from scripted_engine import Knobs, ScriptedEngine, expected
from test_server_plumbing import ThreadServer

from podium.tenant import Tenant
from podium_server.app import create_app
from podium_server.audit import AuditSettings
from podium_server.settings import ServerSettings
from podium_server.tenants import parse_keys_file
from podium_server.thread_engine import ThreadEngine

KEYS = {"a": "key-of-team-a", "b": "key-of-team-b", "c": "key-of-team-c", "d": "key-of-team-d"}
AUDIT_FIELDS = {"time", "request_id", "tenant", "model", "endpoint", "prompt_tokens", "completion_tokens",
                "finish_reason", "status", "latency_s", "client"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def keys_toml(keys: dict[str, str]) -> str:
    return f"""
[tenants.a]
requests_per_minute = 3
[tenants.b]
max_concurrent_requests = 4
[tenants.c]
tokens_per_minute = 20
[tenants.d]
max_tokens = 20
weight = 2

{"".join(f'[[keys]]{chr(10)}sha256 = "{sha(k)}"{chr(10)}tenant = "{t}"{chr(10)}' for t, k in keys.items())}
"""


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def serve(settings: ServerSettings, knobs: Knobs | None = None) -> tuple[ThreadServer, ScriptedEngine]:
    engine = ScriptedEngine(knobs or Knobs())
    return ThreadServer(create_app(settings, ThreadEngine(engine))), engine


def complete(client: httpx.Client, tenant: str | None = None, extra_headers: dict | None = None,
             **body) -> httpx.Response:
    headers = {**(auth(tenant) if tenant else {}), **(extra_headers or {})}
    return client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, **body}, headers=headers)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(keys_toml(KEYS))
    return path


@pytest.fixture(scope="module")
def tenant_server(keys_file):
    knobs = Knobs()
    settings = ServerSettings(api_keys_file=str(keys_file), api_key="the-single-key")
    srv, engine = serve(settings, knobs)
    with srv:
        srv.engine, srv.knobs = engine, knobs
        yield srv


@pytest.fixture()
def client(tenant_server):
    with httpx.Client(base_url=tenant_server.url, timeout=30) as c:
        yield c


# -- request ids -----------------------------------------------------------------------------------
def test_request_id_is_honoured_or_made_and_returned_even_on_refusals(client):
    r = complete(client, "d", max_tokens=2)
    made = r.headers["x-request-id"]
    assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", made)
    r = client.post("/v1/completions", json={"prompt": "abc"}, headers={**auth("d"), "X-Request-Id": "job-7:step.2"})
    assert r.headers["x-request-id"] == "job-7:step.2"
    r = client.post("/v1/completions", json={"prompt": "abc"}, headers={"X-Request-Id": "mine-401"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "mine-401"
    assert r.json()["error"]["code"] == "invalid_api_key"
    unusable = client.get("/v1/models", headers={**auth("d"), "X-Request-Id": "has spaces\tand tabs"})
    assert re.fullmatch(r"[0-9a-f]{32}", unusable.headers["x-request-id"])  # replaced, not echoed into logs
    assert client.get("/health", headers={"X-Request-Id": "probe-1"}).headers["x-request-id"] == "probe-1"


# -- tenants and limits ----------------------------------------------------------------------------
def test_requests_per_minute_the_next_request_gets_429_with_retry_after(client):
    assert [complete(client, "a").status_code for _ in range(3)] == [200, 200, 200]
    r = complete(client, "a")
    assert r.status_code == 429
    assert 1 <= int(r.headers["retry-after"]) <= 60
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests" and "3 requests per minute" in \
        error["message"] and set(error) == {"message", "type", "param", "code"}
    assert complete(client, "d").status_code == 200  # another tenant is not affected


def test_concurrency_limit_holds_under_64_parallel_requests(client, tenant_server):
    engine, knobs = tenant_server.engine, tenant_server.knobs
    knobs.step_seconds = 0.01
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            in_engine = [r["tenant"] for r in list(engine.requests.values())]
            peak[0] = max(peak[0], sum(1 for t in in_engine if t is not None and t.name == "b"))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(64) as pool:
            responses = list(pool.map(lambda _: complete(client, "b", max_tokens=20), range(64)))
    finally:
        stop.set()
        watcher.join()
        knobs.step_seconds = 0.002
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 4
    assert all(r.headers["retry-after"] == "1" for r in responses if r.status_code == 429)
    assert 1 <= peak[0] <= 4, "tenant b never has more than 4 requests in the engine"
    for r in responses:
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == expected([0, 1, 2], 0, 20)


def test_tokens_per_minute_and_max_tokens_and_the_tenant_reaches_the_engine(client, tenant_server):
    r = complete(client, "c", max_tokens=18)  # 3 + 18 tokens: over the 20 tokens per minute
    assert r.status_code == 200
    r = complete(client, "c")
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens" and int(r.headers["retry-after"]) >= 1
    r = complete(client, "d", max_tokens=21)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "at most 20" in r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                    headers=auth("d"))  # no max_tokens (until the context is full): clamped to the limit
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
    tenants = tenant_server.engine.tenants
    assert tenants[r.json()["id"]] == Tenant("d", 2.0)
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2},
                    headers={"Authorization": "Bearer the-single-key"})
    assert r.status_code == 200 and tenants[r.json()["id"]] == Tenant("default", 1.0)


def test_per_tenant_metrics_name_tenants_never_keys(client):
    complete(client, "d")
    text = client.get("/metrics").text
    assert re.search(r'podium:tenant_requests_total\{status="200",tenant="d"\} [1-9]', text)
    assert re.search(r'podium:tenant_rejections_total\{reason="requests_per_minute",tenant="a"\} [1-9]', text)
    assert re.search(r'podium:tenant_generation_tokens_total\{tenant="d"\} [1-9]', text)
    assert not any(key in text or sha(key) in text for key in KEYS.values())


def test_keys_file_reload_takes_effect_without_a_restart(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"sha256": sha("old"), "tenant": "x"}]}))
    srv, _ = serve(ServerSettings(api_keys_file=str(path)))
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        headers = {"old": {"Authorization": "Bearer old"}, "new": {"Authorization": "Bearer new"}}
        assert c.get("/v1/models", headers=headers["old"]).status_code == 200
        assert c.get("/v1/models", headers=headers["new"]).status_code == 401
        path.write_text(json.dumps({"tenants": {"y": {"requests_per_minute": 1}},
                                    "keys": [{"sha256": sha("new"), "tenant": "y"}]}))
        time.sleep(1.1)  # the file is looked at again at most once a second
        assert c.get("/v1/models", headers=headers["old"]).status_code == 401
        assert complete(c, extra_headers=headers["new"]).status_code == 200
        assert complete(c, extra_headers=headers["new"]).status_code == 429  # the new file's limit holds
        path.write_text("{ not json")
        time.sleep(1.1)
        assert c.get("/v1/models", headers=headers["new"]).status_code == 200  # broken file: previous keys kept
        assert c.get("/v1/models", headers=headers["old"]).status_code == 401


def test_bad_keys_files_are_refused_at_startup_naming_the_problem(tmp_path):
    cases = {"[[keys]]\nsha256 = 'abc'\ntenant = 'x'\n": "64 hex digits",
             f"[tenants.x]\nrpm = 3\n[[keys]]\nsha256 = '{sha('k')}'\ntenant = 'x'\n": "not a known limit",
             f"[tenants.x]\nweight = -1\n[[keys]]\nsha256 = '{sha('k')}'\ntenant = 'x'\n": "positive",
             "keys = []\n": "no keys"}
    for i, (text, problem) in enumerate(cases.items()):
        path = tmp_path / f"k{i}.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match=problem):
            ServerSettings(api_keys_file=str(path))
    assert parse_keys_file(_write(tmp_path / "ok.toml", keys_toml(KEYS)))[sha(KEYS["d"])].max_tokens == 20


def _write(path, text):
    path.write_text(text)
    return path


# -- audit log ---------------------------------------------------------------------------------------
def _audit_lines(path) -> list[dict]:
    files = sorted(path.parent.glob(path.name + "*"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def _mixed_requests(c: httpx.Client, n: int) -> list[tuple[str, int]]:
    """n concurrent requests of several kinds; (request id, expected status) of each."""
    def one(i: int) -> tuple[str, int]:
        rid, kind = f"load-{i}", i % 4
        headers = {"X-Request-Id": rid}
        if kind == 0:
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4}, headers=headers)
        elif kind == 1:
            with c.stream("POST", "/v1/chat/completions", headers=headers, json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as r:
                r.read()
        elif kind == 2:
            r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "n": 2}, headers=headers)
        else:
            r = c.post("/v1/completions", json={"prompt": "abc", "model": "nope"}, headers=headers)
        return rid, r.status_code

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(n)))


def test_audit_log_one_valid_line_per_request_under_load_without_text(tmp_path):
    path = tmp_path / "audit" / "audit.jsonl"
    srv, _ = serve(ServerSettings(audit=AuditSettings(str(path))))
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        sent = _mixed_requests(c, 64)
        c.get("/health")  # not an API request: not audited
    lines = _audit_lines(path)
    assert sorted(e["request_id"] for e in lines) == sorted(rid for rid, _ in sent)
    by_id = {e["request_id"]: e for e in lines}
    for rid, status in sent:
        entry = by_id[rid]
        assert set(entry) == AUDIT_FIELDS and entry["status"] == status and entry["tenant"] is None
        assert entry["model"] == "letters" and entry["latency_s"] > 0 and entry["client"].startswith("127.0.0.1:")
        kind = int(rid.split("-")[1]) % 4
        assert entry["endpoint"] == ("/v1/chat/completions" if kind == 1 else "/v1/completions")
        assert (entry["prompt_tokens"], entry["completion_tokens"], entry["finish_reason"]) == {
            0: (3, 4, ["length"]), 1: (4, 4, ["length"]), 2: (3, 4, ["length", "length"]), 3: (0, 0, None)}[kind]


def test_audit_log_content_and_rotation(tmp_path):
    path = tmp_path / "audit.jsonl"
    srv, _ = serve(ServerSettings(audit=AuditSettings(str(path), content=True, max_bytes=2048, backups=2)))
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5}, headers={"X-Request-Id": "first"})
        deadline = time.time() + 10  # the line is written just after the response went out
        while not path.read_text() and time.time() < deadline:
            time.sleep(0.01)
        entry = json.loads(path.read_text().splitlines()[0])
        assert entry["prompt"] == "abc" and entry["output"] == [expected([0, 1, 2], 0, 5)] == \
            [r.json()["choices"][0]["text"]]
        sent = _mixed_requests(c, 40)
    files = sorted(tmp_path.glob("audit.jsonl*"))
    assert [f.name for f in files] == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]  # older ones dropped
    assert all(f.stat().st_size <= 2048 for f in files)
    lines = _audit_lines(path)  # every kept line is whole JSON, and the newest requests are all there
    ids = [e["request_id"] for e in lines]
    assert len(ids) == len(set(ids)) and ids[-1] in {rid for rid, _ in sent}


def test_the_guards_json_limits_and_drain_cover_tenant_requests_and_are_audited(tmp_path, keys_file):
    """The service middleware is outermost: a body the guard refuses (JSON nested too deep) or a request
    refused while draining still carries its id and is audited, and the audit never parses the hostile
    body itself (a 10,000-deep body would raise RecursionError there)."""
    path = tmp_path / "audit.jsonl"
    settings = ServerSettings(api_keys_file=str(keys_file), audit=AuditSettings(str(path), content=True))
    app = create_app(settings, ThreadEngine(ScriptedEngine(Knobs())))
    deep = "[" * 10_000 + "]" * 10_000
    with ThreadServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        headers = {**auth("b"), "Content-Type": "application/json"}
        r = c.post("/v1/completions", content=f'{{"prompt": "abc", "x": {deep}}}',
                   headers={**headers, "X-Request-Id": "too-deep"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep"
        assert r.headers["x-request-id"] == "too-deep"
        assert c.post("/v1/completions", json={"prompt": "abc"}).status_code == 401  # the key first
        app.state.drain.draining = True
        r = complete(c, "b", extra_headers={"X-Request-Id": "draining"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining"
        assert r.headers["x-request-id"] == "draining" and r.headers["retry-after"].isdigit()
        app.state.drain.draining = False
        assert complete(c, "b").status_code == 200  # the tenant's concurrency slots came back
        deadline = time.time() + 10
        while len(_audit_lines(path)) < 4 and time.time() < deadline:
            time.sleep(0.01)
    by_id = {e["request_id"]: e for e in _audit_lines(path)}
    assert (by_id["too-deep"]["status"], by_id["too-deep"]["tenant"], by_id["too-deep"]["prompt"]) == (400, "b", None)
    assert (by_id["draining"]["status"], by_id["draining"]["tenant"]) == (503, "b")


def test_openmetrics_exemplars_carry_the_request_id():
    srv, _ = serve(ServerSettings())
    with srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}, headers={"X-Request-Id": "trace-me-1"})
        exemplar = r'podium[:_]e2e_request_latency_seconds_bucket\{.*\} 1.0 # \{request_id="trace-me-1"\}'
        deadline = time.monotonic() + 10  # the engine loop records a request's end just after answering it
        while True:
            r = c.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
            if re.search(exemplar, r.text) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert re.search(exemplar, r.text)


# -- through the fleet router --------------------------------------------------------------------
def test_the_router_passes_request_ids_and_429s_through(tmp_path, keys_file):
    from router_fixtures import wait_for

    from podium_router.app import create_app as create_router
    from podium_router.settings import ReplicaSpec, RouterSettings

    path = tmp_path / "audit.jsonl"
    replica, _ = serve(ServerSettings(api_keys_file=str(keys_file), audit=AuditSettings(str(path))))
    with replica:
        settings = RouterSettings(replicas=(ReplicaSpec(replica.url, "letters"),), poll_interval_s=0.05,
                                  replica_api_key=KEYS["a"])
        router = ThreadServer(create_router(settings))
        with router, httpx.Client(base_url=router.url, timeout=30) as c:
            wait_for(lambda: c.get("/health").status_code == 200, 20, "a healthy replica")
            statuses = []
            for i in range(4):
                r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2},
                           headers={"X-Request-Id": f"via-router-{i}"})
                statuses.append(r.status_code)
                assert r.headers["x-request-id"] == f"via-router-{i}"
        assert statuses == [200, 200, 200, 429] and 1 <= int(r.headers["retry-after"]) <= 60
    audited = {e["request_id"]: e for e in _audit_lines(path)}
    assert [audited[f"via-router-{i}"]["status"] for i in range(4)] == statuses
    assert all(audited[f"via-router-{i}"]["tenant"] == "a" for i in range(4))


def test_log_lines_about_a_request_carry_its_id():
    import logging

    from podium_server.logs import configure_logging
    from podium_server.request_id import RequestIdLogFilter, current_request_id

    configure_logging("info")
    handler = next(h for h in logging.getLogger("podium_server").handlers if getattr(h, "_podium", False))
    assert any(isinstance(f, RequestIdLogFilter) for f in handler.filters)
    record = logging.LogRecord("podium_server", logging.INFO, __file__, 1, "client went away", (), None)
    token = current_request_id.set("req-42")
    try:
        RequestIdLogFilter().filter(record)
        RequestIdLogFilter().filter(record)  # a second handler does not prefix it twice
    finally:
        current_request_id.reset(token)
    assert record.getMessage() == "[req-42] client went away"
    outside = logging.LogRecord("podium_server", logging.INFO, __file__, 1, "startup", (), None)
    RequestIdLogFilter().filter(outside)
    assert outside.getMessage() == "startup"


def test_a_tenant_crosses_to_an_engine_in_its_own_process(keys_file):
    import functools

    from podium_server.process_engine import ProcessEngine

    engine = ProcessEngine.launch(functools.partial(ScriptedEngine, Knobs()))
    with ThreadServer(create_app(ServerSettings(api_keys_file=str(keys_file)), engine)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        r = complete(c, "d", max_tokens=4)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected([0, 1, 2], 0, 4)
