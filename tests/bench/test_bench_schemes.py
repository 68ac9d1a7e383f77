"""The bench over HTTP and HTTPS: the --schemes option and the loopback certificate."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from cryptography import x509

from bench._schemes import parse_schemes
from bench._tls import write_loopback_certificate


@pytest.mark.parametrize(
    ("text", "schemes"), [("https,http", ["http", "https"]), (" HTTPS ", ["https"])]
)
def test_schemes_parse_in_the_bench_order(text: str, schemes: list[str]) -> None:
    """--schemes takes either order and case; rows always come HTTP first."""
    assert parse_schemes(text) == schemes


def test_unknown_scheme_is_named() -> None:
    """A typo in --schemes says which word is wrong."""
    with pytest.raises(ValueError, match="'htps'"):
        parse_schemes("http,htps")


def test_certificate_names_loopback_by_ip(tmp_path: Path) -> None:
    """The certificate carries 127.0.0.1 as an IP subjectAltName, which verifiers match."""
    paths = write_loopback_certificate(tmp_path)
    certificate = x509.load_pem_x509_certificate(paths.cert.read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert names.value.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert paths.key.stat().st_mode & 0o077 == 0
