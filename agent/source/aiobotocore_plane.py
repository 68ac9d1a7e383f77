"""The aiobotocore data plane: ranged GETs in the agent's event loop.

``tuning.concurrency`` workers take ranges from one shared iterator, so no
queue of the whole plan is ever built. Each worker holds at most
``io_block`` bytes before a positional write, which runs in a worker thread so
the event loop never blocks on the page cache: memory is about
``concurrency x io_block`` whatever the model size.

A range that breaks off (connection reset, short body, a 5xx botocore gave up
on, a GET slower than the low-speed limit) is retried with full-jitter
exponential backoff, asking only for the bytes after the last good one; after
``retries`` extra attempts the pull fails naming the object and the cause.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence

from agent._exceptions import SourceUnavailable
from agent.check.hashes import ChunkHasher
from agent.source.interface import ObjectSource, RangeReader, RangeReadError
from agent.source.pacing import Attempts
from agent.source.plane import (
    ByteRange,
    ProgressSink,
    RangeCursor,
    RangeSink,
    root_cause,
    write_in_thread,
)
from agent.source.tuning import Tuning

__all__ = ["AiobotocorePlane"]

log = logging.getLogger(__name__)

_MAX_IOVECS = 512  # well under IOV_MAX (1024 on Linux)


class AiobotocorePlane:
    """Ranged GETs through the agent's pooled S3 client."""

    name = "aiobotocore"

    def __init__(self, source: ObjectSource) -> None:
        self._source = source

    async def download(
        self,
        flight: ProgressSink,
        staging: RangeSink,
        ranges: Sequence[ByteRange],
        tuning: Tuning,
    ) -> None:
        """Write and journal every range with ``concurrency`` workers; raise the first failure."""
        shared = iter(ranges)
        try:
            async with asyncio.TaskGroup() as workers:
                for _ in range(min(tuning.concurrency, len(ranges))):
                    workers.create_task(self._worker(flight, staging, shared, tuning))
        except ExceptionGroup as group:
            # The first worker to fail cancels the rest; report its error, not the group.
            raise root_cause(group) from None

    async def _worker(
        self, flight: ProgressSink, staging: RangeSink, ranges: Iterator[ByteRange], tuning: Tuning
    ) -> None:
        # A shared iterator hands out ranges lazily: no queue of the whole plan.
        for byte_range in ranges:
            await self._fetch(flight, staging, byte_range, tuning)

    async def _fetch(
        self, flight: ProgressSink, staging: RangeSink, byte_range: ByteRange, tuning: Tuning
    ) -> None:
        """Write one range at its offset, resuming after the last good byte on retry."""
        obj = byte_range.obj
        bucket = flight.snapshot.uri.bucket
        cursor = RangeCursor(byte_range, ChunkHasher())
        attempts = Attempts(tuning.range_retries)
        while cursor.missing:
            try:
                async with self._source.open_range(
                    bucket, obj.key, etag=obj.etag, start=cursor.offset, length=cursor.missing
                ) as reader:
                    await self._copy(reader, _Writes(flight, staging, cursor), tuning)
                if cursor.missing:
                    raise RangeReadError(
                        f"s3://{bucket}/{obj.key} ended {cursor.missing} bytes short of the "
                        "requested range."
                    )
            except SourceUnavailable as exc:
                delay = attempts.next_delay()
                if delay is None:
                    raise SourceUnavailable(
                        f"Giving up on s3://{bucket}/{obj.key} after {attempts.failures} "
                        f"attempts: {exc}"
                    ) from exc
                log.info("retrying %s in %.2fs: %s", obj.key, delay, exc)
                await asyncio.sleep(delay)
        staging.complete_range(
            obj.relative_path, byte_range.start, byte_range.length, cursor.hasher.digest()
        )

    async def _copy(self, reader: RangeReader, written: _Writes, tuning: Tuning) -> None:
        """Copy a response body into the file, gathering ``io_block`` bytes per write.

        Raises RangeReadError when fewer than ``low_speed_limit`` bytes/s arrive
        over a ``low_speed_seconds`` window (a stalled body included), so a slow
        connection is replaced instead of waited on.
        """
        window = _SpeedWindow(tuning, written.cursor.range.obj.key)
        try:
            while True:
                data: bytes | None = None
                try:
                    async with asyncio.timeout_at(window.end):
                        data = await reader.read(tuning.io_block - written.pending_bytes)
                except TimeoutError:
                    pass  # judged below with the rest of the window
                if data is not None:
                    if not data:
                        break
                    window.bytes += len(data)
                    await written.add(data, tuning.io_block)
                window.check()
        except SourceUnavailable:
            # What arrived before the break is good; keep it so the retry asks for less.
            await written.flush()
            raise
        await written.flush()


class _Writes:
    """Body bytes gathered for one positional write at a range's cursor, then written."""

    def __init__(self, flight: ProgressSink, staging: RangeSink, cursor: RangeCursor) -> None:
        self._flight = flight
        self._staging = staging
        self.cursor = cursor
        self._pending: list[bytes] = []
        self.pending_bytes = 0

    async def add(self, data: bytes, block: int) -> None:
        """Gather ``data``; write what is gathered once it fills ``block`` bytes."""
        self._pending.append(data)
        self.pending_bytes += len(data)
        if self.pending_bytes >= block or len(self._pending) >= _MAX_IOVECS:
            await self.flush()

    async def flush(self) -> None:
        """Write what is gathered at the cursor (in a worker thread) and report it."""
        if not self._pending:
            return
        cursor = self.cursor
        path = cursor.range.obj.relative_path
        await write_in_thread(
            self._staging.write_at, path, self._pending, cursor.offset, cursor.hasher
        )
        cursor.written += self.pending_bytes
        self._flight.add_bytes(cursor.range.obj, self.pending_bytes)
        self._pending, self.pending_bytes = [], 0


class _SpeedWindow:
    """The low-speed check: ``low_speed_limit`` bytes/s over each ``low_speed_seconds``."""

    def __init__(self, tuning: Tuning, key: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._length = tuning.low_speed_seconds
        self._limit = tuning.low_speed_limit
        self._needed = max(1, int(tuning.low_speed_limit * self._length))
        self._key = key
        self.end = self._loop.time() + self._length
        self.bytes = 0

    def check(self) -> None:
        """RangeReadError when a window ended under the limit; else start the next one."""
        if self._loop.time() < self.end:
            return
        if self.bytes < self._needed:
            raise RangeReadError(
                f"{self._key} sent {self.bytes} bytes in {self._length:.1f} s, "
                f"under the low-speed limit of {self._limit} bytes/s."
            )
        self.end, self.bytes = self._loop.time() + self._length, 0
