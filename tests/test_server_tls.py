"""TLS: the openai client over HTTPS with a CA and certificates made here (the ``openssl`` command),
client certificates when required, and a plain-HTTP request to the TLS port failing cleanly.

The server is the real uvicorn configuration ``podium serve`` builds (``cli.uvicorn_config``) in
front of the scripted engine (scripted_engine.py), on a thread.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
import threading
import time

import httpx
import pytest
import uvicorn
from scripted_engine import ScriptedEngine, expected

from podium.parallel.group import free_port
from podium_server.app import create_app
from podium_server.cli import uvicorn_config
from podium_server.settings import ServerSettings
from podium_server.thread_engine import ThreadEngine
from podium_server.tls import TLSSettings

openai = pytest.importorskip("openai")
if shutil.which("openssl") is None:
    pytest.skip("needs the openssl command to make certificates", allow_module_level=True)


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 signed by it, and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=podium test CA", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        extra = ["-extfile", "san.ext"] if name == "server" else []
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", *extra, cwd=d)
    return d


def trusting(pki) -> ssl.SSLContext:
    """A client context that trusts the test CA."""
    return ssl.create_default_context(cafile=str(pki / "ca.pem"))


class TLSServer:
    def __init__(self, tls: TLSSettings) -> None:
        settings = ServerSettings(port=free_port(), tls=tls, log_level="warning")
        self.url = settings.url
        self.server = uvicorn.Server(uvicorn_config(create_app(settings, ThreadEngine(ScriptedEngine())), settings))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> TLSServer:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "the TLS server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


def test_openai_client_over_tls_and_plain_http_fails_cleanly(pki):
    with TLSServer(TLSSettings(str(pki / "server.key"), str(pki / "server.pem"))) as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        with httpx.Client(verify=trusting(pki), timeout=30) as http:
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", http_client=http)
            out = client.completions.create(model="letters", prompt="abc", max_tokens=5)
            assert out.choices[0].text == expected([0, 1, 2], 0, 5)
            plain = srv.url.replace("https://", "http://")
            started = time.monotonic()
            with pytest.raises(httpx.TransportError):  # the handshake fails; the connection is closed
                httpx.get(f"{plain}/health", timeout=10)
            assert time.monotonic() - started < 5
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                httpx.get(f"{srv.url}/health", timeout=10)  # a client that does not trust the CA
            assert http.get(f"{srv.url}/health").status_code == 200  # still serving everyone else


def test_client_certificates_when_required(pki):
    tls = TLSSettings(str(pki / "server.key"), str(pki / "server.pem"), ca_certs=str(pki / "ca.pem"),
                      cert_reqs=ssl.CERT_REQUIRED)
    with TLSServer(tls) as srv:
        with_cert = trusting(pki)
        with_cert.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        assert httpx.get(f"{srv.url}/health", verify=with_cert, timeout=10).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{srv.url}/health", verify=trusting(pki), timeout=10)


def test_tls_flags_are_checked(pki, tmp_path):
    with pytest.raises(ValueError, match="both --ssl-keyfile and --ssl-certfile"):
        TLSSettings.from_flags(str(pki / "server.key"), None)
    with pytest.raises(ValueError, match="no such file"):
        TLSSettings.from_flags(str(tmp_path / "missing.key"), str(pki / "server.pem"))
    with pytest.raises(ValueError, match="needs --ssl-ca-certs"):
        TLSSettings.from_flags(str(pki / "server.key"), str(pki / "server.pem"), cert_reqs=2)
    assert TLSSettings.from_flags(None, None) is None


def test_serve_flags_build_the_settings(pki, tmp_path):
    from podium.cli import build_parser
    from podium_server.cli import settings_from_args

    def settings(*flags: str) -> ServerSettings:
        return settings_from_args(build_parser().parse_args(["serve", *flags]))

    s = settings("--ssl-keyfile", str(pki / "server.key"), "--ssl-certfile", str(pki / "server.pem"),
                 "--ssl-ca-certs", str(pki / "ca.pem"), "--ssl-cert-reqs", "2", "--port", "8443",
                 "--audit-log", str(tmp_path / "a.jsonl"), "--audit-log-content", "--audit-log-max-bytes", "1MiB")
    assert s.url == "https://127.0.0.1:8443" and s.tls.cert_reqs == ssl.CERT_REQUIRED
    assert (s.audit.path, s.audit.content, s.audit.max_bytes, s.audit.backups) == (str(tmp_path / "a.jsonl"), True,
                                                                                    2**20, 5)
    assert settings().tls is None and settings().audit is None and settings().url.startswith("http://")
    with pytest.raises(ValueError, match="--audit-log-content needs --audit-log"):
        settings("--audit-log-content")
