"""Whose Sigstore signatures a ``method = "sigstore"`` rule accepts, and the trust root.

A Sigstore bundle carries everything needed to verify it except whom to trust: the
trust root names the Fulcio CA certificates a signing certificate must chain to, the CT
log keys that sign its SCT, and the Rekor log keys that sign its log entry. The operator
installs it as a file: a client trust config (what ``model_signing --trust_config`` and
``sigstore --trust-config`` take) or a bare ``trusted_root.json`` (what cosign's
``--trusted-root`` takes), which is wrapped into a client trust config with no signing
services (the node never signs, so never needs them).

It is read once, at start, with the care the agent's other key files get: not through a
symlink, a regular file owned by root or the agent, writable by no one else, of a sane
size; and it must parse and name at least one CA, CT log and Rekor log. Verification
then works from those bytes only: nothing on disk can change whom a running agent
trusts, and nothing fetches TUF metadata or reaches the network (verifying against a
given trust root is local: certificate chain, SCT, signed entry timestamp, inclusion
proof and checkpoint are all in the bundle).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent._config import ConfigError, ModelSignatureSettings
from agent._exceptions import quoted

if TYPE_CHECKING:
    from model_signing import verifying

__all__ = ["SigstoreTrust", "load_trust_root", "trust_config_file"]

# The public instance's trusted_root.json is under 10 KiB; anything past this is not one.
_MAX_TRUST_ROOT = 1024 * 1024
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_CLIENT_TRUST_CONFIG = "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json"
_TRUSTED_ROOT = "application/vnd.dev.sigstore.trustedroot+json;version=0.1"
_SIGNING_CONFIG = "application/vnd.dev.sigstore.signingconfig.v0.2+json"
# What verification needs from the trust root, and what each is, for the error.
_NEEDED = {
    "certificateAuthorities": "a Fulcio CA",
    "ctlogs": "a CT log",
    "tlogs": "a Rekor transparency log",
}


@dataclass(frozen=True, slots=True)
class SigstoreTrust:
    """Whose Sigstore signatures a rule accepts: ``identity``'s, as ``oidc_issuer`` vouched
    for it, certified by a CA of the trust root (its client trust config, read at start)."""

    identity: str
    oidc_issuer: str
    trust_root: Path
    client_trust_config: bytes = field(repr=False)

    @classmethod
    def load(cls, entry: ModelSignatureSettings) -> SigstoreTrust:
        """The trust a sigstore entry names, its trust root read and checked; ConfigError
        saying what is wrong with it otherwise."""
        # The config refuses a sigstore entry without them.
        assert entry.trust_root is not None
        assert entry.identity is not None
        assert entry.oidc_issuer is not None
        trust = cls(
            entry.identity, entry.oidc_issuer, entry.trust_root, load_trust_root(entry.trust_root)
        )
        trust.check_verifier()
        return trust

    def check_verifier(self) -> None:
        """Build the verifier once, so a trust root sigstore cannot use stops the start."""
        from model_signing import verifying
        from sigstore.errors import Error as SigstoreError

        try:
            self.use(verifying.Config())  # type: ignore[no-untyped-call]
        except (ValueError, SigstoreError) as exc:
            raise ConfigError(
                f"The Sigstore trust root {self.trust_root} cannot be used: {quoted(str(exc))}."
            ) from None

    def use(self, config: verifying.Config) -> verifying.Config:
        """``config`` verifying with this trust (offline: the trust root is given)."""
        with trust_config_file(self.client_trust_config) as path:
            return config.use_sigstore_verifier(
                identity=self.identity, oidc_issuer=self.oidc_issuer, trust_config=path
            )

    def hint(self, exc: Exception) -> str:
        """What a sigstore refusal means, for the operator, when its kind says."""
        from sigstore.errors import CertValidationError, VerificationError
        from sigstore.models import InvalidBundle

        if isinstance(exc, InvalidBundle):
            return (
                "It is not a Sigstore bundle with a certificate and a log entry: sign the "
                "model with model_signing's sigstore signer (model_signing sign sigstore) "
                "through the Sigstore instance of the trust root. "
            )
        if isinstance(exc, CertValidationError):
            return (
                "Its signing certificate was not issued by a CA of the trust root "
                f"{self.trust_root} (or was not valid when the log recorded the signature). "
            )
        # sigstore raises VerificationError for every check; its identity policy's
        # messages are the ones about the certificate's SANs and issuer.
        if isinstance(exc, VerificationError) and str(exc).startswith("Certificate's"):
            return (
                f"This source accepts only signatures by {quoted(self.identity)} as "
                f"{quoted(self.oidc_issuer)} vouched for it. "
            )
        return ""


def load_trust_root(path: Path) -> bytes:
    """The client trust config in the trust root file ``path``, as JSON bytes that
    ``model_signing`` reads; ConfigError saying what is wrong with the file otherwise."""
    document = _parsed(path, _read_trust_root(path))
    config = _as_client_trust_config(path, document)
    for part, what in _NEEDED.items():
        if not config["trustedRoot"].get(part):
            raise ConfigError(
                f"{path} names no {part} ({what}): a Sigstore signature cannot be verified "
                "against it. Install the trusted_root.json of the Sigstore instance that "
                "signs your models."
            )
    return json.dumps(config).encode()


@contextmanager
def trust_config_file(config: bytes) -> Iterator[Path]:
    """A path ``model_signing`` can read ``config`` from, for as long as the block runs.

    model_signing takes the trust config as a path and reads it itself. This path is an
    anonymous in-memory file of this process (memfd, through /proc/self/fd), so what it
    reads is what was checked at start, not whatever the configured path holds now.
    """
    fd = os.memfd_create("prewarm-sigstore-trust", os.MFD_CLOEXEC)
    try:
        unwritten = memoryview(config)
        while unwritten:
            unwritten = unwritten[os.write(fd, unwritten) :]
        yield Path(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _read_trust_root(path: Path) -> bytes:
    """The file's bytes, refused unless only root or the agent could have written them."""
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the start.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"cannot read the Sigstore trust root {path}: {exc.strerror}.") from None
    try:
        _check_owner_and_mode(path, os.fstat(fd))
        data = b""
        while chunk := os.read(fd, _MAX_TRUST_ROOT + 1 - len(data)):
            data += chunk
        if len(data) > _MAX_TRUST_ROOT:
            raise ConfigError(f"{path} is over {_MAX_TRUST_ROOT} bytes: not a trust root.")
        return data
    finally:
        os.close(fd)


