"""Signatures on what compile caches keep in S3: who vouches for the code a node restores.

A compile cache is code (inductor's ``.py`` and ``.so`` files, Triton kernels)
that every engine restoring it runs. Whoever can write the compile prefix in
S3 could plant it; so a node signs what says what to restore, and a restoring
node trusts only what a key it was given signed:

- a key's ``manifest.json`` (every archive, its files and their sha256, and
  the sha256 of each archive as stored, checked before a byte is unpacked);
- each by-model index entry (the key parts why-miss compares).

Both are stored *sealed*: the document, base64, with the signer's key id and
an Ed25519 signature over ``CONTEXT_TAG``, the object's place (``<domain>/<key>/
manifest.json``) and the document. The place is signed in, so a sealed manifest
copied to another key or another domain's prefix does not verify there::

    {"sealed": 1, "signer": "<16 hex>", "document": "<base64>", "signature": "<base64>"}

A document that is not sealed is *unsigned*: refused unless the domain accepts
unsigned caches (``accept_unsigned``, for the migration from agents that did
not sign). A seal by a key the domain does not trust, or a signature that does
not verify, is always refused. A refusal is a miss, never an error for the pod:
it compiles as if nothing had been uploaded.

Keys are files: the signing key an Ed25519 private key in PEM (PKCS #8), the
agent's alone (mode 0600 or stricter); each trusted key an Ed25519 public key
in PEM, named by its file name without ``.pub``, writable by nobody but root or
the agent. A directory among the trusted keys stands for every ``*.pub`` in it,
so a new key is added by dropping its file there (and restarting).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent._config import ConfigError
from agent._exceptions import IntegrityError

__all__ = [
    "CONTEXT_TAG",
    "UNCHECKED",
    "Opened",
    "SignatureRefused",
    "Signing",
    "SigningKey",
    "Trust",
    "key_id",
    "load_signing_key",
    "load_trusted_keys",
]

# Signed in first: a signature made for anything else by the same key never verifies here.
CONTEXT_TAG = b"prewarm compile cache v1\0"
SEALED_FORMAT = 1
# Key files are small; anything bigger is not one.
_MAX_KEY_FILE = 16 * 1024
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_READABLE_BY_OTHERS = stat.S_IRGRP | stat.S_IROTH | _WRITABLE_BY_OTHERS


class SignatureRefused(IntegrityError):
    """A document from S3 that no trusted key signed: unsigned, unknown key, or forged."""

    def __init__(self, message: str, *, path: str, reason: str) -> None:
        super().__init__(message, path=path, check="signature")
        # "unsigned", "unknown-key" or "bad-signature": the metric's label.
        self.reason = reason


def key_id(public: Ed25519PublicKey) -> str:
    """A key's id: 16 hex digits of the sha256 of its raw 32 bytes."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class SigningKey:
    """The key a node signs its uploads with."""

    name: str
    private: Ed25519PrivateKey = field(repr=False)

    @property
    def id(self) -> str:
        """The id restoring nodes look the key up by."""
        return key_id(self.private.public_key())

    def seal(self, place: str, document: bytes) -> bytes:
        """``document`` sealed for ``place`` (see the module's docstring)."""
        signature = self.private.sign(_signed_bytes(place, document))
        sealed = {
            "sealed": SEALED_FORMAT,
            "signer": self.id,
            "document": base64.b64encode(document).decode(),
            "signature": base64.b64encode(signature).decode(),
        }
        return json.dumps(sealed, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Opened:
    """A document as verified: its bytes, and the name of the trusted key that signed it
    ("" for an unsigned document a domain accepts)."""

    document: bytes
    signer: str


@dataclass(frozen=True, slots=True)
class Trust:
    """Whom a domain believes: trusted public keys by id (with their names), and whether an
    unsigned document is accepted."""

    keys: Mapping[str, tuple[str, Ed25519PublicKey]]
    accept_unsigned: bool = False

    def open(self, place: str, body: bytes) -> Opened:
        """The document ``body`` holds for ``place``, verified; SignatureRefused otherwise."""
        sealed = _sealed(body, place)
        if sealed is None:
            if self.accept_unsigned:
                return Opened(body, "")
            raise SignatureRefused(
                f"{place} is not signed, and this node accepts only compile caches signed by "
                f"a trusted key ({self._named()}); set compile_cache.accept_unsigned = true "
                "while the uploading nodes are given signing keys.",
                path=place,
                reason="unsigned",
            )
        signer, document, signature = sealed
        trusted = self.keys.get(signer)
        if trusted is None:
            raise SignatureRefused(
                f"{place} is signed by key {signer}, which this node does not trust "
                f"({self._named()}).",
                path=place,
                reason="unknown-key",
            )
        name, public = trusted
        try:
            public.verify(signature, _signed_bytes(place, document))
        except InvalidSignature:
            raise SignatureRefused(
                f"{place} carries a signature of key {name} ({signer}) that does not verify: "
                "it was changed after signing, or signed for another place.",
                path=place,
                reason="bad-signature",
            ) from None
        return Opened(document, name)

    def _named(self) -> str:
        if not self.keys:
            return "no key is trusted: set compile_cache.trusted_keys"
        names = ", ".join(sorted(f"{name} {kid}" for kid, (name, _) in self.keys.items()))
        return f"trusted: {names}"


@dataclass(frozen=True, slots=True)
class Signing:
    """One compile domain's signatures: the key its uploads are signed with (None: they go
    unsigned) and whom its restores trust."""

    domain: str
    key: SigningKey | None
    trust: Trust

    def place(self, relative: str) -> str:
        """The place signed in for an object at ``relative`` under the domain's prefix."""
        return f"{self.domain}/{relative}"

    def seal(self, relative: str, document: bytes) -> bytes:
        """What to store for ``document`` at ``relative``: sealed, or as is without a key."""
        if self.key is None:
            return document
        return self.key.seal(self.place(relative), document)

    def open(self, relative: str, body: bytes) -> Opened:
        """The verified document stored at ``relative`` (see ``Trust.open``)."""
        return self.trust.open(self.place(relative), body)


# For code that reads and writes caches without any signature policy (unit tests of the
# S3 layout): nothing is signed, everything unsigned is accepted.
UNCHECKED = Signing("", None, Trust({}, accept_unsigned=True))


def _signed_bytes(place: str, document: bytes) -> bytes:
    return CONTEXT_TAG + place.encode() + b"\0" + document


def _sealed(body: bytes, place: str) -> tuple[str, bytes, bytes] | None:
    """(signer, document, signature) of a sealed body; None when it is not sealed at all.

    A body that says it is sealed but is malformed is refused, never read as unsigned:
    otherwise breaking a seal would turn a forged document into an "unsigned" one.
    """
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or "sealed" not in value:
        return None
    try:
        if value["sealed"] != SEALED_FORMAT:
            raise ValueError(f"seal format {value['sealed']!r}")
        signer = str(value["signer"])
        document = base64.b64decode(str(value["document"]), validate=True)
        signature = base64.b64decode(str(value["signature"]), validate=True)
    except (KeyError, ValueError, binascii.Error) as exc:
        raise SignatureRefused(
            f"{place} is sealed but malformed ({type(exc).__name__}): refused.",
            path=place,
            reason="bad-signature",
        ) from None
    return signer[:64], document, signature


# -- key files ---------------------------------------------------------------------------


def load_signing_key(path: Path) -> SigningKey:
    """The Ed25519 private key at ``path``; ConfigError when it is unsafe or not one."""
    data = _read_key_file(path, private=True)
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise ConfigError(
            f"{path} is a {type(private).__name__}; compile caches are signed with Ed25519 "
            "(openssl genpkey -algorithm ed25519)."
        )
    return SigningKey(_key_name(path), private)


def load_trusted_keys(paths: Iterable[Path]) -> dict[str, tuple[str, Ed25519PublicKey]]:
    """Key id -> (name, public key) for every key file in ``paths`` (a directory: each
    ``*.pub`` in it); ConfigError naming the file when one is unsafe or not a key."""
    keys: dict[str, tuple[str, Ed25519PublicKey]] = {}
    for path in _key_files(paths):
        data = _read_key_file(path, private=False)
        try:
            public = serialization.load_pem_public_key(data)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{path} is not a PEM public key: {exc}") from None
        if not isinstance(public, Ed25519PublicKey):
            raise ConfigError(f"{path} is a {type(public).__name__}, not an Ed25519 key.")
        keys[key_id(public)] = (_key_name(path), public)
    return keys


def _key_files(paths: Iterable[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.glob("*.pub") if not p.name.startswith("."))
        else:
            files.append(path)
    return files


def _key_name(path: Path) -> str:
    name = path.name.removesuffix(".pub").removesuffix(".pem").removesuffix(".key")
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "key"


def _read_key_file(path: Path, *, private: bool) -> bytes:
    """A key file's bytes, refused (ConfigError) unless only root or the agent could have
    written it and, for a private key, only the agent can read it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read the key file {path}: {exc.strerror}.") from None
    try:
        info = os.fstat(fd)
        unsafe = _READABLE_BY_OTHERS if private else _WRITABLE_BY_OTHERS
        if private and info.st_gid == os.getegid():
            # The agent's own group may read it: a Kubernetes Secret cannot be given to a
            # non-root uid, only mounted 0440 under the pod's fsGroup (the agent's gid).
            unsafe &= ~stat.S_IRGRP
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in {0, os.geteuid()}:
            raise ConfigError(f"{path} must be a regular file owned by root or the agent.")
        if info.st_mode & unsafe:
            what = "readable or writable" if private else "writable"
            raise ConfigError(
                f"{path} is {what} by others (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"chmod {'600' if private else '644'} it."
            )
        if info.st_size > _MAX_KEY_FILE:
            raise ConfigError(f"{path} is {info.st_size} bytes: not a key file.")
        return os.read(fd, _MAX_KEY_FILE)
    finally:
        os.close(fd)
