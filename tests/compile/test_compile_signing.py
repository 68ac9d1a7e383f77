"""Signed compile caches: a restore unpacks only what a key the domain trusts vouched for.

The seal itself is pinned in process; what a holder of S3 write access (but of no
trusted key) can plant is tried against the real (moto) S3 server, through the
same RemoteCompileCaches a node uses, and through the real daemon that a pod asks.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agent_helpers import AgentFactory
from source_helpers import object_source

from agent._config import ConfigError
from agent._exceptions import IntegrityError
from agent._uri import parse_uri
from agent.client import Client
from agent.compile.archive import FileFacts, PackResult, content_digest, pack
from agent.compile.keys import CompileKeyParts, compile_key, normalise_parts
from agent.compile.remote import MANIFEST_NAME, RemoteCompileCaches
from agent.compile.signing import (
    UNCHECKED,
    SignatureRefused,
    Signing,
    Trust,
    load_signing_key,
    load_trusted_keys,
)
from agent.source.interface import ObjectSource
from agent.testing import SigningKeys, make_keys

DOMAIN = "node"
PARTS = CompileKeyParts(torch_version="2.13.0", model_key="signed")
KEY = compile_key(normalise_parts(PARTS))


def _signing(
    keys: SigningKeys | None, *trusted: SigningKeys, accept_unsigned: bool = False
) -> Signing:
    """A domain that signs with ``keys`` (None: does not sign) and trusts ``trusted``."""
    return Signing(
        DOMAIN,
        load_signing_key(keys.private) if keys else None,
        Trust(load_trusted_keys([t.public for t in trusted]), accept_unsigned=accept_unsigned),
    )


# -- the seal, in process ------------------------------------------------------------------


def test_a_sealed_document_opens_with_its_signers_name_only_at_its_own_place(
    tmp_path: Path,
) -> None:
    """A document sealed for one place opens there with the signer's name; opened at another
    place (another key, another domain) or with one byte changed it is bad-signature."""
    keys = make_keys(tmp_path, "group-a")
    signing = _signing(keys, keys)
    sealed = signing.seal(f"{KEY}/manifest.json", b'{"a": 1}')
    opened = signing.open(f"{KEY}/manifest.json", sealed)
    assert (opened.document, opened.signer) == (b'{"a": 1}', "group-a")
    with pytest.raises(SignatureRefused, match="does not verify") as moved:
        signing.open(f"{'0' * 32}/manifest.json", sealed)
    assert moved.value.reason == "bad-signature"
    other_domain = Signing("tenant-b", None, signing.trust)
    with pytest.raises(SignatureRefused, match="does not verify"):
        other_domain.open(f"{KEY}/manifest.json", sealed)
    document = json.loads(sealed)
    document["document"] = base64.b64encode(b'{"a": 2}').decode()
    with pytest.raises(SignatureRefused, match="does not verify"):
        signing.open(f"{KEY}/manifest.json", json.dumps(document).encode())


def test_unsigned_unknown_and_malformed_seals_are_refused_each_with_its_reason(
    tmp_path: Path,
) -> None:
    """Unsigned is refused (unless accepted), a seal by an untrusted key is unknown-key, and a
    broken seal is refused rather than read as an unsigned document."""
    trusted, stranger = make_keys(tmp_path / "t", "trusted"), make_keys(tmp_path / "s", "stranger")
    strict = _signing(None, trusted)
    with pytest.raises(SignatureRefused, match="is not signed") as unsigned:
        strict.open("k/manifest.json", b"{}")
    assert unsigned.value.reason == "unsigned"
    assert _signing(None, trusted, accept_unsigned=True).open("k/manifest.json", b"{}").signer == ""
    forged = _signing(stranger).seal("k/manifest.json", b"{}")
    with pytest.raises(SignatureRefused, match="which this node does not trust") as unknown:
        strict.open("k/manifest.json", forged)
    assert unknown.value.reason == "unknown-key"
    broken = json.dumps({"sealed": 1, "signer": "x", "document": "!!", "signature": ""})
    lenient = _signing(None, trusted, accept_unsigned=True)
    with pytest.raises(SignatureRefused, match="malformed"):
        lenient.open("k/manifest.json", broken.encode())


def test_key_files_others_could_read_or_write_are_refused_and_a_directory_holds_many(
    tmp_path: Path,
) -> None:
    """A private key readable by others (another group, or everyone) and a trusted key
    writable by others stop the start (ConfigError naming the file and the chmod); 0440 in the
    agent's own group (a Kubernetes Secret under fsGroup) loads; a directory of trusted keys
    loads each."""
    first, second = make_keys(tmp_path, "first"), make_keys(tmp_path, "second")
    assert {name for name, _ in load_trusted_keys([first.trusted]).values()} == {
        "first",
        "second",
    }
    os.chown(first.private, -1, os.getegid())
    first.private.chmod(0o440)  # a Secret under the pod's fsGroup: the agent's own group
    assert load_signing_key(first.private).name == "first"
    os.chown(first.private, -1, os.getegid() + 1)
    with pytest.raises(ConfigError, match=r"first\.key is readable or writable by others"):
        load_signing_key(first.private)
    os.chown(first.private, -1, os.getegid())
    first.private.chmod(0o644)
    with pytest.raises(ConfigError, match=r"chmod 600"):
        load_signing_key(first.private)
    second.public.chmod(0o666)
    with pytest.raises(ConfigError, match=r"second.pub is writable by others"):
        load_trusted_keys([second.public])


# -- real S3: what a writer without a trusted key can plant ---------------------------------


@pytest.fixture
async def objects(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ObjectSource]:
    """An S3 source on the test's bucket in the real (moto) server."""
    request.param = "s3"
    async for source, _ in object_source(request, monkeypatch):
        yield source


