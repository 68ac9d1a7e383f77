"""The Run:ai Model Streamer data plane: its C++ S3 client (AWS CRT) moves the bytes.

The streamer (``runai-model-streamer`` + ``runai-model-streamer-s3``, the
``streamer`` extra) is blocking C++ behind a Python iterator. One pull runs it
in a thread of its own, asking for the snapshot's files as chunks whose
boundaries are exactly the journal's ranges (``FileChunks`` with our offsets
and sizes), so every chunk it delivers is one range: the event loop hashes it,
writes it at its offset and journals it, exactly as the aiobotocore plane does.

Memory is bounded by the streamer's ring (``Tuning.streamer_memory``: two
ranges, or two blocks per stream) and its S3 clients' in-flight buffers
(RUNAI_STREAMER_S3_MAX_INFLIGHT_MIB). The ring is reused (``owned=False``), so
the thread hands each chunk to the event loop through a one-slot queue and
waits until it is written before asking the streamer for the next: the
streamer's C++ workers keep filling the other slots meanwhile, and stop when
the writer lags. Cancelling the pull stops the thread at its next chunk; the
GETs already under way finish first, then the streamer ends. The pull waits
for that at most two request timeouts: a thread stuck on a silent S3 (the CRT
retrying) is left to end on its own, holding nothing but its ring.

Retries. The CRT retries 5xx, SlowDown, resets and short reads itself, per GET
(measured through agent.testing.FaultProxy). A failure it gives up on fails the
whole stream and says only "File access error", so: the ranges delivered before
it stay journaled; if the stream made progress it is restarted for the rest
(after a full-jitter backoff, at most ``range_retries`` times); if it made none,
the remaining ranges go to the aiobotocore plane, whose own bounded per-range
retries either finish them or fail the pull naming the object and the cause.

The streamer never sends If-Match, so after it has delivered bytes of an object
the plane sends S3 a HEAD with If-Match for it: an object that changed during
the pull fails it with SourceChanged instead of publishing a mix.

Settings reach the streamer through the process environment, which it reads
when it starts (see ``streamer_environment``): each start sets them, under a
lock, so it sees its own pull's concurrency and block size. They stay in the
daemon's own environment, which nothing else there reads.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from agent._config import S3Settings
from agent._snapshot import SourceObject
from agent.check.hashes import ChunkHasher
from agent.source.interface import ObjectSource
from agent.source.pacing import backoff_delay
from agent.source.plane import ByteRange, DataPlane, ProgressSink, RangeSink, write_in_thread
from agent.source.tuning import Tuning, streamer_environment

__all__ = ["StreamerPlane", "load_streamer", "streamer_unavailable"]

log = logging.getLogger(__name__)

_MODULES = ("runai_model_streamer", "runai_model_streamer_s3")
# The streamer reads its settings from the environment when it starts.
_START_LOCK = threading.Lock()
# How long a stopped pull waits for its streamer thread, in request timeouts.
_JOIN_GRACE_REQUESTS = 2

T = TypeVar("T")


def streamer_unavailable() -> str | None:
    """Why the streamer plane cannot run here, or None; does not import it (torch is slow)."""
    for module in _MODULES:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError) as exc:
            return f"{module} cannot be imported: {exc}"
        if spec is None:
            return f"{module} is not installed"
    return None


def load_streamer() -> str | None:
    """Import the streamer now (blocking, seconds: it imports torch); None or why it failed."""
    reason = streamer_unavailable()
    if reason is not None:
        return reason
    try:
        for module in _MODULES:
            importlib.import_module(module)
        importlib.import_module("runai_model_streamer.file_streamer")
    except Exception as exc:  # a broken install must not take the agent down with it
        return f"importing the streamer failed: {type(exc).__name__}: {exc}"
    return None


class _StreamFailed(Exception):
    """The streamer gave up on the stream (after the CRT's own retries)."""


@dataclass(frozen=True, slots=True)
class _Chunk:
    byte_range: ByteRange
    data: memoryview


class _Handoff:
    """Chunks from the streamer's thread to the event loop, one at a time.

    The thread waits until the loop has written each chunk: the chunk is a view
    into the streamer's ring, which reuses that memory once the thread asks for
    the next chunk. So the ring is all the memory a pull holds, and the streamer
    keeps filling its other slots while a chunk is written.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._written = threading.Semaphore(0)
        self._stopped = threading.Event()
        self._queue: asyncio.Queue[_Chunk | None] = asyncio.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.finished: asyncio.Future[None] = loop.create_future()

    # -- the streamer's thread ---------------------------------------------------------------

    def put(self, chunk: _Chunk) -> bool:
        """Hand one chunk over and wait until it is written; False once the loop stopped."""
        if self._stopped.is_set() or not self._call(self._queue.put_nowait, chunk):
            return False
        self._written.acquire()
        return not self._stopped.is_set()

    def end(self, error: BaseException | None) -> None:
        self._call(self._finish, error)

    def _call(self, callback: Callable[[T], object], argument: T) -> bool:
        try:
            self._loop.call_soon_threadsafe(callback, argument)
        except RuntimeError:  # the loop is gone: nobody is listening
            return False
        return True

    # -- the event loop ------------------------------------------------------------------------

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        if self._queue.empty():
            self._queue.put_nowait(None)
        if not self.finished.done():
            self.finished.set_result(None)

    async def get(self) -> _Chunk | None:
        """The next chunk, or None once the stream ended."""
        return await self._queue.get()

    def written(self) -> None:
        self._written.release()

    def stop(self) -> None:
        self._stopped.set()
        self._written.release()  # wake a thread waiting for its chunk to be written


class StreamerPlane:
    """The Run:ai Model Streamer behind the DataPlane interface."""

    name = "streamer"

    def __init__(self, settings: S3Settings, source: ObjectSource, fallback: DataPlane) -> None:
        self._settings = settings
        self._source = source
        self._fallback = fallback

    async def download(
        self,
        flight: ProgressSink,
        staging: RangeSink,
        ranges: Sequence[ByteRange],
        tuning: Tuning,
    ) -> None:
        """Stream every range through the Run:ai streamer; restart it while it makes
        progress, else fetch what is left with the fallback plane."""
        pending = list(ranges)
        streamed: dict[str, SourceObject] = {}
        restarts = 0
        while pending:
            try:
                await self._stream(flight, staging, pending, tuning, streamed=streamed)
                break
            except _StreamFailed as exc:
                left = [r for r in pending if not staging.is_done(r.obj.relative_path, r.start)]
                progressed = len(left) < len(pending)
                pending = left
                if progressed and restarts < tuning.range_retries:
                    restarts += 1
                    delay = backoff_delay(restarts)
                    log.info(
                        "streamer failed (%s) after progress; restarting it for %d ranges in %.2fs",
                        exc,
                        len(pending),
                        delay,
                    )
                    await asyncio.sleep(delay)
                    continue
                log.warning(
                    "streamer failed on %s (%s); fetching its %d remaining ranges with %s",
                    flight.snapshot.uri,
                    exc,
                    len(pending),
                    self._fallback.name,
                )
                await self._fallback.download(flight, staging, pending, tuning)
                break
        await self._confirm_unchanged(flight, streamed.values())

    async def _stream(
        self,
        flight: ProgressSink,
        staging: RangeSink,
        ranges: list[ByteRange],
        tuning: Tuning,
        *,
        streamed: dict[str, SourceObject],
    ) -> None:
        handoff = _Handoff(asyncio.get_running_loop())
        files: dict[str, list[ByteRange]] = {}
        for byte_range in ranges:
            files.setdefault(byte_range.obj.key, []).append(byte_range)
        plan = list(files.values())
        bucket = flight.snapshot.uri.bucket
        thread = threading.Thread(
            target=self._produce,
            args=(bucket, plan, tuning, handoff),
            name=f"streamer-{flight.key[:12]}",
            daemon=True,
        )
        thread.start()
        try:
            await self._write(flight, staging, handoff, streamed)
        finally:
            handoff.stop()
            await self._join(handoff, thread, tuning)
        if handoff.error is not None:
            raise _StreamFailed(str(handoff.error)) from handoff.error

    async def _join(self, handoff: _Handoff, thread: threading.Thread, tuning: Tuning) -> None:
        """Wait for the streamer's thread to end, but not forever.

        A stopped thread ends at its next chunk. If it is stuck on a GET (S3 went
        silent), that can take the CRT's retries; past the grace it is left to end
        on its own: it holds only its own ring, never the staging files.
        """
        grace = _JOIN_GRACE_REQUESTS * tuning.request_timeout
        try:
            async with asyncio.timeout(grace):
                await asyncio.shield(handoff.finished)
        except TimeoutError:
            log.warning(
                "%s is still waiting on S3 after %.0f s; leaving it to end on its own",
                thread.name,
                grace,
            )

    async def _write(
        self,
        flight: ProgressSink,
        staging: RangeSink,
        handoff: _Handoff,
        streamed: dict[str, SourceObject],
    ) -> None:
        while (chunk := await handoff.get()) is not None:
            byte_range = chunk.byte_range
            path = byte_range.obj.relative_path
            if len(chunk.data) != byte_range.length:
                raise _StreamFailed(
                    f"the streamer delivered {len(chunk.data)} bytes for {byte_range.where}"
                )
            hasher = ChunkHasher()
            await write_in_thread(staging.write_at, path, [chunk.data], byte_range.start, hasher)
            del chunk  # the ring's memory: the streamer reuses it once told
            handoff.written()
            streamed[byte_range.obj.key] = byte_range.obj
            flight.add_bytes(byte_range.obj, byte_range.length)
            staging.complete_range(path, byte_range.start, byte_range.length, hasher.digest())

    def _produce(
        self, bucket: str, plan: list[list[ByteRange]], tuning: Tuning, handoff: _Handoff
    ) -> None:
        """The thread: run the streamer over ``plan`` and hand each chunk to the loop."""
        error: BaseException | None = None
        try:
            self._run_streamer(bucket, plan, tuning, handoff)
        except BaseException as exc:  # reported to the loop, which decides what it means
            error = exc
        finally:
            handoff.end(error)

    def _run_streamer(
        self, bucket: str, plan: list[list[ByteRange]], tuning: Tuning, handoff: _Handoff
    ) -> None:
        from runai_model_streamer import FileChunks, FileStreamer
        from runai_model_streamer.s3_utils.s3_utils import S3Credentials

        requests = [
            FileChunks(
                index,
                f"s3://{bucket}/{ranges[0].obj.key}",
                [r.start for r in ranges],
                [r.length for r in ranges],
            )
            for index, ranges in enumerate(plan)
        ]
        credentials = None
        if self._settings.endpoint_url or self._settings.region:
            credentials = S3Credentials(
                endpoint=self._settings.endpoint_url, region_name=self._settings.region
            )
        streamer: Any = FileStreamer()
        with _START_LOCK:
            os.environ.update(streamer_environment(self._settings, tuning))
            streamer.__enter__()
        delivered: Any = None
        try:
            # owned=False: one ring, reused; each chunk is written before the next is asked for.
            streamer.stream_files(
                requests, credentials, "cpu", memory_limit=tuning.streamer_memory, owned=False
            )
            delivered = streamer.get_chunks()
            for file_index, range_index, tensor in delivered:
                view = memoryview(tensor.numpy()).cast("B")
                chunk = _Chunk(plan[file_index][range_index], view)
                del tensor, view
                if not handoff.put(chunk):
                    return
        finally:
            # End the streamer first: it waits only for the GETs under way, where
            # closing the iterator first would wait for every range in the ring.
            streamer.__exit__(None, None, None)
            if delivered is not None:
                delivered.close()

    async def _confirm_unchanged(
        self, flight: ProgressSink, objects: Iterable[SourceObject]
    ) -> None:
        """HEAD each streamed object with If-Match: SourceChanged if it changed meanwhile."""
        bucket = flight.snapshot.uri.bucket
        for obj in objects:
            await self._source.head_object(bucket, obj.key, etag=obj.etag)
