"""The S3 side of compile caches: unique archives and a conditionally switched pointer.

Runs the agent's own S3 code in-process against the real (moto) S3 server.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent._config import S3Settings
from agent._uri import parse_uri
from agent.compile.archive import PackResult, pack, unpack
from agent.compile.remote import RemoteCompileCaches
from agent.source.s3 import S3Source
from agent.testing import S3Server

KEY = "c0ffee" + "0" * 26


@pytest.fixture
async def remote(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[RemoteCompileCaches]:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    settings = S3Settings(endpoint_url=s3_server.endpoint_url, addressing_style="path")
    async with S3Source(settings) as source:
        yield RemoteCompileCaches(source, parse_uri(f"s3://{bucket}/compile"))


def _packed(tmp_path: Path, name: str) -> tuple[Path, PackResult]:
    directory = tmp_path / name
    (directory / "inductor").mkdir(parents=True)
    (directory / "inductor" / f"{name}.so").write_bytes(os.urandom(4096))
    archive = tmp_path / f"{name}.tar.zst"
    return archive, pack(directory, archive)


def _objects(s3_client: Any, bucket: str) -> list[str]:
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=f"compile/{KEY}/")
    return sorted(item["Key"].removeprefix(f"compile/{KEY}/") for item in listed["Contents"])


async def test_a_writer_with_a_stale_pointer_cannot_switch_it(
    remote: RemoteCompileCaches, tmp_path: Path
) -> None:
    archive, packed = _packed(tmp_path, "a")
    assert (await remote.upload(KEY, archive, packed, {})).uploaded
    seen = await remote.read_pointer(KEY)
    assert seen is not None
    other, other_packed = _packed(tmp_path, "b")
    assert (await remote.upload(KEY, other, other_packed, {})).uploaded
    # Both conditions a late writer could send are refused by S3 itself (412).
    assert not await remote._switch_pointer(KEY, b"{}", seen.etag)
    assert not await remote._switch_pointer(KEY, b"{}", None)
    current = await remote.read_pointer(KEY)
    assert current is not None
    assert current.digest == other_packed.digest


async def test_the_pointer_always_names_a_whole_archive_of_its_digest(
    remote: RemoteCompileCaches, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    first, second = _packed(tmp_path, "a"), _packed(tmp_path, "b")
    outcomes = await asyncio.gather(remote.upload(KEY, *first, {}), remote.upload(KEY, *second, {}))
    assert any(o.uploaded for o in outcomes)
    pointer = await remote.read_pointer(KEY)
    assert pointer is not None
    assert pointer.digest in (first[1].digest, second[1].digest)
    assert pointer.archive in _objects(s3_client, bucket)
    download = tmp_path / "download.tar.zst"
    await remote.download(pointer, download)
    dest = tmp_path / "restored"
    dest.mkdir()
    restored = unpack(download, dest, expected_digest=pointer.digest, max_bytes=1 << 30)
    assert restored.digest == pointer.digest


async def test_an_upload_replaces_the_archive_it_supersedes_and_skips_the_same_content(
    remote: RemoteCompileCaches, s3_client: Any, bucket: str, tmp_path: Path
) -> None:
    first, second = _packed(tmp_path, "a"), _packed(tmp_path, "b")
    await remote.upload(KEY, *first, {})
    await remote.upload(KEY, *second, {})
    pointer = await remote.read_pointer(KEY)
    assert pointer is not None
    assert _objects(s3_client, bucket) == sorted([pointer.archive, "pointer.json"])
    again = await remote.upload(KEY, *second, {})
    assert (again.uploaded, again.reason) == (False, "S3 already has this content")
