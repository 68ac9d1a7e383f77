"""An in-memory ObjectSource: the puller's test double, with scripted failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from agent._exceptions import NotFound, SourceChanged
from agent._uri import ModelUri
from agent.check.hashes import S3Checksum
from agent.source.interface import ListedObject, RangeReadError

__all__ = ["MemorySource", "RangeRead"]


@dataclass(slots=True)
class RangeRead:
    """One open_range call the source answered, and how many bytes it delivered."""

    key: str
    start: int
    length: int
    delivered: int = 0


@dataclass
class MemorySource:
    """Objects held in a dict, served like S3 would.

    ``break_after`` scripts mid-body failures: for a key, a list of byte counts;
    each range opened on that key sends that many bytes and then fails with a
    retryable RangeReadError (one list item per failure, in order).
    """

    objects: dict[str, dict[str, bytes]] = field(default_factory=dict)
    break_after: dict[str, list[int]] = field(default_factory=dict)
    piece: int = 64 * 1024
    reads: list[RangeRead] = field(default_factory=list)
    # When set, every read after the first piece of a range waits for this event:
    # a test can hold a pull mid-transfer, then let it go.
    gate: asyncio.Event | None = None
    # Checksums to report for keys (as S3 would from HEAD with ChecksumMode);
    # the listing then names their algorithm.
    checksums: dict[str, S3Checksum] = field(default_factory=dict)
    name: str = "memory"

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.objects.setdefault(bucket, {})[key] = data

    def etag(self, bucket: str, key: str) -> str:
        return f'"{hash(self.objects[bucket][key]) & 0xFFFFFFFF:08x}"'

    async def list_objects(self, uri: ModelUri) -> list[ListedObject]:
        bucket = self._bucket(uri.bucket)
        return [
            ListedObject(
                key=key,
                size=len(data),
                etag=self.etag(uri.bucket, key),
                checksum_algorithm=self.checksums[key].algorithm if key in self.checksums else "",
            )
            for key, data in sorted(bucket.items())
            if key.startswith(uri.prefix)
        ]

    @contextlib.asynccontextmanager
    async def open_range(
        self, bucket: str, key: str, *, etag: str, start: int, length: int
    ) -> AsyncIterator[_Reader]:
        data = self._bucket(bucket).get(key)
        if data is None or self.etag(bucket, key) != etag:
            raise SourceChanged(f"{key} changed or disappeared")
        record = RangeRead(key, start, length)
        self.reads.append(record)
        failures = self.break_after.get(key, [])
        cut = failures.pop(0) if failures else None
        yield _Reader(data[start : start + length], self.piece, cut, record, self.gate)

    async def head_checksum(self, bucket: str, key: str, *, etag: str) -> S3Checksum | None:
        return self.checksums.get(key)

    def _bucket(self, name: str) -> Mapping[str, bytes]:
        if name not in self.objects:
            raise NotFound(f"Bucket {name!r} does not exist.")
        return self.objects[name]


class _Reader:
    def __init__(
        self,
        data: bytes,
        piece: int,
        cut: int | None,
        record: RangeRead,
        gate: asyncio.Event | None,
    ) -> None:
        self._gate = gate
        self._record = record
        self._data = data
        self._position = 0
        self._piece = piece
        self._cut = cut

    async def read(self, amount: int) -> bytes:
        if self._gate is not None and self._position > 0:
            await self._gate.wait()
        if self._cut is not None and self._position >= self._cut:
            raise RangeReadError("connection reset by peer (scripted)")
        end = min(len(self._data), self._position + min(amount, self._piece))
        if self._cut is not None:
            end = min(end, self._cut)
        chunk = self._data[self._position : end]
        self._position = end
        self._record.delivered += len(chunk)
        return chunk
