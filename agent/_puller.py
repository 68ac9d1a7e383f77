"""Pulls: a snapshot's objects into a staging directory, then published. One flight per key.

Memory stays bounded whatever the model size: ``concurrency`` workers each
hold at most ``io_block`` bytes before a positional write, which runs in a
worker thread so the event loop never blocks on the page cache.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from ._config import S3Settings
from ._exceptions import NoSpace, PrewarmError, SourceUnavailable
from ._s3 import ObjectSource, RangeReader
from ._snapshot import Snapshot, SourceObject, TierName
from ._store import CachedFile, CachedModel, Store

__all__ = ["Flight", "PhaseName", "PullProgress", "PullTimings", "Puller"]

log = logging.getLogger(__name__)

PhaseName = Literal["resolve", "download", "verify", "publish", "done"]
_MAX_IOVECS = 512  # well under IOV_MAX (1024 on Linux)
_BACKOFF_BASE_SECONDS = 0.2
_BACKOFF_CAP_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class PullProgress:
    phase: PhaseName
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    key: str


@dataclass(frozen=True, slots=True)
class PullTimings:
    download: float = 0.0
    verify: float = 0.0
    publish: float = 0.0


@dataclass(frozen=True, slots=True)
class _Range:
    obj: SourceObject
    fd: int
    start: int
    length: int


class Flight:
    """One pull in progress; any number of requests may watch it."""

    def __init__(self, snapshot: Snapshot, tier: TierName) -> None:
        self.snapshot = snapshot
        self.tier = tier
        self.started = time.time()
        self.timings = PullTimings()
        self.waiters = 0
        self.progress = PullProgress(
            phase="download",
            bytes_done=0,
            bytes_total=snapshot.total_bytes,
            files_done=0,
            files_total=len(snapshot.objects),
            key=snapshot.key,
        )
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # The pull's outcome lives in a future, not in the task, so that a
        # failed pull never propagates into (and tears down) the task group.
        self._outcome: asyncio.Future[CachedModel] = asyncio.get_running_loop().create_future()
        self._outcome.add_done_callback(_mark_retrieved)
        self._bytes_left = {obj.relative_path: obj.size for obj in snapshot.objects}

    @property
    def key(self) -> str:
        return self.snapshot.key

    @property
    def done(self) -> bool:
        return self._outcome.done()

    async def result(self) -> CachedModel:
        """The published model; shielded so a departing watcher never cancels the pull."""
        return await asyncio.shield(self._outcome)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _settle(self, model: CachedModel | None, error: BaseException | None) -> None:
        if not self._outcome.done():
            if isinstance(error, asyncio.CancelledError):
                self._outcome.cancel()
            elif error is not None:
                self._outcome.set_exception(error)
            else:
                assert model is not None
                self._outcome.set_result(model)
        self._notify()

    async def watch(self, min_interval: float = 0.05) -> AsyncIterator[PullProgress]:
        """Yield progress until the pull ends, at most one event per ``min_interval``."""
        self.waiters += 1
        try:
            last_sent = 0.0
            while True:
                changed = self._changed
                now = time.monotonic()
                if now - last_sent >= min_interval or self.done:
                    last_sent = now
                    yield self.progress
                if self.done:
                    return
                await changed.wait()
        finally:
            self.waiters -= 1

    def set_phase(self, phase: PhaseName) -> None:
        self.progress = replace(self.progress, phase=phase)
        self._notify()

    def add_bytes(self, obj: SourceObject, count: int) -> None:
        left = self._bytes_left[obj.relative_path] - count
        self._bytes_left[obj.relative_path] = left
        files_done = self.progress.files_done + (1 if left == 0 else 0)
        self.progress = replace(
            self.progress, bytes_done=self.progress.bytes_done + count, files_done=files_done
        )
        self._notify()

    def _notify(self) -> None:
        # Wake everyone waiting on the current event and start a fresh one.
        self._changed.set()
        self._changed = asyncio.Event()


class Puller:
    """Owns every pull task; pulls outlive the requests that started them."""

    def __init__(self, store: Store, source: ObjectSource, settings: S3Settings) -> None:
        self._store = store
        self._source = source
        self._settings = settings
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
        await self._tasks.__aexit__(exc_type, exc, tb)

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
        flight._task = self._tasks.create_task(self._run(flight), name=f"pull-{snapshot.key}")
        return flight, True

    async def _run(self, flight: Flight) -> None:
        try:
            model = await self._pull(flight)
        except asyncio.CancelledError as exc:
            self._flights.pop(flight.key, None)
            flight._settle(None, exc)
            raise
        except PrewarmError as exc:
            log.warning("pull of %s failed: %s", flight.snapshot.uri, exc)
            self._flights.pop(flight.key, None)
            flight._settle(None, exc)
        except Exception as exc:
            log.exception("pull of %s failed unexpectedly", flight.snapshot.uri)
            self._flights.pop(flight.key, None)
            flight._settle(None, exc)
        else:
            self._flights.pop(flight.key, None)
            flight._settle(model, None)

    async def _pull(self, flight: Flight) -> CachedModel:
        snapshot = flight.snapshot
        staging = self._store.create_staging(flight.tier, snapshot.key)
        fds: dict[str, int] = {}
        try:
            _check_room(staging, snapshot, flight.tier)
            started = time.monotonic()
            fds = await asyncio.to_thread(_preallocate, staging, snapshot, flight.tier)
            for obj in snapshot.objects:
                if obj.size == 0:
                    flight.add_bytes(obj, 0)
            await self._download(flight, fds)
            downloaded = time.monotonic()
            flight.timings = replace(flight.timings, download=downloaded - started)
            flight.set_phase("verify")
            owned, fds = fds, {}  # _verify_and_close closes them, even when it raises
            await asyncio.to_thread(
                _verify_and_close, owned, snapshot, durable=flight.tier == "disk"
            )
            verified = time.monotonic()
            flight.timings = replace(flight.timings, verify=verified - downloaded)
            flight.set_phase("publish")
            model = await self._store.publish(staging, _model_for(snapshot, flight.tier, staging))
            flight.timings = replace(flight.timings, publish=time.monotonic() - verified)
            flight.set_phase("done")
            log.info("published %s as %s", snapshot.uri, snapshot.key)
            return model
        finally:
            for fd in fds.values():
                os.close(fd)
            if staging.exists():
                self._store.discard_staging(staging)

    async def _download(self, flight: Flight, fds: dict[str, int]) -> None:
        ranges = iter(_plan(flight.snapshot, fds, int(self._settings.chunk_size)))
        try:
            async with asyncio.TaskGroup() as workers:
                for _ in range(self._settings.concurrency):
                    workers.create_task(self._worker(flight, ranges))
        except ExceptionGroup as group:
            # The first worker to fail cancels the rest; report its error, not the group.
            raise _root_cause(group) from None

    async def _worker(self, flight: Flight, ranges: Iterator[_Range]) -> None:
        # A shared iterator hands out ranges lazily: no queue of the whole plan.
        for byte_range in ranges:
            await self._fetch(flight, byte_range)

    async def _fetch(self, flight: Flight, byte_range: _Range) -> None:
        """Write one range at its offset, resuming after the last good byte on retry."""
        obj = byte_range.obj
        bucket = flight.snapshot.uri.bucket
        cursor = _Cursor(byte_range)
        failures = 0
        while cursor.missing:
            try:
                async with self._source.open_range(
                    bucket, obj.key, etag=obj.etag, start=cursor.offset, length=cursor.missing
                ) as reader:
                    await self._copy(flight, reader, cursor)
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

    async def _copy(self, flight: Flight, reader: RangeReader, cursor: _Cursor) -> None:
        """Copy a response body into the file, gathering ``io_block`` bytes per write."""
        block = int(self._settings.io_block)
        pending: list[bytes] = []
        pending_bytes = 0

        async def flush() -> None:
            nonlocal pending, pending_bytes
            if pending:
                await asyncio.to_thread(_write_at, cursor.range.fd, pending, cursor.offset)
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


@dataclass(slots=True)
class _Cursor:
    range: _Range
    written: int = 0

    @property
    def offset(self) -> int:
        return self.range.start + self.written

    @property
    def missing(self) -> int:
        return self.range.length - self.written


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


def _mark_retrieved(outcome: asyncio.Future[CachedModel]) -> None:
    # A pull nobody waits for any more may fail; that is logged, not a leak warning.
    if not outcome.cancelled():
        outcome.exception()


def _plan(snapshot: Snapshot, fds: dict[str, int], chunk: int) -> Iterator[_Range]:
    for obj in snapshot.objects:
        for start in range(0, obj.size, chunk):
            yield _Range(obj, fds[obj.relative_path], start, min(chunk, obj.size - start))


def _check_room(staging: Path, snapshot: Snapshot, tier: TierName) -> None:
    stats = os.statvfs(staging)
    free = stats.f_bavail * stats.f_frsize
    if snapshot.total_bytes > free:
        raise NoSpace(
            f"Tier {tier} ({staging.parent.parent}) has {_gib(free)} free but "
            f"{snapshot.uri} needs {_gib(snapshot.total_bytes)}. Evict models "
            "(`prewarm ls`, `prewarm evict`) or request the other tier."
        )


def _gib(count: int) -> str:
    return f"{count / 1024**3:.2f} GiB"


def _preallocate(staging: Path, snapshot: Snapshot, tier: TierName) -> dict[str, int]:
    fds: dict[str, int] = {}
    try:
        for obj in snapshot.objects:
            path = staging / obj.relative_path
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            fds[obj.relative_path] = fd
            if obj.size:
                # Reserve the blocks now: a full tier fails here, not 90 % into the pull.
                os.posix_fallocate(fd, 0, obj.size)
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(
                f"Tier {tier} ran out of space reserving {snapshot.total_bytes} bytes for "
                f"{snapshot.uri}. Evict models or request the other tier."
            ) from exc
        raise
    return fds


def _write_at(fd: int, buffers: list[bytes], offset: int) -> None:
    total = sum(len(b) for b in buffers)
    done = os.pwritev(fd, buffers, offset)
    while done < total:  # pwritev may write less than asked; finish the tail
        tail = b"".join(buffers)[done:]
        done += os.pwrite(fd, tail, offset + done)


def _verify_and_close(fds: dict[str, int], snapshot: Snapshot, *, durable: bool) -> None:
    try:
        for obj in snapshot.objects:
            fd = fds[obj.relative_path]
            size = os.fstat(fd).st_size
            if size != obj.size:
                raise SourceUnavailable(
                    f"{obj.relative_path} has {size} bytes after the pull, the listing said "
                    f"{obj.size}; not publishing."
                )
            if durable:
                os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def _model_for(snapshot: Snapshot, tier: TierName, staging: Path) -> CachedModel:
    return CachedModel(
        key=snapshot.key,
        uri=str(snapshot.uri),
        tier=tier,
        path=staging,
        files=tuple(CachedFile(o.relative_path, o.size, o.etag) for o in snapshot.objects),
        include=snapshot.include,
        exclude=snapshot.exclude,
        created=time.time(),
    )
