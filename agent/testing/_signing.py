"""Compile-cache signing keys for test agents, as an operator would lay them out.

Every test agent signs its uploads with one shared key and trusts it, as the
nodes of one node group would (docs/security.md): two agents of a test restore
each other's caches. A test about trust makes keys of its own (``make_keys``).
"""

from __future__ import annotations

import atexit
import base64
import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.compile.signing import load_signing_key

__all__ = [
    "SigningKeys",
    "make_keys",
    "make_publisher_keys",
    "sealed_with_shared_key",
    "shared_keys",
    "sign_model",
    "unsealed",
]


class SigningKeys:
    """A key pair on disk: ``private`` (PEM, 0600) and ``public`` (``<trusted>/<name>.pub``)."""

    def __init__(self, directory: Path, name: str) -> None:
        self.name = name
        self.private = directory / f"{name}.key"
        self.trusted = directory / "trusted"
        self.public = self.trusted / f"{name}.pub"


def make_keys(directory: Path, name: str = "test-nodes") -> SigningKeys:
    """A new Ed25519 key pair written under ``directory`` (made if missing)."""
    keys = SigningKeys(directory, name)
    keys.trusted.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    keys.private.touch(mode=0o600)
    keys.private.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    keys.public.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    keys.public.chmod(0o644)
    return keys


@functools.cache
def shared_keys() -> SigningKeys:
    """The key pair every test agent of this process signs with and trusts (made once)."""
    directory = Path(tempfile.mkdtemp(prefix="prewarm-keys-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return make_keys(directory)


def unsealed(body: bytes) -> Any:
    """The JSON document a stored compile-cache object holds, sealed or not, for a test to
    read (nothing verified: agent.compile.signing does that for the agent)."""
    value = json.loads(body)
    if isinstance(value, dict) and "sealed" in value:
        return json.loads(base64.b64decode(value["document"]))
    return value


def sealed_with_shared_key(place: str, document: bytes) -> bytes:
    """``document`` sealed for ``place`` (``<domain>/<key>/manifest.json``) with the key every
    test agent trusts: what a test that rewrites a manifest must store for agents to read it."""
    return load_signing_key(shared_keys().private).seal(place, document)


def make_publisher_keys(directory: Path, name: str = "publisher") -> tuple[Path, Path]:
    """A model publisher's EC P-256 key pair under ``directory``: (private PEM, public PEM),
    as model-signing's key signer and verifier read them."""
    from cryptography.hazmat.primitives.asymmetric import ec

    directory.mkdir(parents=True, exist_ok=True)
    private = ec.generate_private_key(ec.SECP256R1())
    private_path, public_path = directory / f"{name}.key", directory / f"{name}.pub"
    private_path.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public_path.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private_path, public_path


def sign_model(model: Path, private_key: Path, signature: str = "model.sig") -> Path:
    """Sign the model directory ``model`` with model-signing as its publisher would, the
    signature written inside it (and left out of what it signs); the signature's path."""
    from model_signing import hashing, signing  # the signatures extra (dev has it)

    directory = model.resolve()
    path = directory / signature
    # model-signing's Config() takes no arguments but is not annotated.
    ignored = hashing.Config().set_ignored_paths(paths=[path])  # type: ignore[no-untyped-call]
    signer = signing.Config()  # type: ignore[no-untyped-call]
    signer.use_elliptic_key_signer(private_key=private_key).set_hashing_config(ignored).sign(
        directory, path
    )
    return path
