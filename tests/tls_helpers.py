"""Real X.509 material for the TLS tests (no tests here): a CA and leaf certificates for 127.0.0.1, generated with
``cryptography`` into a folder (P-256 keys: fast to make)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.tls import TlsFiles


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


class TestCa:
    """A CA that signs leaf certificates (by default for 127.0.0.1 and localhost; server and client use)."""

    __test__ = False  # not a pytest class

    def __init__(self, folder: Path, name: str = "pdcluster test CA") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = (
            _builder(self._name, self._name, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_path = folder / f"{name.replace(' ', '-')}.pem"
        self.cert_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    @property
    def ca(self) -> str:
        return str(self.cert_path)

    def issue(self, common_name: str, names: tuple[str, ...] = ("localhost", "127.0.0.1")) -> Pem:
        """A leaf for ``names`` (DNS names or IP addresses), usable by servers and clients."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for name in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                sans.append(x509.DNSName(name))
        cert = (
            _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]), self._name, key.public_key())
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        pem = Pem(self.folder / f"{common_name}.crt", self.folder / f"{common_name}.key")
        pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pem.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        pem.key.chmod(0o600)
        return pem

    def files(self, common_name: str, mutual: bool = True,
              names: tuple[str, ...] = ("localhost", "127.0.0.1")) -> TlsFiles:
        """``TlsFiles`` of a fresh leaf: a router's or node's ``--tls-cert/--tls-key[/--tls-ca]``."""
        pem = self.issue(common_name, names)
        return TlsFiles(str(pem.cert), str(pem.key), self.ca if mutual else None)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))
