"""The S3 side of compile caches: content-addressed archives merged by one manifest per key.

Each behaviour runs twice through the same source interface: in-process over
``MemorySource`` (fast, no server) and over ``S3Source`` against the real
(moto) S3 server, so the in-memory semantics are held to S3's own answers.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from source_helpers import SOURCES, object_source

from agent import IntegrityError
from agent._uri import parse_uri
from agent.compile.archive import FileFacts, PackResult, content_digest, pack, unpack
from agent.compile.remote import MANIFEST_MAX_BYTES, RemoteCompileCaches
from agent.source.interface import ObjectSource
from agent.testing import MemorySource

KEY = "c0ffee" + "0" * 26
MANIFEST = f"compile/{KEY}/manifest.json"


@pytest.fixture(params=SOURCES)
async def source(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[ObjectSource, str]]:
    """The object source under test and the bucket it holds."""
    async for pair in object_source(request, monkeypatch):
        yield pair


@pytest.fixture
def remote(source: tuple[ObjectSource, str]) -> RemoteCompileCaches:
    """Compile caches under ``s3://<bucket>/compile/`` of the source under test."""
    objects, bucket = source
    return RemoteCompileCaches(objects, parse_uri(f"s3://{bucket}/compile"))


def _node(tmp_path: Path, name: str, *files: str, size: int = 4096) -> Path:
    """A key directory of one node holding ``files`` (random bytes) under inductor/."""
    directory = tmp_path / name
    (directory / "inductor").mkdir(parents=True)
    for file in files:
        (directory / "inductor" / file).write_bytes(os.urandom(size))
    return directory


async def _upload(remote: RemoteCompileCaches, directory: Path, tmp_path: Path) -> bool:
    """Upload what ``directory`` holds that the manifest lacks, as the agent's packer does."""
    local = content_digest(directory).files

    async def pack_delta(wanted: tuple[FileFacts, ...]) -> tuple[Path, PackResult]:
        sent = {facts[0] for facts in wanted}
        skip = {facts[0] for facts in local} - sent
        archive = tmp_path / f"{directory.name}-{len(sent)}-{len(skip)}.tar.zst"
        return archive, await asyncio.to_thread(pack, directory, archive, skip=skip)

    return (await remote.upload(KEY, local, pack_delta, {})).uploaded


async def _restore(remote: RemoteCompileCaches, tmp_path: Path) -> set[str]:
    """Every file the manifest's archives hold, each archive checked against its digest."""
    manifest = await remote.read_manifest(KEY)
    assert manifest is not None
    await asyncio.to_thread(tmp_path.mkdir, exist_ok=True)
    paths: set[str] = set()
    for number, entry in enumerate(manifest.archives):
        download, dest = tmp_path / f"dl{number}.tar.zst", tmp_path / f"restored{number}"
        await remote.download(KEY, entry, download)
        dest.mkdir()
        unpack(download, dest, expected_digest=entry.digest, max_bytes=1 << 30)
        paths |= {f[0] for f in content_digest(dest).files}
    return paths


async def test_a_key_never_uploaded_has_no_manifest(remote: RemoteCompileCaches) -> None:
    """Reading the manifest of a key nobody uploaded answers None, not an error."""
    assert await remote.read_manifest(KEY) is None


async def test_two_nodes_uploading_at_once_both_end_up_in_the_manifest(
    remote: RemoteCompileCaches, tmp_path: Path
) -> None:
    """Racing uploads of different files of one key merge: the manifest lists the union."""
    first = _node(tmp_path, "a", "shared.so", "only-a.so")
    second = _node(tmp_path, "b", "only-b.so")
    outcomes = await asyncio.gather(
        _upload(remote, first, tmp_path), _upload(remote, second, tmp_path)
    )
    assert list(outcomes) == [True, True]
    restored = await _restore(remote, tmp_path)
    assert restored == {"inductor/shared.so", "inductor/only-a.so", "inductor/only-b.so"}


async def test_a_second_upload_sends_only_what_the_manifest_lacks(
    remote: RemoteCompileCaches, tmp_path: Path
) -> None:
    """A node that restored the union and compiled one more file uploads just that file."""
    directory = _node(tmp_path, "a", "one.so")
    assert await _upload(remote, directory, tmp_path)
    assert not await _upload(remote, directory, tmp_path)  # nothing new
    (directory / "inductor" / "two.so").write_bytes(b"more")
    assert await _upload(remote, directory, tmp_path)
    manifest = await remote.read_manifest(KEY)
    assert manifest is not None
    assert [entry.file_count for entry in manifest.archives] == [1, 1]
    assert manifest.archives[1].files is not None
    assert manifest.archives[1].files[0][0] == "inductor/two.so"


