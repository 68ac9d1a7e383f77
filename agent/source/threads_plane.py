"""The threads data plane: ranged GETs in worker threads, no bulk byte through the loop.

``tuning.concurrency`` worker threads take ranges from one shared iterator.
For each range a worker sends a ranged GET with ``If-Match: <etag>`` on
botocore's synchronous client (agent.source.sync_s3) and reads the body with
``http.client``'s ``readinto`` into its own reusable buffer (the kernel copies
socket data into it with the GIL released; no user-space copy), hashes each
step while it is in the CPU's cache (``ChunkHasher``) and writes it at its
offset in the staging file with ``pwrite``. It hands progress (once per
``io_block``) and the finished range to the event loop
(``call_soon_threadsafe``), which only journals and reports.

Retries keep the aiobotocore plane's semantics: botocore retries what fails
before a body (5xx, throttling, connection errors); a body that breaks off is
retried by the worker with full-jitter backoff, asking only for the bytes
after the last good one, at most ``range_retries`` extra times. A GET slower
than ``low_speed_limit`` over a ``request_timeout`` window (a silent one
included) is cut by a watchdog on the loop, which shuts its socket down; so is
every GET of a pull that is cancelled or has failed. A pull waits until no
worker is inside the section that writes (``PullState.hold``) before it
returns, so nothing writes into the staging files after the pull gave up; a
worker still waiting for S3's answer then never writes anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from agent._config import S3Settings
from agent._exceptions import PrewarmError, SourceUnavailable
from agent.check.hashes import ChunkHasher
from agent.source.interface import RangeReadError
from agent.source.pacing import Body, Stopped, backoff_delay, read_step
from agent.source.plane import ByteRange, ProgressSink, RangeCursor, RangeSink
from agent.source.sync_s3 import body_reader, body_socket, make_sync_client, translate
from agent.source.thread_pull import PullState, watch_speed
from agent.source.tuning import Tuning

__all__ = ["ThreadsPlane"]

log = logging.getLogger(__name__)


class ThreadsPlane:
    """Ranged GETs on botocore's synchronous client, each body written by its worker thread."""

    name = "threads"

    def __init__(self, settings: S3Settings) -> None:
        self._settings = settings
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._closed = False

    def prepare(self) -> None:
        """Build the S3 client now, in a thread of its own, rather than in the first pull.

        Building botocore's client loads the S3 service model (about 70 ms of CPU,
        measured): the agent's default plane pays that at start-up, off the loop.
        """
        threading.Thread(target=self._prepare, name="prewarm-threads-client", daemon=True).start()

    def _prepare(self) -> None:
        try:
            self._s3()
        except Exception as exc:  # the first pull builds it again and reports the error
            log.debug("could not build the threads plane's S3 client yet: %s", exc)

    def _s3(self) -> Any:
        with self._client_lock:
            if self._closed:
                raise RuntimeError("the threads data plane is closed")
            if self._client is None:
                self._client = make_sync_client(self._settings)
            return self._client

    def close(self) -> None:
        """Close the client's connection pool; nothing builds another afterwards."""
        with self._client_lock:
            self._closed = True
            if self._client is not None:
                self._client.close()
                self._client = None

    async def download(
        self,
        flight: ProgressSink,
        staging: RangeSink,
        ranges: Sequence[ByteRange],
        tuning: Tuning,
    ) -> None:
        """Fetch every range on worker threads; the loop journals and reports."""
        if not ranges:
            return
        client = await asyncio.to_thread(self._s3)
        pull = PullState(ranges, tuning, client=client, flight=flight, staging=staging)
        count = min(tuning.concurrency, len(ranges))
        workers = [_start_worker(pull.loop, self._work, pull, i) for i in range(count)]
        for worker in workers:
            worker.add_done_callback(_retrieve)
        watchdog = asyncio.create_task(watch_speed(pull))
        try:
            await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
            if pull.failure is None:
                pull.failure = _first_failure(workers)
        finally:
            pull.stop("the pull stopped" if pull.failure is None else "the pull failed")
            watchdog.cancel()
            # Bounded: every holder is reading a body whose socket was just shut down.
            waiting = asyncio.ensure_future(asyncio.to_thread(pull.wait_idle))
            try:
                await asyncio.shield(waiting)
            except asyncio.CancelledError:
                await asyncio.wait([waiting])
                raise
            finally:
                # Workers still waiting on S3's answer end on their own, writing nothing.
                pull.closed = True
        if pull.failure is not None:
            raise pull.failure

    def _work(self, pull: PullState) -> None:
        """One worker thread: fetch ranges until none is left or the pull stops."""
        tuning = pull.tuning
        step = read_step(tuning.low_speed_limit, tuning.request_timeout, tuning.io_block)
        buffer = memoryview(bytearray(step))
        try:
            while (byte_range := pull.next_range()) is not None:
                self._fetch(pull, byte_range, buffer)
        except Stopped:
            pass
        finally:
            buffer.release()

    def _fetch(self, pull: PullState, byte_range: ByteRange, buffer: memoryview) -> None:
        """Write one range, resuming after the last good byte on retry; then journal it."""
        obj = byte_range.obj
        bucket = pull.flight.snapshot.uri.bucket
        cursor = RangeCursor(byte_range, ChunkHasher())
        failures = 0
        while cursor.missing:
            try:
                _get(pull, cursor, buffer)
                if cursor.missing:
                    raise RangeReadError(
                        f"s3://{bucket}/{obj.key} ended {cursor.missing} bytes short of the "
                        "requested range."
                    )
            except SourceUnavailable as exc:
                failures += 1
                if failures > pull.tuning.range_retries:
                    raise SourceUnavailable(
                        f"Giving up on s3://{bucket}/{obj.key} after {failures} attempts: {exc}"
                    ) from exc
                delay = backoff_delay(failures)
                log.info("retrying %s in %.2fs: %s", obj.key, delay, exc)
                if pull.stopped.wait(delay):
                    raise Stopped from None
        pull.on_loop(
            pull.staging.complete_range,
            obj.relative_path,
            byte_range.start,
            byte_range.length,
            cursor.hasher.digest(),
        )


