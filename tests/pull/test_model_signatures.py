"""Model signatures: a source that must be signed publishes only what its publisher signed.

Real keys (EC P-256, as the publisher's), the OpenSSF model-signing package signing the
model directory as a publisher would, the real (moto) S3 server and the real agent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from agent_helpers import AgentFactory, cache_entries

from agent.client import Client, IntegrityError
from agent.testing import S3Server, make_publisher_keys, sign_model, upload_directory

pytest.importorskip("model_signing", reason="the signatures extra (dev installs it)")

SIGNATURE = "model.sig"


def _signed_model(directory: Path, private_key: Path) -> Path:
    """A small model directory signed with model-signing, its signature inside it."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(_safetensors(4096))
    sign_model(directory, private_key, SIGNATURE)
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
    from agent._config import ConfigError, load_settings
    from agent.check.signatures import signature_rules

    config = tmp_path / "agent.toml"
    config.write_text(_config(tmp_path / "missing.pub", "b"))
    with pytest.raises(ConfigError, match=r"missing\.pub is not a readable file"):
        signature_rules(load_settings(config))
