"""Whose Sigstore signatures a ``method = "sigstore"`` rule accepts, and the trust root.

A Sigstore bundle carries everything needed to verify it except whom to trust: the
trust root names the Fulcio CA certificates a signing certificate must chain to, the CT
log keys that sign its SCT, and the Rekor log keys that sign its log entry. The operator
installs it as a file: a client trust config (what ``model_signing --trust_config`` and
``sigstore --trust-config`` take) or a bare ``trusted_root.json`` (what cosign's
``--trusted-root`` takes), which is wrapped into a client trust config with no signing
services (the node never signs, so never needs them).

It is read once, at start, as every file that decides trust is (agent.check.trusted_files:
not through a symlink, a regular file owned by root or the agent, writable by no one
else, of a sane size); and it must parse and name at least one CA, CT log and Rekor
log. Verification then works from those bytes only: nothing on disk can change whom a
running agent trusts, and nothing fetches TUF metadata or reaches the network (verifying
against a given trust root is local: certificate chain, SCT, signed entry timestamp, inclusion
proof and checkpoint are all in the bundle).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent._config import ConfigError, ModelSignatureSettings
from agent._exceptions import quoted
from agent.check.trusted_files import held_file, read_trusted_file

if TYPE_CHECKING:
    from model_signing import verifying

__all__ = ["SigstoreTrust", "load_trust_root"]

# The public instance's trusted_root.json is under 10 KiB; anything past this is not one.
_MAX_TRUST_ROOT = 1024 * 1024
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
        with held_file(self.client_trust_config, "sigstore-trust") as path:
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
    data = read_trusted_file(path, what="The Sigstore trust root", max_bytes=_MAX_TRUST_ROOT)
    document = _parsed(path, data)
    config = _as_client_trust_config(path, document)
    for part, what in _NEEDED.items():
        if not config["trustedRoot"].get(part):
            raise ConfigError(
                f"{path} names no {part} ({what}): a Sigstore signature cannot be verified "
                "against it. Install the trusted_root.json of the Sigstore instance that "
                "signs your models."
            )
    return json.dumps(config).encode()


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
