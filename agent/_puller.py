"""Pulls: a snapshot's objects into a staging directory, checked, then published.

One flight per snapshot key. Memory stays bounded whatever the model size:
``concurrency`` workers each hold at most ``io_block`` bytes before a
positional write, which runs in a worker thread so the event loop never blocks
on the page cache. Completed ranges are journaled, so a pull interrupted by a
crash or a shutdown resumes instead of starting over.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Self

from ._config import IntegritySettings, S3Settings
from ._exceptions import IntegrityError, PrewarmError, SourceUnavailable
from ._flight import Flight
from ._integrity import ChunkHasher
from ._s3 import ObjectSource, RangeReader
from ._snapshot import Snapshot, SourceObject, TierName
from ._staging import StagingFiles, open_staging, verify_before_publish
from ._store import CachedFile, CachedModel, Store

__all__ = ["Puller"]

log = logging.getLogger(__name__)

_MAX_IOVECS = 512  # well under IOV_MAX (1024 on Linux)
_BACKOFF_BASE_SECONDS = 0.2
_BACKOFF_CAP_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class _Range:
    obj: SourceObject
    start: int
    length: int


@dataclass(slots=True)
class _Cursor:
    range: _Range
    hasher: ChunkHasher
    written: int = 0

    @property
    def offset(self) -> int:
        return self.range.start + self.written

    @property
    def missing(self) -> int:
        return self.range.length - self.written


class Puller:
    """Owns every pull task; pulls outlive the requests that started them."""

    def __init__(
        self,
        store: Store,
        source: ObjectSource,
        settings: S3Settings,
        integrity: IntegritySettings | None = None,
    ) -> None:
        self._store = store
        self._source = source
        self._settings = settings
        self._integrity = integrity or IntegritySettings()
        self._flights: dict[str, Flight] = {}
        self._tasks: asyncio.TaskGroup | None = None

    async def __aenter__(self) -> Self:
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._tasks is not None
        for flight in list(self._flights.values()):
            flight.cancel()
        try:
            await self._tasks.__aexit__(exc_type, exc, tb)
        finally:
            # A flight cancelled before its task ever ran never settled itself.
            for flight in list(self._flights.values()):
                self._finish(flight, None, asyncio.CancelledError(), keep_staging=True)

    def flights(self) -> list[Flight]:
        return list(self._flights.values())

    def flight_for(self, key: str) -> Flight | None:
        return self._flights.get(key)

    def join(self, snapshot: Snapshot, tier: TierName) -> tuple[Flight, bool]:
        """The flight for this snapshot, started if needed; True if this call started it."""
        flight = self._flights.get(snapshot.key)
        if flight is not None:
            return flight, False
        assert self._tasks is not None, "Puller used outside its context"
        flight = Flight(snapshot, tier)
        self._flights[snapshot.key] = flight
        # Counted against the tier from now on, so concurrent placements see it.
        self._store.begin_staging(tier, snapshot.key, snapshot.total_bytes)
        flight._task = self._tasks.create_task(self._run(flight), name=f"pull-{snapshot.key}")
        return flight, True

    async def _run(self, flight: Flight) -> None:
        keep_staging = False
        try:
            model = await self._pull(flight)
        except asyncio.CancelledError as exc:
            keep_staging = True  # shutdown: the journal lets the next pull resume
            self._finish(flight, None, exc, keep_staging)
            raise
        except SourceUnavailable as exc:
            keep_staging = True  # S3 trouble is transient; resume once it is back
            log.warning("pull of %s stopped, resumable: %s", flight.snapshot.uri, exc)
            self._finish(flight, None, exc, keep_staging)
        except PrewarmError as exc:
            log.warning("pull of %s failed: %s", flight.snapshot.uri, exc)
            self._finish(flight, None, exc, keep_staging)
        except Exception as exc:
            log.exception("pull of %s failed unexpectedly", flight.snapshot.uri)
            self._finish(flight, None, exc, keep_staging)
        else:
            self._finish(flight, model, None, keep_staging)

    def _finish(
        self,
        flight: Flight,
        model: CachedModel | None,
        error: BaseException | None,
        keep_staging: bool,
    ) -> None:
        self._flights.pop(flight.key, None)
        self._store.end_staging(flight.key, keep=keep_staging)
        flight._settle(model, error)

    async def _pull(self, flight: Flight) -> CachedModel:
        snapshot = flight.snapshot
        chunk = int(self._settings.chunk_size)
        root = self._store.staging_path(flight.tier, snapshot.key)
        staging = await asyncio.to_thread(open_staging, root, snapshot, chunk, flight.tier)
        try:
            started = time.monotonic()
            for obj in snapshot.objects:
                done = sum(
                    min(chunk, obj.size - index * chunk)
                    for index in staging.digests.get(obj.relative_path, {})
                )
                if done or obj.size == 0:
                    flight.add_resumed(obj, done)
            if flight.resumed_bytes:
                log.info(
                    "resuming %s: %d of %d bytes already here",
                    snapshot.uri,
                    flight.resumed_bytes,
                    snapshot.total_bytes,
                )
            await self._download(flight, staging)
            downloaded = time.monotonic()
            flight.timings = replace(flight.timings, download=downloaded - started)
            flight.set_phase("verify")
            digests = await self._verify(flight, staging)
            verified = time.monotonic()
            flight.timings = replace(flight.timings, verify=verified - downloaded)
            flight.set_phase("publish")
            staging.close()
            model = await self._store.publish(root, _model_for(flight, digests, chunk))
            flight.timings = replace(flight.timings, publish=time.monotonic() - verified)
            flight.set_phase("done")
            log.info("published %s as %s", snapshot.uri, snapshot.key)
            return model
        finally:
            staging.close()

    async def _verify(self, flight: Flight, staging: StagingFiles) -> dict[str, str]:
        await asyncio.to_thread(
            verify_before_publish,
            staging,
            safetensors_headers=self._integrity.safetensors_headers,
            durable=flight.tier == "disk",
        )
        if self._integrity.s3_checksums:
            await self._check_s3_checksums(flight, staging)
        return staging.file_digests()

    async def _check_s3_checksums(self, flight: Flight, staging: StagingFiles) -> None:
        """Compare full-object checksums S3 holds with what landed on disk."""
        bucket = flight.snapshot.uri.bucket
        for obj in flight.snapshot.objects:
            if not obj.checksum_algorithm:
                continue
            checksum = await self._source.head_checksum(bucket, obj.key, etag=obj.etag)
            if checksum is None:
                continue
            matches = await asyncio.to_thread(
                checksum.matches, staging.data_dir / obj.relative_path
            )
            if matches is False:
                raise IntegrityError(
                    f"{obj.relative_path}: its {checksum.algorithm} checksum differs from the "
                    f"one S3 holds for s3://{bucket}/{obj.key}; not publishing. Pull it again; "
                    "if it repeats, the object or the network path is corrupting data.",
                    path=obj.relative_path,
                    check=f"s3-{checksum.algorithm.lower()}",
                )

    async def _download(self, flight: Flight, staging: StagingFiles) -> None:
        ranges = iter(_plan(flight.snapshot, staging))
        try:
            async with asyncio.TaskGroup() as workers:
                for _ in range(self._settings.concurrency):
                    workers.create_task(self._worker(flight, staging, ranges))
        except ExceptionGroup as group:
            # The first worker to fail cancels the rest; report its error, not the group.
            raise _root_cause(group) from None

    async def _worker(
        self, flight: Flight, staging: StagingFiles, ranges: Iterator[_Range]
    ) -> None:
        # A shared iterator hands out ranges lazily: no queue of the whole plan.
        for byte_range in ranges:
            await self._fetch(flight, staging, byte_range)

    async def _fetch(self, flight: Flight, staging: StagingFiles, byte_range: _Range) -> None:
        """Write one range at its offset, resuming after the last good byte on retry."""
        obj = byte_range.obj
        bucket = flight.snapshot.uri.bucket
        cursor = _Cursor(byte_range, ChunkHasher())
        failures = 0
        while cursor.missing:
            try:
                async with self._source.open_range(
                    bucket, obj.key, etag=obj.etag, start=cursor.offset, length=cursor.missing
                ) as reader:
                    await self._copy(flight, staging, reader, cursor)
                if cursor.missing:
                    raise SourceUnavailable(
                        f"s3://{bucket}/{obj.key} ended {cursor.missing} bytes short of the "
                        "requested range."
                    )
            except SourceUnavailable as exc:
                failures += 1
                if failures > self._settings.range_retries:
                    raise SourceUnavailable(
                        f"Giving up on s3://{bucket}/{obj.key} after {failures} attempts: {exc}"
                    ) from exc
                delay = min(_BACKOFF_CAP_SECONDS, _BACKOFF_BASE_SECONDS * 2 ** (failures - 1))
                log.info("retrying %s in %.2fs: %s", obj.key, delay, exc)
                await asyncio.sleep(random.uniform(0, delay))  # full jitter
        staging.complete_range(
            obj.relative_path, byte_range.start, byte_range.length, cursor.hasher.digest()
        )

    async def _copy(
        self, flight: Flight, staging: StagingFiles, reader: RangeReader, cursor: _Cursor
    ) -> None:
        """Copy a response body into the file, gathering ``io_block`` bytes per write."""
        block = int(self._settings.io_block)
        path = cursor.range.obj.relative_path
        pending: list[bytes] = []
        pending_bytes = 0

        async def flush() -> None:
            nonlocal pending, pending_bytes
            if pending:
                await asyncio.to_thread(
                    staging.write_at, path, pending, cursor.offset, cursor.hasher
                )
                cursor.written += pending_bytes
                flight.add_bytes(cursor.range.obj, pending_bytes)
                pending, pending_bytes = [], 0

        try:
            while data := await reader.read(block - pending_bytes):
                pending.append(data)
                pending_bytes += len(data)
                if pending_bytes >= block or len(pending) >= _MAX_IOVECS:
                    await flush()
        except SourceUnavailable:
            # What arrived before the break is good; keep it so the retry asks for less.
            await flush()
            raise
        await flush()


def _plan(snapshot: Snapshot, staging: StagingFiles) -> Iterator[_Range]:
    chunk = staging.chunk_size
    for obj in snapshot.objects:
        for start in range(0, obj.size, chunk):
            if not staging.is_done(obj.relative_path, start):
                yield _Range(obj, start, min(chunk, obj.size - start))


def _root_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        current = pending.pop(0)
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        else:
            leaves.append(current)
    return next((e for e in leaves if isinstance(e, PrewarmError)), leaves[0])


def _model_for(flight: Flight, digests: dict[str, str], chunk_size: int) -> CachedModel:
    snapshot = flight.snapshot
    return CachedModel(
        key=snapshot.key,
        uri=str(snapshot.uri),
        tier=flight.tier,
        path=Path(),  # the store sets the published path
        files=tuple(
            CachedFile(o.relative_path, o.size, o.etag, digests[o.relative_path])
            for o in snapshot.objects
        ),
        include=snapshot.include,
        exclude=snapshot.exclude,
        created=time.time(),
        hash_chunk_size=chunk_size,
    )