def _check_owner_and_mode(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode) or info.st_uid not in {0, os.geteuid()}:
        raise ConfigError(
            f"The Sigstore trust root {path} must be a regular file owned by root or the "
            f"agent (it is owned by uid {info.st_uid}): whoever can write it decides whose "
            "signatures are trusted."
        )
    if info.st_mode & _WRITABLE_BY_OTHERS:
        raise ConfigError(
            f"The Sigstore trust root {path} is writable by others (mode "
            f"{stat.S_IMODE(info.st_mode):04o}): whoever can write it decides whose "
            f"signatures are trusted; chmod 644 {path}."
        )


def _parsed(path: Path, data: bytes) -> dict[str, Any]:
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"The Sigstore trust root {path} is not JSON: {exc}.") from None
    if not isinstance(document, dict):
        raise ConfigError(f"The Sigstore trust root {path} is not a JSON object.")
    return document


def _as_client_trust_config(path: Path, document: dict[str, Any]) -> dict[str, Any]:
    """``document`` as a client trust config: as it is, or a bare trusted root wrapped."""
    media_type = document.get("mediaType")
    if media_type == _CLIENT_TRUST_CONFIG and isinstance(document.get("trustedRoot"), dict):
        return document
    if media_type == _TRUSTED_ROOT:
        return {
            "mediaType": _CLIENT_TRUST_CONFIG,
            "trustedRoot": document,
            "signingConfig": {"mediaType": _SIGNING_CONFIG},
        }
    raise ConfigError(
        f"{path} is neither a Sigstore client trust config ({_CLIENT_TRUST_CONFIG}) nor a "
        f"trusted root ({_TRUSTED_ROOT}); its mediaType is {quoted(media_type)}."
    )
