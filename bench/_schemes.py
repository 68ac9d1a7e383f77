"""HTTP and HTTPS side by side: one store, one s3rver per scheme, and row names per scheme.

S3 is HTTPS, and TLS moves where a client spends its time (decryption, and a
Python reader's trips through the interpreter lock per TLS record), so the
contenders are measured over both schemes against the same objects. The
models are uploaded once, through the HTTP server; the HTTPS server serves the
same store directory with a self-signed certificate for 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.testing._process import purge_tree

from ._s3rver import S3rver
from ._tls import write_loopback_certificate

__all__ = ["SCHEMES", "Servers", "parse_schemes", "row", "serve_schemes"]

SCHEMES = ("http", "https")


def row(name: str, scheme: str) -> str:
    """A row's name with its scheme: ``"s5cmd [https]"``."""
    return f"{name} [{scheme}]"


def parse_schemes(text: str) -> list[str]:
    """``"http,https"`` -> the schemes in the bench's order; a ValueError for anything else."""
    asked = {item.strip().lower() for item in text.split(",") if item.strip()}
    if not asked:
        raise ValueError(f"no scheme given; choose from {','.join(SCHEMES)}")
    if unknown := asked - set(SCHEMES):
        raise ValueError(f"unknown schemes {sorted(unknown)}; choose from {','.join(SCHEMES)}")
    return [scheme for scheme in SCHEMES if scheme in asked]


@dataclass(frozen=True)
class Servers:
    """The running servers: one per scheme asked for, and the one uploads go through."""

    by_scheme: dict[str, S3rver]
    uploads: S3rver

    @property
    def preferred(self) -> str:
        """The scheme of the sections measured over one scheme only: HTTPS when asked, as S3 is."""
        return "https" if "https" in self.by_scheme else "http"


@contextlib.contextmanager
def serve_schemes(bucket: str, schemes: Sequence[str]) -> Iterator[Servers]:
    """An HTTP s3rver (always: uploads go through it) and, if asked, an HTTPS one on its store."""
    secrets = Path(tempfile.mkdtemp(prefix="prewarm-bench-tls-"))
    try:
        with contextlib.ExitStack() as stack:
            plain = stack.enter_context(S3rver(bucket))
            by_scheme = {"http": plain} if "http" in schemes else {}
            if "https" in schemes:
                certificate = write_loopback_certificate(secrets)
                by_scheme["https"] = stack.enter_context(
                    S3rver(bucket, directory=plain.directory, tls=certificate)
                )
            yield Servers(by_scheme=by_scheme, uploads=plain)
    finally:
        purge_tree(secrets)