def _get(pull: PullState, cursor: RangeCursor, buffer: memoryview) -> None:
    """One GET for the rest of the range, advancing the cursor past every good byte."""
    obj = cursor.range.obj
    start = cursor.range.start + cursor.written
    wanted = cursor.missing
    where = f"s3://{pull.flight.snapshot.uri.bucket}/{obj.key} bytes {start}-{start + wanted - 1}"
    if pull.stopped.is_set():
        raise Stopped
    try:
        response = pull.client.get_object(
            Bucket=pull.flight.snapshot.uri.bucket,
            Key=obj.key,
            Range=f"bytes={start}-{start + wanted - 1}",
            IfMatch=obj.etag,
        )
    except Exception as exc:
        if pull.stopped.is_set():
            raise Stopped from None
        raise translate(exc, f"reading {where}", pull.endpoint) from exc
    body = response["Body"]
    raw = getattr(body, "_raw_stream", body)
    reusable = False
    try:
        if int(response.get("ContentLength", -1)) != wanted:
            raise RangeReadError(
                f"S3 answered {response.get('ContentLength')} bytes for {where}; "
                "expected the whole range."
            )
        tracked = Body(body_socket(body), time.monotonic())
        pull.enter(tracked)
        try:
            got = _read_body(pull, tracked, body, cursor, where=where, buffer=buffer)
        finally:
            pull.leave(tracked)
        if tracked.cut_reason is not None:
            if pull.stopped.is_set():
                raise Stopped
            if got < wanted:
                raise RangeReadError(f"{where}: {tracked.cut_reason}")
        reusable = got == wanted and tracked.cut_reason is None
    finally:
        if reusable:
            raw.release_conn()  # the whole body was read: the connection can serve again
        else:
            raw.close()


def _read_body(
    pull: PullState,
    tracked: Body,
    body: Any,
    cursor: RangeCursor,
    *,
    where: str,
    buffer: memoryview,
) -> int:
    """Read the body into the range's place in the staging file, one step at a time.

    Each step is read into the worker's own buffer (the kernel copies socket
    data into it with the GIL released), hashed while it is still in the CPU's
    cache, and written at its offset with ``pwrite``. Measured against reading
    straight into a shared mapping of the file, this costs about 10 % less CPU
    per GiB on tmpfs: a fresh mapping takes a page fault per 4 KiB page, dearer
    than the second copy, and needs every page reserved first (docs/data-planes.md).
    A full tier is then an ENOSPC from ``pwrite`` (NoSpace), never a SIGBUS.
    Progress goes to the loop once per ``io_block`` bytes, not per step.
    """
    obj = cursor.range.obj
    readinto = body_reader(body)
    before = cursor.written
    unreported = 0
    try:
        while cursor.missing:
            with buffer[: min(len(buffer), cursor.missing)] as target:
                try:
                    count = readinto(target)
                except Exception as exc:
                    if tracked.cut_reason is not None:
                        raise RangeReadError(f"{where}: {tracked.cut_reason}") from exc
                    raise translate(exc, f"reading {where}", pull.endpoint) from exc
                if not count:
                    break  # the body ended early: the caller judges why
                with target[:count] as piece:
                    # NoSpace (or another failure of the tier) is not S3's: raised as is.
                    pull.staging.write_at(
                        obj.relative_path,
                        [piece],
                        cursor.range.start + cursor.written,
                        cursor.hasher,
                    )
            cursor.written += count
            tracked.received += count
            unreported += count
            if unreported >= pull.tuning.io_block:
                pull.on_loop(pull.flight.add_bytes, obj, unreported)
                unreported = 0
    finally:
        if unreported:
            pull.on_loop(pull.flight.add_bytes, obj, unreported)
    return cursor.written - before


def _first_failure(workers: list[asyncio.Future[None]]) -> BaseException | None:
    """The error to report: the first prewarm error among the workers', else the first."""
    failures = [w.exception() for w in workers if w.done() and not w.cancelled()]
    errors = [e for e in failures if e is not None]
    return next((e for e in errors if isinstance(e, PrewarmError)), errors[0] if errors else None)


def _retrieve(worker: asyncio.Future[None]) -> None:
    """Mark a worker's error as seen: after the first failure, the rest are not news."""
    if not worker.cancelled():
        worker.exception()


def _start_worker(
    loop: asyncio.AbstractEventLoop, work: Callable[[PullState], None], pull: PullState, index: int
) -> asyncio.Future[None]:
    """Run ``work(pull)`` on a daemon thread; its outcome lands in a future of ``loop``.

    Not a ThreadPoolExecutor: the interpreter joins executor threads at exit, so
    a worker still waiting on a silent S3's answer after the pull gave up would
    hold a stopping daemon for a whole read timeout. Such a worker writes
    nothing (the pull is closed), so it may be abandoned at exit.
    """
    outcome: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if outcome.done():
            return
        if error is None:
            outcome.set_result(None)
        else:
            outcome.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            work(pull)
        except BaseException as exc:  # handed to the loop, re-raised there
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name=f"prewarm-get-{index}", daemon=True).start()
    return outcome
