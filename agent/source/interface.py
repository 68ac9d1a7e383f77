"""What the rest of the agent may ask of an object store, and nothing of how.

``S3Source`` (agent.source.s3) is the real implementation;
``agent.testing.MemorySource`` is the in-memory one for in-process tests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

from agent._exceptions import SourceUnavailable
from agent._uri import ModelUri
from agent.check.hashes import S3Checksum

__all__ = ["ListedObject", "ObjectSource", "RangeReadError", "RangeReader"]


@dataclass(frozen=True, slots=True)
class ListedObject:
    key: str
    size: int
    etag: str
    checksum_algorithm: str = ""


class RangeReadError(SourceUnavailable):
    """A ranged read broke off or failed in a way that a retry may fix."""


class RangeReader(Protocol):
    async def read(self, amount: int) -> bytes:
        """Up to ``amount`` bytes; b"" once the range is exhausted."""
        ...


class ObjectSource(Protocol):
    """What the puller needs from an object store."""

    name: str

    async def list_objects(self, uri: ModelUri) -> list[ListedObject]: ...

    def open_range(
        self, bucket: str, key: str, *, etag: str, start: int, length: int
    ) -> contextlib.AbstractAsyncContextManager[RangeReader]: ...

    async def head_checksum(self, bucket: str, key: str, *, etag: str) -> S3Checksum | None:
        """The checksum S3 holds for the object, or None if it has none."""
        ...
