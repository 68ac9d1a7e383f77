"""The object-source interface as both sources answer it: S3 on a real server, and memory.

The same assertions run over ``S3Source`` (moto) and ``MemorySource``, so the
in-memory source that in-process tests rely on keeps S3's semantics: ETags,
conditional puts that lose with Conflict, None for what is absent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from source_helpers import SOURCES, object_source

from agent import Conflict, SourceChanged
from agent._uri import parse_uri
from agent.source.interface import ObjectSource, ObjectTooLarge

Pair = tuple[ObjectSource, str]


@pytest.fixture(params=SOURCES)
async def source(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Pair]:
    """The object source under test and the bucket it holds."""
    async for pair in object_source(request, monkeypatch):
        yield pair


async def test_a_put_object_reads_back_with_the_etag_the_put_answered(source: Pair) -> None:
    """get_object returns the bytes stored and the same ETag put_object returned."""
    objects, bucket = source
    etag = await objects.put_object(bucket, "k/a.json", b'{"a": 1}')
    stored = await objects.get_object(bucket, "k/a.json", max_bytes=1024)
    assert stored is not None
    assert (stored.data, stored.etag) == (b'{"a": 1}', etag)


async def test_absent_objects_read_as_none(source: Pair) -> None:
    """get_object and head_object (without an ETag) answer None for a missing key."""
    objects, bucket = source
    assert await objects.get_object(bucket, "nothing", max_bytes=10) is None
    assert await objects.head_object(bucket, "nothing") is None


async def test_an_object_over_the_cap_is_refused(source: Pair) -> None:
    """A small-object read of more than max_bytes raises ObjectTooLarge instead of reading on."""
    objects, bucket = source
    await objects.put_object(bucket, "big", b"x" * 11)
    assert await objects.get_object(bucket, "big", max_bytes=11) is not None
    with pytest.raises(ObjectTooLarge):
        await objects.get_object(bucket, "big", max_bytes=10)


async def test_a_put_if_absent_loses_to_an_existing_object(source: Pair) -> None:
    """If-None-Match: * writes a new key once; a second such put raises Conflict."""
    objects, bucket = source
    await objects.put_object(bucket, "p", b"first", if_absent=True)
    with pytest.raises(Conflict):
        await objects.put_object(bucket, "p", b"second", if_absent=True)
    stored = await objects.get_object(bucket, "p", max_bytes=100)
    assert stored is not None
    assert stored.data == b"first"


async def test_a_put_if_match_wins_only_over_the_etag_it_names(source: Pair) -> None:
    """If-Match on the current ETag replaces the object; on a stale ETag it raises Conflict."""
    objects, bucket = source
    first = await objects.put_object(bucket, "p", b"one")
    second = await objects.put_object(bucket, "p", b"two", if_match=first)
    with pytest.raises(Conflict):
        await objects.put_object(bucket, "p", b"late", if_match=first)
    stored = await objects.get_object(bucket, "p", max_bytes=100)
    assert stored is not None
    assert (stored.data, stored.etag) == (b"two", second)


async def test_head_reports_size_and_etag_and_holds_to_an_etag(source: Pair) -> None:
    """head_object gives size and ETag; with a stale ETag, or after a delete, SourceChanged."""
    objects, bucket = source
    etag = await objects.put_object(bucket, "h", b"12345")
    head = await objects.head_object(bucket, "h", etag=etag)
    assert head is not None
    assert (head.key, head.size, head.etag) == ("h", 5, etag)
    await objects.put_object(bucket, "h", b"changed")
    with pytest.raises(SourceChanged):
        await objects.head_object(bucket, "h", etag=etag)
    await objects.delete_object(bucket, "h")
    with pytest.raises(SourceChanged):
        await objects.head_object(bucket, "h", etag=etag)


async def test_delete_removes_the_object_and_tolerates_a_missing_one(source: Pair) -> None:
    """delete_object removes a key from listings; deleting it again is not an error."""
    objects, bucket = source
    await objects.put_object(bucket, "d/x", b"x")
    await objects.put_object(bucket, "d/y", b"y")
    await objects.delete_object(bucket, "d/x")
    await objects.delete_object(bucket, "d/x")
    listed = await objects.list_objects(parse_uri(f"s3://{bucket}/d/"))
    assert [item.key for item in listed] == ["d/y"]


async def test_a_range_reads_with_its_etag_and_refuses_a_changed_object(source: Pair) -> None:
    """open_range streams the asked bytes; once the object changed it raises SourceChanged."""
    objects, bucket = source
    etag = await objects.put_object(bucket, "r", b"0123456789")
    async with objects.open_range(bucket, "r", etag=etag, start=2, length=5) as reader:
        data = b""
        while piece := await reader.read(3):
            data += piece
    assert data == b"23456"
    await objects.put_object(bucket, "r", b"other")
    with pytest.raises(SourceChanged):
        async with objects.open_range(bucket, "r", etag=etag, start=0, length=5):
            pass
