"""The S3 side of compile caches: unique archives and a conditionally switched pointer.

Each behaviour runs twice through the same source interface: in-process over
``MemorySource`` (fast, no server) and over ``S3Source`` against the real
(moto) S3 server, so the in-memory semantics are held to S3's own answers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from source_helpers import SOURCES, object_source

from agent import IntegrityError
from agent._uri import parse_uri
from agent.compile.archive import PackResult, pack, unpack
from agent.compile.remote import POINTER_MAX_BYTES, ArchiveGone, RemoteCompileCaches
from agent.source.interface import ObjectSource

KEY = "c0ffee" + "0" * 26
POINTER = f"compile/{KEY}/pointer.json"


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


def _packed(tmp_path: Path, name: str) -> tuple[Path, PackResult]:
    directory = tmp_path / name
    (directory / "inductor").mkdir(parents=True)
    (directory / "inductor" / f"{name}.so").write_bytes(os.urandom(4096))
    archive = tmp_path / f"{name}.tar.zst"
    return archive, pack(directory, archive)


async def _objects(source: tuple[ObjectSource, str]) -> list[str]:
    objects, bucket = source
    listed = await objects.list_objects(parse_uri(f"s3://{bucket}/compile/{KEY}/"))
    return sorted(item.key.removeprefix(f"compile/{KEY}/") for item in listed)


async def test_a_key_never_uploaded_has_no_pointer(remote: RemoteCompileCaches) -> None:
    """Reading the pointer of a key nobody uploaded answers None, not an error."""
    assert await remote.read_pointer(KEY) is None


async def test_a_writer_with_a_stale_pointer_cannot_switch_it(
    remote: RemoteCompileCaches, tmp_path: Path
) -> None:
    """A pointer switch conditioned on an old ETag, or on no pointer, loses and changes nothing."""
    archive, packed = _packed(tmp_path, "a")
    assert (await remote.upload(KEY, archive, packed, {})).uploaded
    seen = await remote.read_pointer(KEY)
    assert seen is not None
    other, other_packed = _packed(tmp_path, "b")
    assert (await remote.upload(KEY, other, other_packed, {})).uploaded
    # Both conditions a late writer could send are refused by the store itself (412).
    assert not await remote._switch_pointer(KEY, b"{}", seen.etag)
    assert not await remote._switch_pointer(KEY, b"{}", None)
    current = await remote.read_pointer(KEY)
    assert current is not None
    assert current.digest == other_packed.digest


async def test_the_pointer_always_names_a_whole_archive_of_its_digest(
    remote: RemoteCompileCaches, source: tuple[ObjectSource, str], tmp_path: Path
) -> None:
    """Two racing uploads leave a pointer whose archive exists and unpacks to its digest."""
    first, second = _packed(tmp_path, "a"), _packed(tmp_path, "b")
    outcomes = await asyncio.gather(remote.upload(KEY, *first, {}), remote.upload(KEY, *second, {}))
    assert any(o.uploaded for o in outcomes)
    pointer = await remote.read_pointer(KEY)
    assert pointer is not None
    assert pointer.digest in (first[1].digest, second[1].digest)
    assert pointer.archive in await _objects(source)
    download = tmp_path / "download.tar.zst"
    await remote.download(pointer, download)
    dest = tmp_path / "restored"
    dest.mkdir()
    restored = unpack(download, dest, expected_digest=pointer.digest, max_bytes=1 << 30)
    assert restored.digest == pointer.digest


async def test_an_upload_replaces_the_archive_it_supersedes_and_skips_the_same_content(
    remote: RemoteCompileCaches, source: tuple[ObjectSource, str], tmp_path: Path
) -> None:
    """A new upload deletes the archive it replaced; the same content again is not re-sent."""
    first, second = _packed(tmp_path, "a"), _packed(tmp_path, "b")
    await remote.upload(KEY, *first, {})
    await remote.upload(KEY, *second, {})
    pointer = await remote.read_pointer(KEY)
    assert pointer is not None
    assert await _objects(source) == sorted([pointer.archive, "pointer.json"])
    again = await remote.upload(KEY, *second, {})
    assert (again.uploaded, again.reason) == (False, "S3 already has this content")


async def test_a_superseded_archive_is_reported_gone(
    remote: RemoteCompileCaches, tmp_path: Path
) -> None:
    """Downloading through a pointer whose archive was replaced raises ArchiveGone (re-read)."""
    await remote.upload(KEY, *_packed(tmp_path, "a"), {})
    stale = await remote.read_pointer(KEY)
    await remote.upload(KEY, *_packed(tmp_path, "b"), {})
    assert stale is not None
    with pytest.raises(ArchiveGone):
        await remote.download(stale, tmp_path / "download.tar.zst")


async def test_an_archive_of_another_size_than_its_pointer_says_is_refused(
    remote: RemoteCompileCaches, tmp_path: Path
) -> None:
    """An archive whose size differs from the pointer's record is an IntegrityError."""
    await remote.upload(KEY, *_packed(tmp_path, "a"), {})
    pointer = await remote.read_pointer(KEY)
    assert pointer is not None
    lying = replace(pointer, archive_bytes=pointer.archive_bytes + 1)
    with pytest.raises(IntegrityError, match="truncated or was replaced"):
        await remote.download(lying, tmp_path / "download.tar.zst")


@pytest.mark.parametrize("body", [b"not json", b" " * (POINTER_MAX_BYTES + 1)])
async def test_an_unreadable_pointer_is_reported_then_replaced_by_the_next_upload(
    remote: RemoteCompileCaches, source: tuple[ObjectSource, str], tmp_path: Path, body: bytes
) -> None:
    """Garbage or an oversized pointer reads as IntegrityError; an upload overwrites it."""
    objects, bucket = source
    await objects.put_object(bucket, POINTER, body)
    with pytest.raises(IntegrityError, match="unreadable"):
        await remote.read_pointer(KEY)
    archive, packed = _packed(tmp_path, "a")
    assert (await remote.upload(KEY, archive, packed, {})).uploaded
    pointer = await remote.read_pointer(KEY)
    assert pointer is not None
    assert pointer.digest == packed.digest
