"""What the rest of the agent may ask of an object store, and nothing of how.

``S3Source`` (agent.source.s3) is the real implementation;
``agent.testing.MemorySource`` is the in-memory one for in-process tests.
Every failure comes out as a prewarm error (agent._exceptions): callers never
see a client library's exceptions or error codes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterable
from dataclasses import dataclass
from typing import Protocol

from agent._config import S3Settings
from agent._exceptions import IntegrityError, SourceUnavailable
from agent._uri import ModelUri
from agent.source.checksums import S3Checksum

__all__ = [
    "ListedObject",
    "ObjectHead",
    "ObjectSource",
    "ObjectTooLarge",
    "RangeReadError",
    "RangeReader",
    "StoredObject",
]


@dataclass(frozen=True, slots=True)
class ListedObject:
    """One object of a listing page: its key, size, ETag and checksum algorithm."""

    key: str
    size: int
    etag: str
    checksum_algorithm: str = ""


@dataclass(frozen=True, slots=True)
class ObjectHead:
    """What a HEAD says about one object: its size, its ETag, and S3's checksum if any."""

    key: str
    size: int
    etag: str
    checksum: S3Checksum | None = None


@dataclass(frozen=True, slots=True)
class StoredObject:
    """A small object read whole, with the ETag a conditional put can name."""

    data: bytes
    etag: str


class RangeReadError(SourceUnavailable):
    """A ranged read broke off or failed in a way that a retry may fix."""


class ObjectTooLarge(IntegrityError):
    """A small-object read found more bytes than the caller's cap (``max_bytes``)."""


class RangeReader(Protocol):
    """The body of one ranged GET, read in pieces."""

    async def read(self, amount: int) -> bytes:
        """Up to ``amount`` bytes; b"" once the range is exhausted."""
        ...


class ObjectSource(Protocol):
    """What the puller, the compile caches and the integrity checks need from an object store."""

    name: str

    @property
    def s3_settings(self) -> S3Settings | None:
        """The S3 settings the source was built from; None when the source is not S3, so
        only the aiobotocore plane (its own reader) can read it."""
        ...

    async def list_objects(self, uri: ModelUri) -> list[ListedObject]:
        """Every object under the prefix."""
        ...

    def list_pages(self, uri: ModelUri) -> AsyncGenerator[list[ListedObject], None]:
        """The objects under the prefix, a page (one listing request) at a time.

        Closing the generator early stops the listing: no further request is sent.
        """
        ...

    def open_range(
        self, bucket: str, key: str, *, etag: str, start: int, length: int
    ) -> contextlib.AbstractAsyncContextManager[RangeReader]:
        """Stream ``length`` bytes from ``start``; SourceChanged once the ETag is not ``etag``."""
        ...

    async def head_object(
        self, bucket: str, key: str, *, etag: str | None = None
    ) -> ObjectHead | None:
        """The object's size, ETag and checksum; None if there is no such object.

        With ``etag``, the object must still have it: SourceChanged if it was
        replaced or deleted.
        """
        ...

    async def get_object(self, bucket: str, key: str, *, max_bytes: int) -> StoredObject | None:
        """A whole object read into memory; None if absent, ObjectTooLarge past ``max_bytes``."""
        ...

    async def put_object(
        self,
        bucket: str,
        key: str,
        body: bytes,
        *,
        content_type: str = "application/octet-stream",
        if_match: str | None = None,
        if_absent: bool = False,
    ) -> str:
        """Store ``body`` under ``key`` and answer its new ETag.

        ``if_match`` writes only over the object with that ETag, ``if_absent``
        only where there is none: when another writer got there first the put
        raises Conflict and changes nothing.
        """
        ...

    async def delete_object(self, bucket: str, key: str) -> None:
        """Remove the object; deleting one that is already gone is not an error."""
        ...

    async def put_object_multipart(
        self,
        bucket: str,
        key: str,
        parts: AsyncIterable[bytes],
        *,
        content_type: str = "application/octet-stream",
    ) -> str:
        """Store an object too big for one PUT (over 5 GiB) from ``parts``, in order.

        Every part but the last must hold at least 5 MiB (S3's minimum). The
        object appears whole when the last part is in, or not at all: a failure
        aborts the upload. Answers the object's ETag.
        """
        ...
