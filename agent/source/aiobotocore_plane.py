"""The aiobotocore data plane: ranged GETs in the agent's event loop.

``tuning.concurrency`` workers take ranges from one shared iterator, so no
queue of the whole plan is ever built. Each worker holds at most
``io_block`` bytes before a positional write, which runs in a worker thread so
the event loop never blocks on the page cache: memory is about
``concurrency x io_block`` whatever the model size.

A range that breaks off (connection reset, short body, a 5xx botocore gave up
on, a GET slower than the low-speed limit) is retried with full-jitter
exponential backoff, asking only for the bytes after the last good one; after
``range_retries`` extra attempts the pull fails naming the object and the cause.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence

from agent._exceptions import SourceUnavailable
from agent.check.hashes import ChunkHasher
from agent.source.interface import ObjectSource, RangeReader, RangeReadError
from agent.source.pacing import backoff_delay
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
        failures = 0
        while cursor.missing:
            try:
                async with self._source.open_range(
                    bucket, obj.key, etag=obj.etag, start=cursor.offset, length=cursor.missing
                ) as reader:
                    await self._copy(flight, staging, reader, cursor, tuning)
                if cursor.missing:
                    raise RangeReadError(
                        f"s3://{bucket}/{obj.key} ended {cursor.missing} bytes short of the "
                        "requested range."
                    )
            except SourceUnavailable as exc:
                failures += 1
                if failures > tuning.range_retries:
                    raise SourceUnavailable(
                        f"Giving up on s3://{bucket}/{obj.key} after {failures} attempts: {exc}"
                    ) from exc
                delay = backoff_delay(failures)
                log.info("retrying %s in %.2fs: %s", obj.key, delay, exc)
                await asyncio.sleep(delay)
        staging.complete_range(
            obj.relative_path, byte_range.start, byte_range.length, cursor.hasher.digest()
        )

    async def _copy(
        self,
        flight: ProgressSink,
        staging: RangeSink,
        reader: RangeReader,
        cursor: RangeCursor,
        tuning: Tuning,
    ) -> None:
        """Copy a response body into the file, gathering ``io_block`` bytes per write.

        Raises RangeReadError when fewer than ``low_speed_limit`` bytes/s arrive
        over a ``request_timeout`` window (a stalled body included), so a slow
        connection is replaced instead of waited on.
        """
        block = tuning.io_block
        path = cursor.range.obj.relative_path
        pending: list[bytes] = []
        pending_bytes = 0
        loop = asyncio.get_running_loop()
        window = tuning.request_timeout
        needed = max(1, int(tuning.low_speed_limit * window))
        window_end = loop.time() + window
        window_bytes = 0

        async def flush() -> None:
            nonlocal pending, pending_bytes
            if pending:
                await write_in_thread(staging.write_at, path, pending, cursor.offset, cursor.hasher)
                cursor.written += pending_bytes
                flight.add_bytes(cursor.range.obj, pending_bytes)
                pending, pending_bytes = [], 0

        try:
            while True:
                data: bytes | None = None
                try:
                    async with asyncio.timeout_at(window_end):
                        data = await reader.read(block - pending_bytes)
                except TimeoutError:
                    pass  # judged below with the rest of the window
                if data is not None:
                    if not data:
                        break
                    pending.append(data)
                    pending_bytes += len(data)
                    window_bytes += len(data)
                    if pending_bytes >= block or len(pending) >= _MAX_IOVECS:
                        await flush()
                if loop.time() >= window_end:
                    if window_bytes < needed:
                        raise RangeReadError(
                            f"{cursor.range.obj.key} sent {window_bytes} bytes in {window:.1f} s, "
                            f"under the low-speed limit of {tuning.low_speed_limit} bytes/s."
                        )
                    window_end, window_bytes = loop.time() + window, 0
        except SourceUnavailable:
            # What arrived before the break is good; keep it so the retry asks for less.
            await flush()
            raise
        await flush()
