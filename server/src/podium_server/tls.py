"""TLS for ``podium serve``: vLLM's flags, handed to uvicorn.

``--ssl-keyfile`` and ``--ssl-certfile`` turn HTTPS on (both or neither). ``--ssl-ca-certs`` names
the CAs that client certificates must chain to, and ``--ssl-cert-reqs`` says whether a client
must show one: 0 (``ssl.CERT_NONE``, the default), 1 (``CERT_OPTIONAL``) or 2 (``CERT_REQUIRED``).
A plain-HTTP request to the TLS port fails its handshake and the connection is closed; the
server goes on serving everyone else.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

CERT_REQS = {0: "none", 1: "optional", 2: "required"}


@dataclass(frozen=True)
class TLSSettings:
    keyfile: str
    certfile: str
    ca_certs: str | None = None
    cert_reqs: int = ssl.CERT_NONE

    def __post_init__(self) -> None:
        for flag, path in (("--ssl-keyfile", self.keyfile), ("--ssl-certfile", self.certfile),
                           ("--ssl-ca-certs", self.ca_certs)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if self.cert_reqs not in CERT_REQS:
            raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {self.cert_reqs}")
        if self.cert_reqs != ssl.CERT_NONE and self.ca_certs is None:
            raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs: the CAs that client certificates must chain to")

    @classmethod
    def from_flags(cls, keyfile: str | None, certfile: str | None, ca_certs: str | None = None,
                   cert_reqs: int = ssl.CERT_NONE) -> TLSSettings | None:
        """The TLS settings of the flags, or None for plain HTTP."""
        if keyfile is None and certfile is None:
            if ca_certs is not None or cert_reqs != ssl.CERT_NONE:
                raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and --ssl-certfile")
            return None
        if keyfile is None or certfile is None:
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
        return cls(keyfile, certfile, ca_certs, cert_reqs)

    def uvicorn_kwargs(self) -> dict:
        kwargs = {"ssl_keyfile": self.keyfile, "ssl_certfile": self.certfile, "ssl_cert_reqs": self.cert_reqs}
        if self.ca_certs is not None:
            kwargs["ssl_ca_certs"] = self.ca_certs
        return kwargs