def _remote(objects: ObjectSource, bucket: str, signing: Signing) -> RemoteCompileCaches:
    return RemoteCompileCaches(objects, parse_uri(f"s3://{bucket}/cc/{DOMAIN}/"), signing=signing)


def _key_directory(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / "inductor").mkdir(parents=True, exist_ok=True)
        (root / "inductor" / name).write_bytes(data)
    return root


async def _upload(remote: RemoteCompileCaches, directory: Path, scratch: Path) -> bool:
    """Upload ``directory`` as a node's packer does (only what the manifest lacks)."""
    local = content_digest(directory).files

    async def pack_delta(wanted: tuple[FileFacts, ...]) -> tuple[Path, PackResult]:
        skip = {f[0] for f in local} - {f[0] for f in wanted}
        archive = scratch / f"{directory.name}.tar.zst"
        return archive, await asyncio.to_thread(pack, directory, archive, skip=skip)

    return (await remote.upload(KEY, local, pack_delta, {})).uploaded


async def test_a_trusted_nodes_upload_restores_on_another_node_naming_its_signer(
    objects: ObjectSource, bucket: str, tmp_path: Path
) -> None:
    """Node 1 signs its upload; node 2, trusting that key, reads the manifest as signed by it
    and downloads each archive after checking its sha256."""
    keys = make_keys(tmp_path / "keys", "gpu-nodes")
    one = _remote(objects, bucket, _signing(keys, keys))
    two = _remote(objects, bucket, _signing(None, keys))
    assert await _upload(one, _key_directory(tmp_path / "one", {"k.py": b"print(1)"}), tmp_path)
    manifest = await two.read_manifest(KEY)
    assert manifest is not None
    assert manifest.signer == "gpu-nodes"
    [entry] = manifest.archives
    assert len(entry.archive_sha256) == 64
    await two.download(KEY, entry, tmp_path / "got.tar.zst")


async def test_a_manifest_planted_by_a_writer_without_a_trusted_key_is_refused(
    objects: ObjectSource, bucket: str, tmp_path: Path
) -> None:
    """A manifest and archive written straight to S3 unsigned, or sealed with the writer's own
    key, are refused on read (unsigned, unknown-key); the next signed upload replaces them."""
    keys, stranger = make_keys(tmp_path / "k", "nodes"), make_keys(tmp_path / "s", "stranger")
    node = _remote(objects, bucket, _signing(keys, keys))
    evil = _key_directory(tmp_path / "evil", {"payload.py": b"import os; os.system('id')"})
    for planter, reason in ((UNCHECKED, "unsigned"), (_signing(stranger), "unknown-key")):
        await objects.delete_object(bucket, f"cc/{DOMAIN}/{KEY}/{MANIFEST_NAME}")
        assert await _upload(_remote(objects, bucket, planter), evil, tmp_path)
        with pytest.raises(SignatureRefused) as refused:
            await node.read_manifest(KEY)
        assert refused.value.reason == reason
    assert await _upload(node, _key_directory(tmp_path / "good", {"ok.py": b"1"}), tmp_path)
    manifest = await node.read_manifest(KEY)
    assert manifest is not None
    assert manifest.signer == "nodes"
    assert {f[0] for f in manifest.union_files()} == {"inductor/ok.py"}


