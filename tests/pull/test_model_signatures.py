"""Model signatures: a source that must be signed publishes only what its publisher signed.

Real keys (EC P-256, as the publisher's), the OpenSSF model-signing package signing the
model directory as a publisher would, the real (moto) S3 server and the real agent.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import AgentFactory, RunningAgent, cache_entries
from sigstore_helpers import PrivateSigstore

from agent._config import ConfigError, load_settings
from agent.check.signatures import SignatureRule, signature_rules
from agent.client import Client, IntegrityError
from agent.testing import S3Server, make_publisher_keys, sign_model, upload_directory

pytest.importorskip("model_signing", reason="the signatures extra (dev installs it)")

SIGNATURE = "model.sig"


def _model(directory: Path) -> Path:
    """A small model directory, not signed yet."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(_safetensors(4096))
    return directory


def _signed_model(directory: Path, private_key: Path) -> Path:
    """A small model directory signed with model-signing, its signature inside it."""
    sign_model(_model(directory), private_key, SIGNATURE)
    return directory


def _safetensors(size: int) -> bytes:
    header = b'{"w": {"dtype": "U8", "shape": [%d], "data_offsets": [0, %d]}}' % (size, size)
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + bytes(range(256)) * (size // 256)


def _config(public_key: Path, bucket: str) -> str:
    return (
        "[[access.model_signatures]]\n"
        f'sources = ["s3://{bucket}/signed/"]\n'
        f'public_key = "{public_key}"\n'
    )


@pytest.fixture
def publisher(tmp_path: Path) -> tuple[Path, Path]:
    """The publisher's key pair."""
    return make_publisher_keys(tmp_path / "keys", "publisher")


def test_a_signed_model_verifies_and_publishes_naming_its_signer(
    start_agent: AgentFactory,
    s3_client: Any,
    bucket: str,
    tmp_path: Path,
    publisher: tuple[Path, Path],
) -> None:
    """A model signed with the publisher's key, under a source that requires it: the pull
    verifies and publishes it, and the handle and the listing say what verified it."""
    private_key, public_key = publisher
    upload_directory(s3_client, bucket, "signed", _signed_model(tmp_path / "m", private_key))
    agent = start_agent(_config(public_key, bucket))
    with Client(agent.socket_path) as client:
        handle = client.ensure(f"s3://{bucket}/signed/")
        [listed] = client.list_models()
    assert handle.verified_by == f"key publisher.pub ({SIGNATURE})"
    assert listed.verified_by == handle.verified_by
    assert (handle.path / "model.safetensors").stat().st_size > 4096


def test_a_flipped_byte_in_s3_is_refused_naming_the_file_and_nothing_is_published(
    start_agent: AgentFactory,
    s3_client: Any,
    bucket: str,
    tmp_path: Path,
    publisher: tuple[Path, Path],
) -> None:
    """One byte of the weights changed in S3 after signing: the pull is DATA_LOSS naming
    model.safetensors, and no snapshot of it is published."""
    private_key, public_key = publisher
    model = _signed_model(tmp_path / "m", private_key)
    weights = bytearray((model / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (model / "model.safetensors").write_bytes(bytes(weights))
    upload_directory(s3_client, bucket, "signed", model)
    agent = start_agent(_config(public_key, bucket))
    with Client(agent.socket_path) as client, pytest.raises(IntegrityError) as refused:
        client.ensure(f"s3://{bucket}/signed/")
    assert "'model.safetensors' does not match the model's signature" in str(refused.value)
    assert not any(area.endswith(("snapshots", "manifests")) for area in cache_entries(agent))


def test_a_signature_by_another_key_or_none_at_all_is_refused(
    start_agent: AgentFactory,
    s3_client: Any,
    bucket: str,
    tmp_path: Path,
    publisher: tuple[Path, Path],
) -> None:
    """A model signed by someone else's key is refused, as is one with no signature file;
    a source no rule names publishes as before."""
    _, public_key = publisher
    stranger_key, _ = make_publisher_keys(tmp_path / "stranger", "stranger")
    upload_directory(s3_client, bucket, "signed", _signed_model(tmp_path / "m", stranger_key))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    upload_directory(s3_client, bucket, "signed-none", plain)
    upload_directory(s3_client, bucket, "unsigned", plain)
    agent = start_agent(
        _config(public_key, bucket).replace(
            '/signed/"]', f'/signed/", "s3://{bucket}/signed-none/"]'
        )
    )
    with Client(agent.socket_path) as client:
        with pytest.raises(IntegrityError, match="does not verify"):
            client.ensure(f"s3://{bucket}/signed/")
        with pytest.raises(IntegrityError, match=f"{SIGNATURE} is not among the model's files"):
            client.ensure(f"s3://{bucket}/signed-none/")
        assert client.ensure(f"s3://{bucket}/unsigned/").verified_by == ""


def test_a_rule_needs_its_key_file(tmp_path: Path, s3_server: S3Server) -> None:
    """A rule naming a key file that is not there stops the start with a ConfigError naming it."""
    config = tmp_path / "agent.toml"
    config.write_text(_config(tmp_path / "missing.pub", "b"))
    with pytest.raises(ConfigError, match=r"missing\.pub is not a readable file"):
        signature_rules(load_settings(config))


# -- Sigstore bundles, verified offline against a trust root -------------------------------

PUBLISHER = "publisher@example.com"
ISSUER = "https://accounts.example.com"


@pytest.fixture
def sigstore() -> PrivateSigstore:
    """The Sigstore instance the publisher signs through (its CA, CT log and Rekor log)."""
    return PrivateSigstore("models-sigstore")


@pytest.fixture
def trust_root(tmp_path: Path, sigstore: PrivateSigstore) -> Path:
    """That instance's trust root, as the operator installs it (a client trust config)."""
    return sigstore.write_trust_config(tmp_path / "trust" / "sigstore.json")


def _sigstore_config(root: Path, bucket: str, **overrides: str) -> str:
    settings = {"trust_root": str(root), "identity": PUBLISHER, "oidc_issuer": ISSUER}
    settings.update(overrides)
    lines = "".join(f'{name} = "{value}"\n' for name, value in settings.items() if value)
    return (
        "[[access.model_signatures]]\n"
        f'sources = ["s3://{bucket}/signed/"]\n'
        'method = "sigstore"\n'
        f"{lines}"
    )


def _sigstore_signed(
    directory: Path, sigstore: PrivateSigstore, identity: str = PUBLISHER, issuer: str = ISSUER
) -> Path:
    """A small model directory signed through ``sigstore`` as ``identity``."""
    sigstore.sign_model(_model(directory), identity=identity, oidc_issuer=issuer)
    return directory


def _sigstore_rule(trust_root: Path, tmp_path: Path) -> SignatureRule:
    """The rule the agent builds at start from a sigstore entry (its trust root read)."""
    config = tmp_path / "agent.toml"
    config.write_text(_sigstore_config(trust_root, "b"))
    [rule] = signature_rules(load_settings(config))
    return rule


# start_source(model) -> (the agent, the source's URI): the model uploaded under a source
# whose rule requires PUBLISHER's Sigstore signature, and an agent started with that rule.
SourceStarter = Callable[[Path], tuple[RunningAgent, str]]


@pytest.fixture
def start_source(
    start_agent: AgentFactory, s3_client: Any, bucket: str, trust_root: Path
) -> SourceStarter:
    """Upload a model under a source that must carry PUBLISHER's Sigstore signature, and
    start an agent with that rule."""

    def start(model: Path) -> tuple[RunningAgent, str]:
        upload_directory(s3_client, bucket, "signed", model)
        return start_agent(_sigstore_config(trust_root, bucket)), f"s3://{bucket}/signed/"

    return start


def _refusal(agent: RunningAgent, uri: str) -> str:
    """The IntegrityError a pull of ``uri`` gets, as its message."""
    with Client(agent.socket_path) as client, pytest.raises(IntegrityError) as refused:
        client.ensure(uri)
    return str(refused.value)


def test_a_sigstore_signed_model_verifies_and_publishes_naming_identity_and_issuer(
    start_source: SourceStarter, tmp_path: Path, sigstore: PrivateSigstore
) -> None:
    """A model signed through the operator's Sigstore instance by the configured identity:
    the pull verifies the bundle offline and publishes, and the handle, the listing and
    `prewarm show` say it was the identity, as its issuer vouched."""
    agent, uri = start_source(_sigstore_signed(tmp_path / "m", sigstore))
    with Client(agent.socket_path) as client:
        handle = client.ensure(uri)
        [listed] = client.list_models()
    assert handle.verified_by == f"sigstore {PUBLISHER} from {ISSUER} ({SIGNATURE})"
    assert listed.verified_by == handle.verified_by
    assert (handle.path / "model.safetensors").stat().st_size > 4096
    shown = _prewarm("show", handle.key, socket=agent.socket_path)
    assert re.search(rf"signature\s+sigstore {re.escape(PUBLISHER)} from", shown), shown


def test_a_flipped_byte_under_a_sigstore_signature_is_refused_naming_the_file(
    start_source: SourceStarter, tmp_path: Path, sigstore: PrivateSigstore
) -> None:
    """One byte of the weights changed after a Sigstore signing: DATA_LOSS naming
    model.safetensors, and nothing is published."""
    model = _sigstore_signed(tmp_path / "m", sigstore)
    weights = bytearray((model / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (model / "model.safetensors").write_bytes(bytes(weights))
    agent, uri = start_source(model)
    assert "'model.safetensors' does not match the model's signature" in _refusal(agent, uri)
    assert not any(area.endswith(("snapshots", "manifests")) for area in cache_entries(agent))


@pytest.mark.parametrize(
    ("identity", "issuer", "said"),
    [
        ("mallory@example.com", ISSUER, "SANs do not match"),
        (PUBLISHER, "https://issuer.mallory.example", "OIDCIssuer does not match"),
    ],
    ids=["another-identity", "another-issuer"],
)
def test_a_sigstore_bundle_for_another_identity_or_issuer_is_refused(
    start_source: SourceStarter,
    tmp_path: Path,
    sigstore: PrivateSigstore,
    identity: str,
    issuer: str,
    said: str,
) -> None:
    """A bundle the trusted CA issued, but for someone else (or the same name as another
    issuer vouched for it), is refused saying whom the source accepts."""
    model = _sigstore_signed(tmp_path / "m", sigstore, identity=identity, issuer=issuer)
    message = _refusal(*start_source(model))
    assert "does not verify" in message
    assert said in message
    assert f"accepts only signatures by '{PUBLISHER}' as '{ISSUER}'" in message


def test_a_sigstore_bundle_from_a_ca_outside_the_trust_root_is_refused(
    start_source: SourceStarter, tmp_path: Path, trust_root: Path
) -> None:
    """A bundle for the right identity and issuer, but from another Sigstore instance (a CA
    and logs the trust root does not name), is refused naming the trust root."""
    stranger = PrivateSigstore("stranger-sigstore")
    message = _refusal(*start_source(_sigstore_signed(tmp_path / "m", stranger)))
    assert f"not issued by a CA of the trust root {trust_root}" in message


def test_a_key_signature_under_a_sigstore_rule_is_refused_saying_how_to_sign(
    tmp_path: Path, trust_root: Path, publisher: tuple[Path, Path]
) -> None:
    """A model signed with a key where the rule asks for Sigstore is refused: its signature
    is not a Sigstore bundle, and the error says to sign with model_signing's sigstore
    signer."""
    model = _signed_model(tmp_path / "m", publisher[0])
    rule = _sigstore_rule(trust_root, tmp_path)
    with pytest.raises(IntegrityError, match="model_signing sign sigstore"):
        rule.verify(model)


def test_sigstore_verification_reaches_no_network(
    tmp_path: Path,
    sigstore: PrivateSigstore,
    trust_root: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loading a sigstore rule and verifying a bundle open no socket and resolve no name:
    nothing fetches TUF metadata or asks Rekor (the trust root is all it uses)."""

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"sigstore verification reached for the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    model = _sigstore_signed(tmp_path / "m", sigstore)
    rule = _sigstore_rule(trust_root, tmp_path)
    assert rule.verify(model) == f"sigstore {PUBLISHER} from {ISSUER} ({SIGNATURE})"


def test_a_bare_trusted_root_json_is_a_trust_root_too(
    tmp_path: Path, sigstore: PrivateSigstore
) -> None:
    """A trusted_root.json alone (cosign's --trusted-root) verifies as its client trust
    config does."""
    bare = sigstore.write_trust_config(tmp_path / "trusted_root.json", bare_root=True)
    rule = _sigstore_rule(bare, tmp_path)
    assert rule.verify(_sigstore_signed(tmp_path / "m", sigstore)).startswith("sigstore ")


def test_the_trust_root_is_read_once_at_start(
    tmp_path: Path, sigstore: PrivateSigstore, trust_root: Path
) -> None:
    """The rule verifies with the trust root as it was read at start: replacing the file
    afterwards (with another instance's) changes nothing until a restart."""
    rule = _sigstore_rule(trust_root, tmp_path)
    PrivateSigstore("replacement").write_trust_config(trust_root)
    assert rule.verify(_sigstore_signed(tmp_path / "m", sigstore)).startswith("sigstore ")


@pytest.mark.parametrize("missing", ["trust_root", "identity", "oidc_issuer"])
def test_a_sigstore_rule_needs_trust_root_identity_and_oidc_issuer(
    tmp_path: Path, trust_root: Path, missing: str
) -> None:
    """A sigstore entry without its trust root, identity or OIDC issuer stops the start
    with a ConfigError naming what is missing."""
    config = tmp_path / "agent.toml"
    config.write_text(_sigstore_config(trust_root, "b", **{missing: ""}))
    with pytest.raises(ConfigError, match=rf'method "sigstore" needs {missing} \('):
        load_settings(config)


def _replace_with_symlink(path: Path) -> None:
    target = path.with_name("real.json")
    path.rename(target)
    path.symlink_to(target)


def _without_ctlogs(path: Path) -> None:
    document = json.loads(path.read_text())
    document["trustedRoot"]["ctlogs"] = []
    path.write_text(json.dumps(document))


@pytest.mark.parametrize(
    ("spoil", "said"),
    [
        (lambda path: path.unlink(), "is not a readable file (No such file"),
        (lambda path: path.chmod(0o666), "is writable by others (mode 0666)"),
        (lambda path: os.chown(path, 65534, -1), "owned by root or the agent"),
        (_replace_with_symlink, "is not a readable file (Too many levels"),
        (lambda path: path.write_text("{not json"), "is not JSON"),
        (lambda path: path.write_text('{"mediaType": "x"}'), "neither a Sigstore client"),
        (_without_ctlogs, "names no ctlogs (a CT log)"),
    ],
    ids=[
        "missing",
        "world-writable",
        "foreign-owner",
        "symlink",
        "not-json",
        "not-sigstore",
        "no-ct-log",
    ],
)
def test_a_trust_root_the_agent_cannot_trust_stops_the_start(
    tmp_path: Path, trust_root: Path, spoil: Callable[[Path], object], said: str
) -> None:
    """A trust root that is missing, writable or owned by someone else, a symlink, or not
    a usable Sigstore trust root: a ConfigError at start saying which."""
    if said == "owned by root or the agent" and os.geteuid() != 0:
        pytest.skip("chowning to another uid needs root")
    spoil(trust_root)
    with pytest.raises(ConfigError, match=re.escape(said)):
        _sigstore_rule(trust_root, tmp_path)


def _prewarm(*args: str, socket: Path) -> str:
    """``prewarm ARGS`` against the agent on ``socket``: its output (it must succeed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(socket)
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        env=env | {"COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- the files that decide trust ----------------------------------------------------------


@pytest.mark.parametrize(
    ("spoil", "said"),
    [
        (lambda path: path.chmod(0o666), "is writable by others (mode 0666)"),
        (lambda path: os.chown(path, 65534, -1), "owned by root or the agent"),
        (_replace_with_symlink, "is not a readable file (Too many levels"),
    ],
    ids=["world-writable", "foreign-owner", "symlink"],
)
def test_a_key_file_someone_else_could_write_stops_the_start(
    tmp_path: Path, publisher: tuple[Path, Path], spoil: Callable[[Path], object], said: str
) -> None:
    """A publisher's key that another user could write (or a link to one) would let them
    choose whose signatures pass: a ConfigError at start naming the file and the fix."""
    if said == "owned by root or the agent" and os.geteuid() != 0:
        pytest.skip("chowning to another uid needs root")
    _, public_key = publisher
    spoil(public_key)
    config = tmp_path / "agent.toml"
    config.write_text(_config(public_key, "b"))
    with pytest.raises(ConfigError, match=re.escape(said)):
        signature_rules(load_settings(config))


def test_the_key_is_read_once_at_start(
    tmp_path: Path, publisher: tuple[Path, Path], s3_server: S3Server
) -> None:
    """Replacing the key file after start changes nothing: the rule verifies with the key
    it read, so a model the original key signed still verifies and a stranger's does not."""
    private_key, public_key = publisher
    config = tmp_path / "agent.toml"
    config.write_text(_config(public_key, "b"))
    (rule,) = signature_rules(load_settings(config))
    stranger_private, stranger_public = make_publisher_keys(tmp_path / "stranger", "stranger")
    public_key.write_bytes(stranger_public.read_bytes())
    assert rule.verify(_signed_model(tmp_path / "ours", private_key)).startswith("key ")
    with pytest.raises(IntegrityError, match="does not verify"):
        rule.verify(_signed_model(tmp_path / "theirs", stranger_private))
