"""A self-signed certificate for the benchmark's HTTPS server on 127.0.0.1.

S3 is reached over HTTPS, and TLS changes where a client's time goes (a
Python reader takes the interpreter lock once per TLS record), so the bench
serves the same store over both schemes. Every client trusts this one
certificate through ``AWS_CA_BUNDLE`` (botocore, s5cmd, the streamer's CRT,
the daemon and its range workers) or ``curl --cacert``; nothing is added to
the system's trust store.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LoopbackCertificate", "write_loopback_certificate"]

LOOPBACK = "127.0.0.1"
# Long enough for any run, short enough that a leftover file is worthless soon.
VALID_FOR = dt.timedelta(days=2)


@dataclass(frozen=True)
class LoopbackCertificate:
    """A key and its self-signed certificate (PEM files); the certificate is its own CA."""

    key: Path
    cert: Path


def write_loopback_certificate(directory: Path, address: str = LOOPBACK) -> LoopbackCertificate:
    """Write a fresh key and a certificate for ``address`` (127.0.0.1) into ``directory``.

    The address goes in ``subjectAltName`` as an IP entry: verifiers match an
    IP endpoint against SAN IP entries only, never against the common name.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)])
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]),
            critical=False,
        )
        # A CA so that bundles which insist on one (OpenSSL's, Go's) accept it as a root.
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    paths = LoopbackCertificate(key=directory / "loopback.key", cert=directory / "loopback.pem")
    paths.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    paths.key.chmod(0o600)
    paths.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return paths