async def test_a_file_listed_with_other_content_is_sent_again_and_listed_newest(
    remote: RemoteCompileCaches, tmp_path: Path
) -> None:
    """Same path, new bytes (a kernel uploaded half-written): re-sent, and the union shows it."""
    directory = _node(tmp_path, "a", "kernel.so", size=0)
    assert await _upload(remote, directory, tmp_path)
    (directory / "inductor" / "kernel.so").write_bytes(os.urandom(4096))
    assert await _upload(remote, directory, tmp_path)
    assert not await _upload(remote, directory, tmp_path)  # now S3 has it as it is
    manifest = await remote.read_manifest(KEY)
    assert manifest is not None
    assert [entry.content_bytes for entry in manifest.archives] == [0, 4096]
    assert manifest.union_files() == list(content_digest(directory).files)


async def test_a_legacy_pointer_is_read_and_kept_when_the_first_manifest_is_written(
    remote: RemoteCompileCaches, source: tuple[ObjectSource, str], tmp_path: Path
) -> None:
    """A cache uploaded by an older agent (pointer.json) still restores, and survives a merge."""
    objects, bucket = source
    old = _node(tmp_path, "old", "legacy.so")
    archive = tmp_path / "legacy.tar.zst"
    packed = pack(old, archive)
    name = "archives/0123456789abcdef-1-abcd.tar.zst"
    await objects.put_object(bucket, f"compile/{KEY}/{name}", archive.read_bytes())
    pointer = {
        "format": 1,
        "key": KEY,
        "archive": name,
        "digest": packed.digest,
        "archive_bytes": packed.archive_bytes,
        "content_bytes": packed.content_bytes,
        "file_count": packed.file_count,
        "uploaded": 1.0,
        "parts": {},
    }
    await objects.put_object(bucket, f"compile/{KEY}/pointer.json", json.dumps(pointer).encode())
    assert await _restore(remote, tmp_path / "first") == {"inductor/legacy.so"}
    assert await _upload(remote, _node(tmp_path, "new", "new.so"), tmp_path)
    assert await _restore(remote, tmp_path / "second") == {"inductor/legacy.so", "inductor/new.so"}


async def test_an_archive_over_the_threshold_goes_up_in_parts(tmp_path: Path) -> None:
    """With a small multipart threshold the archive is sent as parts and restores whole."""
    source = MemorySource()
    source.objects["bucket"] = {}
    remote = RemoteCompileCaches(
        source, parse_uri("s3://bucket/compile"), multipart_threshold=1024, part_size=8192
    )
    directory = _node(tmp_path, "big", "big.so", size=40_000)
    assert await _upload(remote, directory, tmp_path)
    assert len(source.multipart_uploads) == 1
    assert len(source.multipart_uploads[0][1]) >= 5
    assert await _restore(remote, tmp_path) == {"inductor/big.so"}


async def test_a_garbage_manifest_is_reported_then_replaced_by_the_next_upload(
    remote: RemoteCompileCaches, source: tuple[ObjectSource, str], tmp_path: Path
) -> None:
    """A manifest read whole that is not JSON reads as IntegrityError; an upload replaces it."""
    objects, bucket = source
    await objects.put_object(bucket, MANIFEST, b"not json")
    with pytest.raises(IntegrityError, match="unreadable"):
        await remote.read_manifest(KEY)
    assert await _upload(remote, _node(tmp_path, "a", "a.so"), tmp_path)
    assert await _restore(remote, tmp_path) == {"inductor/a.so"}


async def test_a_manifest_too_large_to_read_is_never_replaced_by_an_upload(
    remote: RemoteCompileCaches, source: tuple[ObjectSource, str], tmp_path: Path
) -> None:
    """A manifest over the cap refuses the push, naming the object to delete, and stays as is:
    a node that could not read it whole must not drop the files it lists."""
    objects, bucket = source
    body = b" " * (MANIFEST_MAX_BYTES + 1)
    await objects.put_object(bucket, MANIFEST, body)
    with pytest.raises(IntegrityError, match="too large to read") as refused:
        await _upload(remote, _node(tmp_path, "a", "a.so"), tmp_path)
    assert f"s3://{bucket}/{MANIFEST}" in str(refused.value)
    stored = await objects.get_object(bucket, MANIFEST, max_bytes=MANIFEST_MAX_BYTES + 1)
    assert stored is not None
    assert stored.data == body


async def test_a_manifest_of_thousands_of_files_is_read_whole_and_kept_by_the_next_push(
    remote: RemoteCompileCaches, tmp_path: Path
) -> None:
    """A manifest far bigger than one network read (3,000 files) reads whole on another
    node, whose push then adds its file to the 3,000 instead of replacing them."""
    names = [f"k{number:04d}.py" for number in range(3000)]
    assert await _upload(remote, _node(tmp_path, "one", *names, size=16), tmp_path)
    manifest = await remote.read_manifest(KEY)
    assert manifest is not None
    assert len(manifest.to_bytes()) > 128_000
    assert await _upload(remote, _node(tmp_path, "two", "late.so"), tmp_path)
    assert await _restore(remote, tmp_path / "restored") == {
        *(f"inductor/{name}" for name in names),
        "inductor/late.so",
    }
