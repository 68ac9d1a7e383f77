"""Model signatures: a snapshot is published only if its publisher's signature verifies.

prewarm proves that the bytes it caches are what S3 holds (ETag, If-Match, checksums,
safetensors headers); a signature proves they are what the model's publisher signed.
Per source pattern, ``[[access.model_signatures]]`` names the signature's file in the
model's prefix (``model.sig`` by default) and how to verify it with the OpenSSF
``model-signing`` package (the ``signatures`` extra):

- ``key``: an elliptic-curve public key (PEM) the publisher signed with;
- ``certificate``: the certificate chain (PEM files) the signing certificate must
  chain to;
- ``sigstore``: a Sigstore bundle ("keyless": a short-lived Fulcio certificate for the
  signer's OIDC identity, and the Rekor log's entry for the signature), verified offline
  against a trust root read at start (``trust_root``), made by one ``identity`` that one
  ``oidc_issuer`` vouched for.

The key and the certificates are read once, at start, as every file that decides trust
is (agent.check.trusted_files): a key file someone else can write would let them choose
whose signatures pass.

The check runs on the staging directory, after the download and the integrity checks
and before the snapshot is published: a model that fails is never published, and the
error names the file that did not match. Verification hashes every file again
(sha256, the signature format's digest), which the pull's own chunked xxh3 cannot
stand in for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from agent._config import ConfigError, ModelSignatureSettings, Settings
from agent._exceptions import IntegrityError, quoted
from agent._uri import ModelUri, uri_matches
from agent.check.sigstore_trust import SigstoreTrust
from agent.check.trusted_files import held_file, read_trusted_file

__all__ = ["SignatureRule", "signature_rules"]

# model-signing's words for a file whose bytes differ: "Hash mismatch for 'w.bin'".
_MISMATCH = re.compile(r"Hash mismatch for '([^']{1,1024})'")
# A PEM key or certificate is a few KiB; a chain of 16 of them well under this each.
_MAX_PEM_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class SignatureRule:
    """One ``[[access.model_signatures]]`` entry: which sources, and whose signature."""

    sources: tuple[str, ...]
    method: str
    public_key: Path | None
    certificates: tuple[Path, ...]
    signature: str
    sigstore: SigstoreTrust | None = None
    # The key's and the certificates' bytes, as read and checked at start.
    key_pem: bytes = field(default=b"", repr=False)
    certificate_pems: tuple[bytes, ...] = field(default=(), repr=False)

    @classmethod
    def from_settings(cls, entry: ModelSignatureSettings) -> SignatureRule:
        """The rule an entry of the config describes, the files it trusts read and checked
        (ConfigError when one cannot be used)."""
        key = entry.public_key if entry.method == "key" else None
        certificates = tuple(entry.certificates) if entry.method == "certificate" else ()
        return cls(
            tuple(entry.sources),
            entry.method,
            entry.public_key,
            tuple(entry.certificates),
            entry.signature,
            SigstoreTrust.load(entry) if entry.method == "sigstore" else None,
            _read_pem(key, "The publisher's public key") if key else b"",
            tuple(_read_pem(path, "The certificate") for path in certificates),
        )

    def applies_to(self, uri: ModelUri) -> bool:
        """Whether a snapshot of ``uri`` must carry this signature."""
        return uri_matches(self.sources, uri)

    @property
    def signer(self) -> str:
        """Who a verified snapshot was signed by, as the handle and `prewarm show` say."""
        if self.method == "key":
            assert self.public_key is not None
            return f"key {self.public_key.name} ({self.signature})"
        if self.sigstore is not None:
            trust = self.sigstore
            return f"sigstore {trust.identity} from {trust.oidc_issuer} ({self.signature})"
        return (
            f"certificate chain {', '.join(p.name for p in self.certificates)} ({self.signature})"
        )

    def verify(self, model: Path) -> str:
        """Verify the snapshot in ``model``; who signed it, or IntegrityError naming the file."""
        signature = model / self.signature
        if not signature.is_file():
            raise IntegrityError(
                f"{self.signature} is not among the model's files: its source must be signed "
                f"({self.method}) before it is cached here. Sign the model directory with "
                f"model-signing and put the signature at {self.signature} in its prefix.",
                path=self.signature,
                check="signature",
            )
        from sigstore.errors import Error as SigstoreError  # model-signing's own dependency

        try:
            self._verify(model, signature)
        except (ValueError, SigstoreError) as exc:
            hint = self.sigstore.hint(exc) if self.sigstore else ""
            raise _refusal(str(exc), self.signature, hint) from None
        return self.signer

    def _verify(self, model: Path, signature: Path) -> None:
        from model_signing import hashing, verifying  # the signatures extra; checked at start

        # model-signing's Config() takes no arguments but is not annotated.
        ignored = hashing.Config().set_ignored_paths(paths=[signature])  # type: ignore[no-untyped-call]
        config = verifying.Config().set_hashing_config(ignored)  # type: ignore[no-untyped-call]
        with ExitStack() as held:
            if self.method == "key":
                key = held.enter_context(held_file(self.key_pem, "public-key"))
                config = config.use_elliptic_key_verifier(public_key=key)
            elif self.sigstore is not None:
                config = self.sigstore.use(config)
            else:
                chain = [
                    held.enter_context(held_file(pem, "cert")) for pem in self.certificate_pems
                ]
                config = config.use_certificate_verifier(certificate_chain=chain)
            config.verify(model, signature)


def _refusal(message: str, signature: str, hint: str = "") -> IntegrityError:
    """model-signing's refusal, in the agent's words, naming the file when it says which."""
    mismatch = _MISMATCH.search(message)
    if mismatch:
        path = mismatch[1]
        return IntegrityError(
            f"{quoted(path)} does not match the model's signature ({signature}): the bytes in "
            "S3 are not the ones that were signed. Nothing was published.",
            path=path,
            check="signature",
        )
    return IntegrityError(
        f"The model's signature ({signature}) does not verify: {quoted(message)}. {hint}"
        "Nothing was published.",
        path=signature,
        check="signature",
    )


def signature_rules(settings: Settings) -> tuple[SignatureRule, ...]:
    """The configured signature rules; ConfigError when one cannot be checked here."""
    entries: Sequence[ModelSignatureSettings] = settings.access.model_signatures
    if not entries:
        return ()
    try:
        import model_signing  # noqa: F401  (only whether it is there)
    except ImportError:
        raise ConfigError(
            "[[access.model_signatures]] needs the model-signing package: install "
            "prewarm-agent[signatures]."
        ) from None
    return tuple(SignatureRule.from_settings(entry) for entry in entries)


def _read_pem(path: Path, what: str) -> bytes:
    return read_trusted_file(path, what=what, max_bytes=_MAX_PEM_BYTES)
