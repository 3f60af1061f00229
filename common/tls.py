"""TLS material: the router's client listeners (HTTP and gRPC) and mutual TLS between the router and the nodes.

``TlsFiles`` names PEM files (certificate chain, its private key, and a CA bundle). Building one checks only which
flags go together (a config may be validated where the files do not exist, e.g. a deployment renderer); ``check``
reads and parses them, and every process calls it at start-up, so a missing, unreadable or mismatched file stops it
with a ``ConfigError`` naming the flag, never serving half-secured. Roles:
- a listener with ``cert``/``key`` serves TLS; with ``ca`` as well it requires client certificates signed by the CA;
- a client (the router's channels to nodes) with ``ca`` verifies the server against it and presents ``cert``/``key``.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.errors import ConfigError


def _no_passphrase() -> bytes:
    # NOTE: without a callback OpenSSL prompts on the terminal for an encrypted key; the process must fail instead.
    raise ConfigError("--tls-key is encrypted; give an unencrypted PEM key (protect it with file permissions)")


@dataclass(frozen=True)
class TlsFiles:
    cert: str | None = None  # PEM certificate chain (leaf first)
    key: str | None = None  # PEM private key of ``cert``
    ca: str | None = None  # PEM CA bundle the peer's certificate must chain to (mTLS)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("--tls-cert and --tls-key go together: give both (PEM certificate chain and its key)")
        if self.ca is not None and self.cert is None:
            raise ConfigError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key: each side presents a certificate "
                              "signed by the CA")

    def check(self) -> TlsFiles:
        """Read and parse every file named; ConfigError naming the flag when one is missing, unreadable, not PEM,
        encrypted, or when the key does not match the certificate."""
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path is not None:
                _read(flag, path)
        if self.cert is not None:
            self.server_ssl_context()  # parses the pair: a wrong key or a non-PEM file fails here
        if self.ca is not None:
            try:
                ssl.create_default_context(cafile=self.ca)
            except ssl.SSLError as e:
                raise ConfigError(f"--tls-ca {self.ca}: not a PEM CA certificate bundle ({e.reason or e})") from None
        return self

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        return self.ca is not None

    def server_ssl_context(self) -> ssl.SSLContext:
        """An ``ssl`` server context (the router's HTTP listener); client certificates are required with ``ca``."""
        assert self.cert is not None and self.key is not None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key, password=_no_passphrase)
        except ssl.SSLError as e:
            raise ConfigError(f"--tls-cert {self.cert} / --tls-key {self.key}: not a PEM certificate chain and its "
                              f"matching private key ({e.reason or e})") from None
        if self.ca is not None:
            ctx.load_verify_locations(cafile=self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_ssl_context(self) -> ssl.SSLContext:
        """An ``ssl`` client context for an mTLS listener (a node's Mux socket): verify it against ``ca``, present
        ``cert``/``key``."""
        assert self.ca is not None and self.cert is not None and self.key is not None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key, password=_no_passphrase)
        return ctx

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        """Credentials of a gRPC listener: TLS; client certificates signed by ``ca`` required when ``ca`` is set."""
        assert self.cert is not None and self.key is not None
        ca = _read("--tls-ca", self.ca) if self.ca is not None else None
        return grpc.ssl_server_credentials([(_read("--tls-key", self.key), _read("--tls-cert", self.cert))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a channel to an mTLS listener: verify it against ``ca``, present ``cert``/``key``."""
        assert self.ca is not None and self.cert is not None and self.key is not None
        return grpc.ssl_channel_credentials(root_certificates=_read("--tls-ca", self.ca),
                                            private_key=_read("--tls-key", self.key),
                                            certificate_chain=_read("--tls-cert", self.cert))


def _read(flag: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data
