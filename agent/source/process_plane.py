"""The processes data plane: ranged GETs in worker processes, each with its own interpreter lock.

The daemon keeps what a pull shares (the journal, progress, the single flight,
cancellation); ``worker_processes`` children (agent.source.range_worker) move
the bytes. For each range the daemon presigns a GET with botocore through the
pull's source (``If-Match`` signed in, so a requester-scoped pull carries the
requester's credentials), and hands a worker the GET and the staging file's
descriptor over a ``SOCK_SEQPACKET`` socket. The worker writes the range at
its offset and answers with progress and the range's digest, which the daemon
journals. The event loop sees a few small messages per range, never a byte of
the model.

A stopped pull (cancelled, failed, or shut down) is told to every worker that
had its jobs; each cuts the pull's bodies and answers ``stopped`` once nothing
of it can write any more. A worker that does not answer in time is killed, so
nothing writes into the staging files after the pull gave up. A worker that
dies mid-pull loses only its ranges: they go to another worker, within the
range retries, and a new worker takes its place for the next pull.

How many GETs run is the node's ``AdaptiveConcurrency`` (agent.source.concurrency),
shared by every pull on this plane: it grows while the rate grows and halves on
SlowDown, which workers report as they meet it. Each GET is sent to one of the
addresses the endpoint's name resolves to, in turn, as the AWS CRT spreads its
connections over S3's addresses; through a proxy, the proxy resolves.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import agent
from agent._config import S3Settings
from agent._exceptions import PrewarmError, SourceUnavailable
from agent._snapshot import SourceObject
from agent.source.concurrency import AdaptiveConcurrency
from agent.source.interface import RangeReadError
from agent.source.pacing import read_step
from agent.source.plane import ByteRange, ProgressSink, RangeSink
from agent.source.proxies import proxy_for
from agent.source.range_worker import (
    HEARTBEAT_SECONDS,
    MAX_MESSAGE,
    GetJob,
    decode,
    encode,
    job_message,
)
from agent.source.s3_errors import (
    answer_error,
    broken_off_error,
    silent_error,
    unreachable_error,
)
from agent.source.tuning import (
    Tuning,
    concurrency_ceiling,
    start_concurrency,
)

__all__ = [
    "Presigner",
    "ProcessPlane",
    "Resolver",
    "WorkerPool",
    "resolve_addresses",
    "stream_step",
    "worker_processes",
]

log = logging.getLogger(__name__)

_AWS_S3 = "https://s3.amazonaws.com"
# How long a presigned GET is valid: a URL that leaks (a worker's memory, a proxy's log)
# fetches the object until then. Signed again per object once half of it is gone, so
# each range's attempts (bounded by the first-byte and low-speed deadlines) fit easily.
PRESIGN_SECONDS = 900
# How long a worker may take to cut its bodies and say "stopped" before it is killed.
STOP_GRACE_SECONDS = 10.0
# How long a worker with ranges in hand may send nothing (it says "alive" every
# HEARTBEAT_SECONDS) before it is taken for frozen, killed, and its ranges handed on.
STALL_SECONDS = 15.0
_pull_ids = itertools.count(1)
_job_ids = itertools.count(1)


@runtime_checkable
class Presigner(Protocol):
    """What the plane needs of a source: a presigned GET, and how to verify S3's TLS."""

    async def presign_get(self, bucket: str, key: str, *, etag: str, expires_seconds: int) -> str:
        """A GET URL for ``key`` at ``etag``, valid ``expires_seconds``."""
        ...

    def transport(self) -> dict[str, object]:
        """How workers must verify S3's certificate to match the source."""
        ...


# Interpreter-lock seconds one worker process holds per GiB it moves over HTTPS
# (py-spy --gil, 2 GiB, 2 workers, this 2-core VM: 0.26-0.29; over HTTP 0.10-0.11;
# docs/data-planes.md), and the share of its lock a worker may keep busy at the node's
# target: the plane runs enough workers that none is the bottleneck.
GIL_SECONDS_PER_GIB = 0.25
GIL_SHARE = 0.5
# GETs (threads) one worker takes at most at the node's ceiling: beyond it, more workers.
GETS_PER_WORKER = 128
MIN_WORKER_PROCESSES = 2
MAX_WORKER_PROCESSES = 32
# Bytes of read buffers the node's GETs may hold in all, at its ceiling: each GET reads
# into one buffer of stream_step bytes (64 to 512 KiB).
STREAM_MEMORY = 128 * 1024**2
MIN_STEP = 64 * 1024
# The adaptive limit never goes under this many GETs in flight.
FLOOR_CONCURRENCY = 4
# How long the endpoint's addresses are used before its name is resolved again.
ADDRESSES_SECONDS = 60.0