async def test_an_archive_replaced_under_a_signed_manifest_is_refused_before_unpacking(
    objects: ObjectSource, bucket: str, tmp_path: Path
) -> None:
    """The signed manifest lists the archive's sha256: an archive object overwritten with other
    bytes of the same size is refused by the download, naming it, before anything is unpacked."""
    keys = make_keys(tmp_path / "k", "nodes")
    node = _remote(objects, bucket, _signing(keys, keys))
    assert await _upload(node, _key_directory(tmp_path / "d", {"k.py": b"x" * 5000}), tmp_path)
    manifest = await node.read_manifest(KEY)
    assert manifest is not None
    [entry] = manifest.archives
    await objects.put_object(
        bucket, f"cc/{DOMAIN}/{KEY}/{entry.name}", os.urandom(entry.archive_bytes)
    )
    with pytest.raises(IntegrityError, match="is not the archive its manifest lists"):
        await node.download(KEY, entry, tmp_path / "got.tar.zst")


async def test_a_planted_index_entry_is_skipped_and_a_signed_one_replaces_it(
    objects: ObjectSource, bucket: str, tmp_path: Path
) -> None:
    """A by-model entry planted unsigned where a key's entry belongs is not trusted by
    why-miss; the node's signed entry replaces it on its next upload of that key."""
    keys = make_keys(tmp_path / "k", "nodes")
    node = _remote(objects, bucket, _signing(keys, keys))
    await _remote(objects, bucket, UNCHECKED).keys.add(KEY, PARTS)
    assert (await node.keys.keys_like(PARTS)).keys == ()
    await node.keys.add(KEY, PARTS)
    fresh = _remote(objects, bucket, _signing(None, keys))
    assert [key for key, _ in (await fresh.keys.keys_like(PARTS)).keys] == [KEY]


async def test_rotation_and_migration_keep_restoring_while_keys_change(
    objects: ObjectSource, bucket: str, tmp_path: Path
) -> None:
    """During a migration an unsigned manifest is accepted and the first signing node's push
    signs it; trusting old and new keys, a manifest of the old key restores and a push re-signs
    it with the new one; a node with no key where signatures are required does not upload."""
    old, new = make_keys(tmp_path / "o", "old-2026"), make_keys(tmp_path / "n", "new-2027")
    assert await _upload(
        _remote(objects, bucket, UNCHECKED),
        _key_directory(tmp_path / "a", {"a.py": b"a"}),
        tmp_path,
    )
    migrating = _remote(objects, bucket, _signing(old, old, accept_unsigned=True))
    manifest = await migrating.read_manifest(KEY)
    assert manifest is not None
    assert manifest.signer == ""
    assert await _upload(migrating, _key_directory(tmp_path / "b", {"b.py": b"b"}), tmp_path)
    rotated = _remote(objects, bucket, _signing(new, old, new))
    manifest = await rotated.read_manifest(KEY)
    assert manifest is not None
    assert manifest.signer == "old-2026"
    assert await _upload(rotated, _key_directory(tmp_path / "c", {"c.py": b"c"}), tmp_path)
    manifest = await _remote(objects, bucket, _signing(None, new)).read_manifest(KEY)
    assert manifest is not None
    assert manifest.signer == "new-2027"
    assert {f[0] for f in manifest.union_files()} == {
        "inductor/a.py",
        "inductor/b.py",
        "inductor/c.py",
    }
    keyless = _remote(objects, bucket, _signing(None, new))
    assert not await _upload(keyless, _key_directory(tmp_path / "e", {"e.py": b"e"}), tmp_path)


# -- the daemon a pod asks -------------------------------------------------------------------


async def test_a_pod_never_gets_a_planted_cache_and_the_agent_says_why(
    start_agent: AgentFactory, objects: ObjectSource, bucket: str, tmp_path: Path
) -> None:
    """A compile cache planted in the agent's prefix by a writer with S3 access but no trusted
    key: the pod's directory comes back empty (nothing of it to run), the handle's note and
    the log say it was refused as unsigned, and `compile ls` shows who signed (no one)."""
    planter = _remote(objects, bucket, UNCHECKED)
    evil = _key_directory(tmp_path / "evil", {"payload.py": b"import os; os.system('id')"})
    assert await _upload(planter, evil, tmp_path)
    agent = start_agent(f'[compile_cache]\nuri = "s3://{bucket}/cc"\nquiet_seconds = 60\n')
    with Client(agent.socket_path) as client:
        handle = client.compile_cache(torch_version="2.13.0", model_key="signed")
        [info] = client.list_compile_caches()
    assert handle.key == KEY
    assert not handle.restored
    assert "refused" in handle.restore_note
    assert "is not signed" in handle.restore_note
    assert not list(handle.path.rglob("payload.py"))
    assert info.signed_by == ""
    assert "refused the compile cache" in agent.log_text()
