"""An in-memory ObjectSource: S3's semantics without a server, with scripted failures.

ETags follow the content, and conditional puts refuse a stale ETag with
Conflict as S3 answers 412, so the compile caches and the puller can be
tested in-process against the same interface the daemon gives them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from dataclasses import dataclass, field

from agent._config import S3Settings
from agent._exceptions import Conflict, NotFound, SourceChanged
from agent._uri import ModelUri
from agent.source.checksums import S3Checksum
from agent.source.interface import (
    ListedObject,
    ObjectHead,
    ObjectTooLarge,
    RangeReadError,
    StoredObject,
)

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
    # The keys the gate holds; empty: every key.
    gate_keys: frozenset[str] = frozenset()
    # Checksums to report for keys (as S3 would from HEAD with ChecksumMode);
    # the listing then names their algorithm.
    checksums: dict[str, S3Checksum] = field(default_factory=dict)
    # Objects replaced (in the bucket being read) the moment any range is opened:
    # an upload racing a pull that has already listed the old snapshot.
    replace_on_read: dict[str, bytes] = field(default_factory=dict)
    # Each multipart upload: the key and its part sizes, in order.
    multipart_uploads: list[tuple[str, list[int]]] = field(default_factory=list)
    # The key of every object read whole (get_object), in order.
    whole_reads: list[str] = field(default_factory=list)
    # Objects per listing page (S3 sends up to 1,000), and the pages sent so far.
    page_size: int = 1000
    listing_pages: int = 0
    name: str = "memory"
    # Not S3: no presigned GETs, so pulls read it through the aiobotocore plane.
    s3_settings: S3Settings | None = None

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Seed an object (creating the bucket), as a test's setup would upload it."""
        self.objects.setdefault(bucket, {})[key] = data

    def etag(self, bucket: str, key: str) -> str:
        """The object's ETag: a hash of its bytes, so new bytes give a new ETag."""
        return f'"{hash(self.objects[bucket][key]) & 0xFFFFFFFF:08x}"'

    async def list_objects(self, uri: ModelUri) -> list[ListedObject]:
        """Every object under the URI's prefix, in key order."""
        return [item async for page in self.list_pages(uri) for item in page]

    async def list_pages(self, uri: ModelUri) -> AsyncGenerator[list[ListedObject], None]:
        """Pages of ``page_size`` objects, in key order; each counts in ``listing_pages``."""
        bucket = self._bucket(uri.bucket)
        keys = sorted(key for key in bucket if key.startswith(uri.prefix))
        for first in range(0, max(len(keys), 1), self.page_size):
            self.listing_pages += 1
            yield [
                ListedObject(
                    key=key,
                    size=len(bucket[key]),
                    etag=self.etag(uri.bucket, key),
                    checksum_algorithm=(
                        self.checksums[key].algorithm if key in self.checksums else ""
                    ),
                )
                for key in keys[first : first + self.page_size]
            ]

    @contextlib.asynccontextmanager
    async def open_range(
        self, bucket: str, key: str, *, etag: str, start: int, length: int
    ) -> AsyncIterator[_Reader]:
        """Read ``length`` bytes from ``start``, as scripted (pieces, cuts, the gate)."""
        self._bucket(bucket).update(self.replace_on_read)
        data = self._bucket(bucket).get(key)
        if data is None or self.etag(bucket, key) != etag:
            raise SourceChanged(f"{key} changed or disappeared")
        record = RangeRead(key, start, length)
        self.reads.append(record)
        failures = self.break_after.get(key, [])
        cut = failures.pop(0) if failures else None
        held = not self.gate_keys or key in self.gate_keys
        yield _Reader(
            data[start : start + length],
            record,
            piece=self.piece,
            cut=cut,
            gate=self.gate if held else None,
        )

    async def head_object(
        self, bucket: str, key: str, *, etag: str | None = None
    ) -> ObjectHead | None:
        """The object's size, ETag and checksum; None when it is absent and no ETag was expected."""
        data = self._bucket(bucket).get(key)
        if data is None and etag is None:
            return None
        if data is None or (etag is not None and self.etag(bucket, key) != etag):
            raise SourceChanged(f"{key} changed or disappeared")
        return ObjectHead(key, len(data), self.etag(bucket, key), self.checksums.get(key))

    async def get_object(self, bucket: str, key: str, *, max_bytes: int) -> StoredObject | None:
        """A small object's bytes; None when absent, ObjectTooLarge past ``max_bytes``."""
        self.whole_reads.append(key)
        data = self._bucket(bucket).get(key)
        if data is None:
            return None
        if len(data) > max_bytes:
            raise ObjectTooLarge(f"{key} holds more than {max_bytes} bytes", path=key, check="size")
        return StoredObject(data, self.etag(bucket, key))

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
        """Store an object, honouring If-Match and If-None-Match; returns the new ETag."""
        objects = self._bucket(bucket)
        if if_absent and key in objects:
            raise Conflict(f"{key} exists already (If-None-Match: *)")
        if if_match is not None and (key not in objects or self.etag(bucket, key) != if_match):
            raise Conflict(f"{key} no longer has the ETag {if_match}")
        objects[key] = bytes(body)
        return self.etag(bucket, key)

    async def delete_object(self, bucket: str, key: str) -> None:
        """Remove an object; an absent one is no error, as in S3."""
        self._bucket(bucket).pop(key, None)

    async def put_object_multipart(
        self,
        bucket: str,
        key: str,
        parts: AsyncIterable[bytes],
        *,
        content_type: str = "application/octet-stream",
    ) -> str:
        """Store an object sent in parts, as ``put_object`` does; returns the new ETag."""
        objects = self._bucket(bucket)
        received = [bytes(part) async for part in parts]
        self.multipart_uploads.append((key, [len(part) for part in received]))
        objects[key] = b"".join(received)
        return self.etag(bucket, key)

    def _bucket(self, name: str) -> dict[str, bytes]:
        if name not in self.objects:
            raise NotFound(f"Bucket {name!r} does not exist.")
        return self.objects[name]


class _Reader:
    """One range's bytes, ``piece`` at a time, cut at ``cut``, held at ``gate`` after the first."""

    def __init__(
        self,
        data: bytes,
        record: RangeRead,
        *,
        piece: int,
        cut: int | None,
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