def worker_processes(settings: S3Settings, *, gbps: float) -> int:
    """Worker processes: pinned, or enough for the node's bandwidth and its ceiling of GETs.

    Each worker may spend at most GIL_SHARE of its interpreter lock at the node's
    full rate (``rate (GiB/s) x GIL_SECONDS_PER_GIB / GIL_SHARE``) and hold at most
    GETS_PER_WORKER GETs at the ceiling.
    """
    if isinstance(settings.worker_processes, int):
        return settings.worker_processes
    rate = gbps / 8 * 10**9 / 1024**3
    by_lock = math.ceil(rate * GIL_SECONDS_PER_GIB / GIL_SHARE)
    by_gets = math.ceil(concurrency_ceiling(settings, gbps) / GETS_PER_WORKER)
    return max(MIN_WORKER_PROCESSES, min(max(by_lock, by_gets), MAX_WORKER_PROCESSES))


def stream_step(tuning: Tuning, ceiling: int) -> int:
    """Bytes per read (the buffer each GET holds): the low-speed rule's step, within the
    node's read-buffer memory at its ceiling of GETs."""
    step = read_step(tuning.low_speed_limit, tuning.low_speed_seconds, tuning.io_block)
    share = max(MIN_STEP, STREAM_MEMORY // max(1, ceiling) // 4096 * 4096)
    return min(step, share)


class WorkerLost(Exception):
    """A worker process exited or broke its socket with jobs in hand."""


@dataclass(eq=False)
class Worker:
    """One range-worker process, its control socket, and the jobs it holds."""

    index: int
    process: subprocess.Popen[bytes]
    sock: socket.socket
    jobs: set[int] = field(default_factory=set)
    stops: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    alive: bool = True
    # When the agent last heard from it (time.monotonic()).
    heard: float = field(default_factory=time.monotonic)
    # One sender at a time: a second one waiting for room would replace the first's writer.
    sending: asyncio.Lock = field(default_factory=asyncio.Lock)


class WorkerPool:
    """``size`` range-worker processes, started together and replaced when one dies."""

    def __init__(
        self,
        size: int,
        *,
        stop_grace: float = STOP_GRACE_SECONDS,
        stall_seconds: float = STALL_SECONDS,
    ) -> None:
        self.size = size
        self.stop_grace = stop_grace
        self.stall_seconds = stall_seconds
        self._stall_check: asyncio.TimerHandle | None = None
        self._workers: list[Worker] = []
        self._handlers: dict[int, _PullRun] = {}  # job id -> the pull it belongs to
        self._tls: dict[str, object] | None = None
        self._closed = False

    @property
    def workers(self) -> list[Worker]:
        """The workers alive now."""
        return [w for w in self._workers if w.alive]

    def pids(self) -> list[int]:
        """Process ids of the workers alive now."""
        return [w.process.pid for w in self.workers]

    async def start(self, tls: dict[str, object]) -> None:
        """Start the missing workers (all of them the first time)."""
        if self._closed:
            raise SourceUnavailable("The processes data plane is shut down.")
        if self._tls is None:
            self._tls = tls
        while len(self.workers) < self.size:
            await self._spawn(len(self._workers))
        if self._stall_check is None:
            self._check_stalls()

    async def _spawn(self, index: int) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # -P: "-m" would put the working directory first on the module path, and a
        # module planted there (argparse.py) would run as root in every worker.
        argv = [sys.executable, "-s", "-P", "-m", "agent.source.range_worker"]
        try:
            process = await asyncio.to_thread(
                subprocess.Popen,
                [*argv, "--control-fd", str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=_worker_environment(),
                cwd="/",
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        parent.setblocking(False)
        worker = Worker(index, process, parent)
        self._workers.append(worker)
        asyncio.get_running_loop().add_reader(parent.fileno(), self._on_readable, worker)
        await self._send(worker, {"tls": self._tls})
        log.debug("range worker %d started (pid %d)", index, process.pid)

    def least_busy(self) -> Worker:
        """The worker with the fewest jobs in hand."""
        return min(self.workers, key=lambda w: len(w.jobs))

    async def submit(self, worker: Worker, job: GetJob, fd: int, run: _PullRun) -> None:
        """Send ``job`` (and the file's descriptor) to ``worker``; ``run`` hears its answers."""
        self._handlers[job.id] = run
        if not worker.jobs:
            worker.heard = time.monotonic()  # its silence counts from its first range
        worker.jobs.add(job.id)
        try:
            await self._send(worker, job_message(job), fd)
        except OSError as exc:
            self._lose(worker, f"could not send it a job: {exc}")

    async def stop_pull(self, pull: int, workers: set[Worker]) -> None:
        """Stop ``pull`` on each worker; return once none of them can write for it again."""
        waits = []
        for worker in workers:
            if not worker.alive:
                continue
            future = asyncio.get_running_loop().create_future()
            worker.stops[pull] = future
            try:
                await self._send(worker, {"stop": pull})
            except OSError as exc:
                self._lose(worker, f"could not tell it to stop: {exc}")
            waits.append((worker, future))
        for worker, future in waits:
            try:
                await asyncio.wait_for(asyncio.shield(future), self.stop_grace)
            except TimeoutError:
                log.warning(
                    "range worker %d (pid %d) did not stop within %.1f s; killing it",
                    worker.index,
                    worker.process.pid,
                    self.stop_grace,
                )
                await self._kill(worker)
        await self._reap()

    async def aclose(self) -> None:
        """Close every worker's socket, end each worker at once and reap it.

        A worker that reads its closed socket exits there and then, whatever its
        threads are doing; but one still starting (its interpreter importing, as
        just after the daemon started) reads it only once ready, about a second
        later on a busy node. Nothing is left for a worker to finish (the pulls
        stopped first, and an exit on the closed socket ends a job unfinished too),
        so each is killed, as a lost one is, and none outlives this call.
        """
        self._closed = True
        if self._stall_check is not None:
            self._stall_check.cancel()
        for worker in self._workers:
            if worker.alive:
                self._detach(worker)
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()
        for worker in self._workers:
            await asyncio.to_thread(worker.process.wait)

    # -- messages ----------------------------------------------------------------------

    async def _send(self, worker: Worker, message: dict[str, Any], *fds: int) -> None:
        data = encode(message)
        loop = asyncio.get_running_loop()
        async with worker.sending:
            while True:
                if not worker.alive:
                    raise ConnectionResetError("the range worker is gone")
                try:
                    socket.send_fds(worker.sock, [data], list(fds))
                    return
                except BlockingIOError:
                    ready = loop.create_future()
                    loop.add_writer(worker.sock.fileno(), ready.set_result, None)
                    try:
                        await ready
                    finally:
                        loop.remove_writer(worker.sock.fileno())

    def _check_stalls(self) -> None:
        """Kill each worker that holds ranges and has been silent past ``stall_seconds``;
        its ranges go back to their pulls, as a dead worker's do. Runs every second."""
        now = time.monotonic()
        for worker in self.workers:
            silent = now - worker.heard
            if worker.jobs and silent > self.stall_seconds:
                self._lose(
                    worker,
                    f"it sent nothing for {silent:.0f} s with {len(worker.jobs)} ranges in "
                    "hand (stopped or stuck); killed, its ranges go to other workers",
                )
        loop = asyncio.get_running_loop()
        self._stall_check = loop.call_later(HEARTBEAT_SECONDS, self._check_stalls)

    def _on_readable(self, worker: Worker) -> None:
        while worker.alive:
            try:
                data, fds, _flags, _address = socket.recv_fds(worker.sock, MAX_MESSAGE, 1)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lose(worker, f"its socket failed: {exc}")
                return
            worker.heard = time.monotonic()
            for fd in fds:  # a worker sends none; never keep one
                os.close(fd)
            if not data:
                self._lose(worker, f"it exited ({_exit_status(worker.process)})")
                return
            try:
                self._dispatch(worker, decode(data))
            except (ValueError, TypeError, KeyError) as exc:
                self._lose(worker, f"it sent a message the agent cannot read: {exc}")
                return

    def _dispatch(self, worker: Worker, message: dict[str, Any]) -> None:
        if "done" in message or "failed" in message:
            self._job_ended(worker, message)
        elif "alive" not in message:  # "alive" says only that it was heard (noted)
            self._notice(worker, message)

    def _notice(self, worker: Worker, message: dict[str, Any]) -> None:
        """A worker's message other than a job's end: a stop settled, S3 throttling, bytes."""
        if "stopped" in message:
            future = worker.stops.pop(int(message["stopped"]), None)
            if future is not None and not future.done():
                future.set_result(None)
            return
        if "throttled" in message:
            throttled = self._handlers.get(int(message["throttled"]))
            if throttled is not None:
                throttled.on_throttled(str(message.get("code", "SlowDown"))[:64])
            return
        if "progress" in message:
            for job_text, count in dict(message["progress"]).items():
                progressing = self._handlers.get(int(job_text))
                if progressing is not None:  # else a job of a pull that ended
                    progressing.on_progress(int(job_text), int(count))
            return
        raise ValueError(f"unknown message {sorted(message)[:4]}")

    def _job_ended(self, worker: Worker, message: dict[str, Any]) -> None:
        job = int(message.get("done") or message.get("failed") or 0)
        run = self._handlers.get(job)
        if run is None:
            return  # a job of a pull that ended: nobody listens any more
        run.on_progress(job, int(message.get("bytes", 0)))
        worker.jobs.discard(job)
        del self._handlers[job]
        if "done" in message:
            run.on_done(job, bytes.fromhex(str(message["digest"])))
        else:
            run.on_failed(job, message)

    # -- losing workers ------------------------------------------------------------------

    def _lose(self, worker: Worker, why: str) -> None:
        """A worker is gone: its jobs go back to their pulls, and its stops are settled."""
        if not worker.alive:
            return
        log.warning("range worker %d (pid %d) lost: %s", worker.index, worker.process.pid, why)
        self._detach(worker)
        with contextlib.suppress(ProcessLookupError):
            worker.process.kill()  # it must never write again, whatever state it is in
        for job in sorted(worker.jobs):
            run = self._handlers.pop(job, None)
            if run is not None:
                run.on_lost(job, why)
        worker.jobs.clear()

    def _detach(self, worker: Worker) -> None:
        worker.alive = False
        with contextlib.suppress(ValueError, RuntimeError):
            asyncio.get_running_loop().remove_reader(worker.sock.fileno())
        worker.sock.close()
        for future in worker.stops.values():
            if not future.done():
                future.set_result(None)  # settled once the process is reaped
        worker.stops.clear()

    async def _kill(self, worker: Worker) -> None:
        self._lose(worker, "killed")
        with contextlib.suppress(ProcessLookupError):
            worker.process.send_signal(signal.SIGKILL)
        await asyncio.to_thread(worker.process.wait)

    async def _reap(self) -> None:
        """Wait for dead workers to be gone: a killed one writes nothing once reaped."""
        for worker in self._workers:
            if not worker.alive and worker.process.returncode is None:
                await asyncio.to_thread(worker.process.wait)
        self._workers = [w for w in self._workers if w.alive]


# How the plane learns the endpoint's addresses: (host, port) -> IP addresses.
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(slots=True)
class _Shared:
    """What every copy of the plane shares (``with_source`` makes copies): the workers,
    the node's limit of GETs in flight, the pulls running, the endpoint's addresses."""

    pool: WorkerPool
    limit: AdaptiveConcurrency
    ceiling: int
    resolve: Resolver
    runs: set[_PullRun] = field(default_factory=set)
    addresses: dict[str, tuple[list[str], float]] = field(default_factory=dict)
    turn: itertools.count[int] = field(default_factory=itertools.count)


class ProcessPlane:
    """Ranged GETs presigned by the daemon and sent by worker processes."""

    name = "processes"

    def __init__(
        self,
        settings: S3Settings,
        source: Presigner,
        *,
        gbps: float,
        resolve: Resolver | None = None,
        shared: _Shared | None = None,
    ) -> None:
        self._settings = settings
        self._source = source
        if shared is None:
            ceiling = concurrency_ceiling(settings, gbps)
            limit = AdaptiveConcurrency(
                initial=start_concurrency(settings, gbps),
                ceiling=ceiling,
                floor=min(FLOOR_CONCURRENCY, ceiling),
            )
            pool = WorkerPool(worker_processes(settings, gbps=gbps))
            shared = _Shared(pool, limit, ceiling, resolve or resolve_addresses)
        self._shared = shared
        self._gbps = gbps

    @property
    def pool(self) -> WorkerPool:
        """The worker processes this plane sends its GETs through."""
        return self._shared.pool

    @property
    def limit(self) -> AdaptiveConcurrency:
        """The node's limit of GETs in flight, shared by every pull on this plane."""
        return self._shared.limit

    def with_source(self, source: Presigner) -> ProcessPlane:
        """The same workers and limit, with GETs presigned by ``source`` (a requester's
        credentials)."""
        return ProcessPlane(self._settings, source, gbps=self._gbps, shared=self._shared)

    async def start(self) -> None:
        """Start the workers that are missing (all of them the first time)."""
        pool = self._shared.pool
        if len(pool.workers) < pool.size:
            await pool.start(self._source.transport())

    async def aclose(self) -> None:
        """Stop the worker processes."""
        await self._shared.pool.aclose()

    async def download(
        self,
        flight: ProgressSink,
        staging: RangeSink,
        ranges: Sequence[ByteRange],
        tuning: Tuning,
    ) -> None:
        """Presign and hand out every range to the workers; journal each as it is answered."""
        if not ranges:
            return
        await self.start()
        run = _PullRun(self, flight, staging, tuning)
        self._shared.runs.add(run)
        unsubscribe = self._shared.limit.subscribe(run.wake)
        try:
            await run.run(ranges)
        finally:
            unsubscribe()
            self._shared.runs.discard(run)
            run.release_all()
            # However the pull ends (cancelled included), nothing writes once this returns.
            stopping = asyncio.ensure_future(self.pool.stop_pull(run.pull, run.workers))
            try:
                await asyncio.shield(stopping)
            except asyncio.CancelledError:
                await asyncio.wait([stopping])
                raise

    def room_for(self, run: _PullRun) -> bool:
        """Whether ``run`` may start one more GET now.

        A pinned pull keeps its own number. An adaptive one takes from the node's
        limit, at most an even share of it while other pulls have ranges waiting.
        """
        if not run.tuning.adaptive:
            return run.in_flight < run.tuning.concurrency
        limit = self._shared.limit
        if limit.in_flight >= limit.limit:
            return False
        waiting = sum(1 for other in self._shared.runs if other.tuning.adaptive and other.waiting)
        return run.in_flight < math.ceil(limit.limit / max(1, waiting))

    def wake_all(self) -> None:
        """A GET ended somewhere on the node: every pull may have room now."""
        for run in self._shared.runs:
            run.wake()

    async def address_for(self, url: str) -> str:
        """The address the next GET of ``url`` connects to, in turn over every address its
        host resolves to; empty when the worker resolves (a proxy, an IP, no answer)."""
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        if not host or _is_ip(host) or proxy_for(url):
            return ""
        known = self._shared.addresses.get(host)
        now = time.monotonic()
        if known is None or now - known[1] > ADDRESSES_SECONDS:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            known = (await self._shared.resolve(host, port), now)
            self._shared.addresses[host] = known
        addresses = known[0]
        if not addresses:
            return ""
        return addresses[next(self._shared.turn) % len(addresses)]

    def job_for(self, run: _PullRun, byte_range: ByteRange, url: str, address: str) -> GetJob:
        """The job a worker runs for ``byte_range`` of ``run``, GETting ``url``."""
        tuning = run.tuning
        return GetJob(
            id=next(_job_ids),
            pull=run.pull,
            url=url,
            etag=byte_range.obj.etag,
            start=byte_range.start,
            length=byte_range.length,
            step=stream_step(tuning, self._shared.ceiling),
            retries=tuning.range_retries,
            window=tuning.low_speed_seconds,
            low_speed_limit=tuning.low_speed_limit,
            connect_timeout=self._settings.connect_timeout_seconds,
            read_timeout=self._settings.attempt_timeout_seconds,
            first_byte_timeout=self._settings.first_byte_timeout_seconds,
            direct=run.staging.bypass_page_cache,
            address=address,
        )

    async def presign(self, bucket: str, obj: SourceObject) -> str:
        """A presigned GET URL for ``obj`` at its ETag."""
        return await self._source.presign_get(
            bucket, obj.key, etag=obj.etag, expires_seconds=PRESIGN_SECONDS
        )


class _PullRun:
    """One pull on the processes plane: ranges in flight, and the first failure."""

    def __init__(
        self, plane: ProcessPlane, flight: ProgressSink, staging: RangeSink, tuning: Tuning
    ) -> None:
        self.plane = plane
        self.flight = flight
        self.staging = staging
        self.tuning = tuning
        self.pull = next(_pull_ids)
        self.workers: set[Worker] = set()
        self._pending: deque[ByteRange] = deque()
        self._jobs: dict[int, tuple[ByteRange, int, str]] = {}  # id -> range, attempt, url
        self._attempts: dict[ByteRange, int] = {}
        self._urls: dict[str, tuple[str, float]] = {}  # path -> presigned GET, when signed
        self._wake = asyncio.Event()
        self._failure: BaseException | None = None

    @property
    def in_flight(self) -> int:
        """GETs of this pull in the workers' hands now."""
        return len(self._jobs)

    @property
    def waiting(self) -> bool:
        """Whether this pull has ranges no worker has yet."""
        return bool(self._pending)

    def wake(self) -> None:
        """Look again for room: the node's limit moved, or a GET ended."""
        self._wake.set()

    async def run(self, ranges: Sequence[ByteRange]) -> None:
        self._pending.extend(ranges)
        bucket = self.flight.snapshot.uri.bucket
        while True:
            if self._failure is not None:
                raise self._failure
            while self._pending and self.plane.room_for(self):
                await self._submit(bucket, self._pending.popleft())
                if self._failure is not None:
                    raise self._failure
            if not self._pending and not self._jobs:
                return
            await self._wake.wait()
            self._wake.clear()

    def release_all(self) -> None:
        """The pull is over: its GETs still counted leave the node's limit."""
        for _ in self._jobs:
            self.plane.limit.release()
        self._jobs.clear()
        self.plane.wake_all()

    def _forget(self, job: int) -> tuple[ByteRange, int, str] | None:
        """The job's entry, no longer in flight (None for a job already forgotten)."""
        entry = self._jobs.pop(job, None)
        if entry is not None:
            self.plane.limit.release()
            self.plane.wake_all()
        return entry

    async def _url(self, bucket: str, obj: SourceObject) -> str:
        """A presigned GET of ``obj``, signed again once half its life is gone.

        One per object, not per range: signing costs botocore milliseconds of
        the event loop's time (its event hooks and endpoint rules).
        """
        signed = self._urls.get(obj.relative_path)
        now = time.monotonic()
        if signed is None or now - signed[1] > PRESIGN_SECONDS / 2:
            signed = (await self.plane.presign(bucket, obj), now)
            self._urls[obj.relative_path] = signed
        return signed[0]

    async def _submit(self, bucket: str, byte_range: ByteRange) -> None:
        url = await self._url(bucket, byte_range.obj)
        await self.plane.start()  # replaces a worker lost meanwhile
        worker = self.plane.pool.least_busy()
        address = await self.plane.address_for(url)
        job = self.plane.job_for(self, byte_range, url, address)
        self._jobs[job.id] = (byte_range, self._attempts.get(byte_range, 0), url)
        self.plane.limit.acquire()
        self.workers.add(worker)
        fd = self.staging.descriptor(byte_range.obj.relative_path)
        await self.plane.pool.submit(worker, job, fd, self)

    def on_progress(self, job: int, count: int) -> None:
        entry = self._jobs.get(job)
        if entry is not None:
            self.flight.add_bytes(entry[0].obj, count)
            self.plane.limit.add_bytes(count)

    def on_throttled(self, code: str) -> None:
        """A worker met S3's request-rate limit (it retries the GET itself)."""
        if self.tuning.adaptive:
            self.plane.limit.slow_down(code)

    def on_done(self, job: int, digest: bytes) -> None:
        entry = self._forget(job)
        if entry is None:
            return
        byte_range = entry[0]
        try:
            self.staging.complete_range(
                byte_range.obj.relative_path, byte_range.start, byte_range.length, digest
            )
        except Exception as exc:  # the journal could not be written: fail the pull
            self._fail(exc)
        self._wake.set()

    def on_failed(self, job: int, report: dict[str, Any]) -> None:
        entry = self._forget(job)
        if entry is not None:
            self._fail(self._error(entry[0], entry[2], report))
        self._wake.set()

    def on_lost(self, job: int, why: str) -> None:
        """A worker died holding this job: give the range to another, within the retries."""
        entry = self._forget(job)
        if entry is None:
            return
        byte_range, attempt, _url = entry
        if attempt + 1 > self.tuning.range_retries:
            where = f"s3://{self.flight.snapshot.uri.bucket}/{byte_range.obj.key}"
            self._fail(
                SourceUnavailable(
                    f"Giving up on {where} after {attempt + 1} attempts: "
                    f"the range worker reading it was lost ({why})."
                )
            )
        else:
            self._attempts[byte_range] = attempt + 1
            self._pending.appendleft(byte_range)
        self._wake.set()

    def _fail(self, error: BaseException) -> None:
        if self._failure is None or (
            not isinstance(self._failure, PrewarmError) and isinstance(error, PrewarmError)
        ):
            self._failure = error

    def _error(self, byte_range: ByteRange, url: str, report: dict[str, Any]) -> BaseException:
        """What a worker's failure report means, in the prewarm error tree."""
        bucket = self.flight.snapshot.uri.bucket
        where = f"s3://{bucket}/{byte_range.obj.key}"
        doing = (
            f"reading {where} bytes {byte_range.start}-{byte_range.start + byte_range.length - 1}"
        )
        parts = urllib.parse.urlsplit(url)
        endpoint = f"{parts.scheme}://{parts.netloc}"
        kind = report.get("kind")
        message = str(report.get("message", ""))
        error: BaseException
        if kind == "write":
            errno = int(report.get("errno", 0))
            return self.staging.write_failed(OSError(errno, message or os.strerror(errno)))
        if kind == "answer":
            status, code = int(report.get("status", 0)), str(report.get("code", ""))
            error = answer_error(status, code, doing, endpoint=endpoint, bucket=bucket)
            if not isinstance(error, RangeReadError):
                return error  # final: denied, changed, refused
        elif kind == "silent":
            return silent_error(endpoint, doing, float(report.get("waited", 0.0)))
        elif kind == "internal":
            return SourceUnavailable(f"The range worker reading {where} failed: {message}")
        elif kind == "connect":
            error = unreachable_error(doing, endpoint=endpoint, cause=message)
        else:
            error = broken_off_error(doing, cause=message)
        attempts = int(report.get("attempts", 1))
        return SourceUnavailable(f"Giving up on {where} after {attempts} attempts: {error}")


def _worker_environment() -> dict[str, str]:
    """A worker needs no credentials and no settings: only where to find the package."""
    package_parent = str(Path(agent.__file__).resolve().parent.parent)
    return {"PATH": os.defpath, "PYTHONPATH": package_parent}


def _exit_status(process: subprocess.Popen[bytes]) -> str:
    code = process.poll()
    if code is None:
        return "closed its socket"
    return f"signal {-code}" if code < 0 else f"status {code}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to now, in the resolver's order; [] when it does not."""
    loop = asyncio.get_running_loop()
    try:
        answers = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.debug("could not resolve %s (the workers will try): %s", host, exc)
        return []
    unique: dict[str, None] = {}
    for _family, _type, _proto, _name, address in answers:
        unique.setdefault(str(address[0]), None)
    return list(unique)
