"""Pulls: a snapshot's objects into a staging directory, checked, then published.

One flight per snapshot key. Each pull gets a ``Tuning`` (concurrency, chunk
size, timeouts: agent.source.tuning) and a data plane (agent.source.plane:
ranged GETs in worker threads or in the event loop, or the Run:ai Model
Streamer) from the config and the
request that started it; requests that join a flight get that flight's.
Completed ranges are journaled, so a pull interrupted by a crash or a shutdown
resumes instead of starting over, as long as it asks for the same chunk size.

A flight may pull through a source of its own (a requester's credentials,
``join(..., source=...)``): it is opened when the flight's task starts and
closed when it ends, so no client outlives its pull. The processes plane
presigns its GETs with it and the aiobotocore plane reads through it; the
threads plane and the streamer sign with the node's role, so they cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Self

from agent._config import ConfigError, IntegritySettings, S3Settings
from agent._exceptions import InvalidRequest, PrewarmError, SourceUnavailable
from agent._snapshot import Snapshot
from agent._vocabulary import DataPlaneName, PullOptions, TierName
from agent.check.hashes import check_object_checksum
from agent.pull.flight import Flight
from agent.pull.staging import StagingFiles, open_staging, verify_before_publish
from agent.source.interface import ObjectSource
from agent.source.plane import AUTO_DATA_PLANE, DataPlane, plan_ranges
from agent.source.process_plane import ProcessPlane, WorkerPool, processes_unavailable
from agent.source.ranged_plane import AiobotocorePlane
from agent.source.streamer_plane import StreamerPlane, load_streamer, streamer_unavailable
from agent.source.threads_plane import ThreadsPlane
from agent.source.tuning import Tuning, node_gbps, tune, worker_processes
from agent.store.records import CachedFile, CachedModel
from agent.store.store import Store

__all__ = ["Puller", "ScopedSource"]

log = logging.getLogger(__name__)

# A source of a flight's own, not yet opened (S3Source.with_credentials(...)).
ScopedSource = contextlib.AbstractAsyncContextManager[ObjectSource]


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
        self._pulls: dict[str, tuple[DataPlane, Tuning, ScopedSource | None]] = {}
        self._tasks: asyncio.TaskGroup | None = None
        self._ranged = AiobotocorePlane(source)
        self._streamer: StreamerPlane | None = None
        # Like the streamer, the threads plane speaks S3 itself (botocore's blocking client).
        self._threads = ThreadsPlane(source.s3_settings) if source.s3_settings else None
        self._gbps = node_gbps(settings)
        self._processes: ProcessPlane | None = None
        self._processes_missing = processes_unavailable(source, source.s3_settings)
        if self._processes_missing is None:
            pool = WorkerPool(worker_processes(settings, gbps=self._gbps))
            self._processes = ProcessPlane(settings, source, pool)  # type: ignore[arg-type]
        # The streamer talks to S3 itself, so it only stands in for a source that is S3.
        self._streamer_settings = source.s3_settings
        self._streamer_missing = (
            streamer_unavailable()
            if self._streamer_settings is not None
            else f"the source is {source.name}, not S3"
        )

    async def __aenter__(self) -> Self:
        if self._streamer_missing is None:
            if self._wants_streamer(self._settings.data_plane):
                # Import it now (it brings torch: seconds), not in the first pull.
                self._streamer_missing = await asyncio.to_thread(load_streamer)
            if self._streamer_missing is None and self._streamer_settings is not None:
                self._streamer = StreamerPlane(self._streamer_settings, self._source, self._ranged)
        if self._settings.data_plane == "streamer" and self._streamer is None:
            raise ConfigError(
                f"s3.data_plane is 'streamer' but {self._streamer_missing}. Install the "
                "streamer extra (pip install 'prewarm-agent[streamer]') or set data_plane = 'auto'."
            )
        if self._settings.data_plane == "processes" and self._processes is None:
            raise ConfigError(
                f"s3.data_plane is 'processes' but {self._processes_missing}; "
                "set data_plane = 'auto'."
            )
        if self._processes is not None and self.data_plane == "processes":
            # Start the workers now (about 0.1 s), not in the first cold pull.
            await self._processes.start()
        if self._settings.data_plane == "threads" and self._threads is None:
            raise ConfigError(
                f"s3.data_plane is 'threads' but the source is {self._source.name}, not S3; "
                "set data_plane = 'auto'."
            )
        if self._settings.data_plane == "auto" and self.data_plane != AUTO_DATA_PLANE:
            log.info(
                "data plane: %s (auto's %s is not available here: %s)",
                self.data_plane,
                AUTO_DATA_PLANE,
                self._streamer_missing if AUTO_DATA_PLANE == "streamer" else self._source.name,
            )
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
            if self._threads is not None:
                self._threads.close()
            if self._processes is not None:
                await self._processes.aclose()
            # A flight cancelled before its task ever ran never settled itself.
            for flight in list(self._flights.values()):
                self._abandon(flight)

    @property
    def data_plane(self) -> str:
        """The data plane a request that names none gets."""
        return self._plane(self._settings.data_plane).name

    def plane(self, name: DataPlaneName) -> DataPlane:
        """The data plane a request naming ``name`` gets (InvalidRequest if there is none)."""
        return self._plane(name)

    def flights(self) -> list[Flight]:
        return list(self._flights.values())

    def flight_for(self, key: str) -> Flight | None:
        return self._flights.get(key)

    def join(
        self,
        snapshot: Snapshot,
        tier: TierName,
        options: PullOptions | None = None,
        *,
        source: ScopedSource | None = None,
    ) -> tuple[Flight, bool]:
        """The flight for this snapshot, started if needed; True if this call started it.

        ``options`` and ``source`` (what to pull through instead of the
        agent's own source) apply only to a flight this call starts: a request
        that joins a pull in progress gets that pull's data plane, tuning and source.
        """
        flight = self._flights.get(snapshot.key)
        if flight is not None:
            return flight, False
        assert self._tasks is not None, "Puller used outside its context"
        options = options or PullOptions()
        plane = self._plane_for(options, scoped=source is not None)
        tuning = tune(
            self._settings, snapshot.total_bytes, options, plane=plane.name, gbps=self._gbps
        )
        flight = Flight(snapshot, tier)
        self._flights[snapshot.key] = flight
        self._pulls[snapshot.key] = (plane, tuning, source)
        log.info(
            "pulling %s with %s: concurrency %d, %d-byte chunks%s",
            snapshot.uri,
            plane.name,
            tuning.concurrency,
            tuning.chunk_size,
            ", with the requester's credentials" if source is not None else "",
        )
        # Counted against the tier from now on, so concurrent placements see it.
        superseded = self._store.begin_staging(tier, snapshot.key, snapshot.total_bytes)
        flight.start(self._tasks, self._run(flight, superseded))
        return flight, True

    async def _run(self, flight: Flight, superseded: list[Path]) -> None:
        keep_staging = False
        try:
            await self._store.purge(superseded)
            model = await self._pull(flight)
        except asyncio.CancelledError:
            self._abandon(flight)  # shutdown: the journal lets the next pull resume
            raise
        except SourceUnavailable as exc:
            keep_staging = True  # S3 trouble is transient; resume once it is back
            log.warning("pull of %s stopped, resumable: %s", flight.snapshot.uri, exc)
            await self._finish(flight, None, exc, keep_staging)
        except PrewarmError as exc:
            log.warning("pull of %s failed: %s", flight.snapshot.uri, exc)
            await self._finish(flight, None, exc, keep_staging)
        except Exception as exc:
            log.exception("pull of %s failed unexpectedly", flight.snapshot.uri)
            await self._finish(flight, None, exc, keep_staging)
        else:
            await self._finish(flight, model, None, keep_staging)

    async def _finish(
        self,
        flight: Flight,
        model: CachedModel | None,
        error: BaseException | None,
        keep_staging: bool,
    ) -> None:
        """Settle the flight once its staging directory is gone (or kept for resume)."""
        self._flights.pop(flight.key, None)
        self._pulls.pop(flight.key, None)
        # Deleted in a worker thread: the loop keeps serving while a big tree goes.
        await self._store.purge(self._store.end_staging(flight.key, keep=keep_staging))
        if model is not None:
            flight.succeed(model)
        else:
            assert error is not None
            flight.fail(error)

    def _abandon(self, flight: Flight) -> None:
        """Settle a cancelled flight at once, keeping its staging directory for resume."""
        self._flights.pop(flight.key, None)
        self._pulls.pop(flight.key, None)
        self._store.end_staging(flight.key, keep=True)
        flight.abandon()

    async def _pull(self, flight: Flight) -> CachedModel:
        plane, tuning, scoped = self._pulls[flight.key]
        if scoped is None:
            return await self._pull_through(flight, plane, tuning, self._source)
        async with scoped as source:  # closed when this pull ends, however it ends
            scoped_plane: DataPlane = (
                plane.with_source(source)  # type: ignore[arg-type]
                if isinstance(plane, ProcessPlane)
                else AiobotocorePlane(source)
            )
            return await self._pull_through(flight, scoped_plane, tuning, source)

    async def _pull_through(
        self, flight: Flight, plane: DataPlane, tuning: Tuning, source: ObjectSource
    ) -> CachedModel:
        snapshot = flight.snapshot
        chunk = tuning.chunk_size
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
            await plane.download(flight, staging, plan_ranges(snapshot, staging), tuning)
            downloaded = time.monotonic()
            flight.timings = replace(flight.timings, download=downloaded - started)
            flight.set_phase("verify")
            digests = await self._verify(flight, staging, source)
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

    async def _verify(
        self, flight: Flight, staging: StagingFiles, source: ObjectSource
    ) -> dict[str, str]:
        await asyncio.to_thread(
            verify_before_publish,
            staging,
            safetensors_headers=self._integrity.safetensors_headers,
            durable=flight.tier == "disk",
        )
        if self._integrity.s3_checksums:
            await self._check_s3_checksums(flight, staging, source)
        return staging.file_digests()

    async def _check_s3_checksums(
        self, flight: Flight, staging: StagingFiles, source: ObjectSource
    ) -> None:
        """Compare full-object checksums S3 holds with what landed on disk."""
        bucket = flight.snapshot.uri.bucket
        for obj in flight.snapshot.objects:
            if not obj.checksum_algorithm:
                continue
            head = await source.head_object(bucket, obj.key, etag=obj.etag)
            if head is None or head.checksum is None:
                continue
            await asyncio.to_thread(
                check_object_checksum,
                staging.data_dir / obj.relative_path,
                head.checksum,
                relative_path=obj.relative_path,
                origin=f"s3://{bucket}/{obj.key}",
            )

    def check(self, options: PullOptions, *, scoped: bool = False) -> None:
        """Raise InvalidRequest if a pull with these options (and a source of its own) could
        not start."""
        self._plane_for(options, scoped=scoped)

    def _plane_for(self, options: PullOptions, *, scoped: bool) -> DataPlane:
        if not scoped:
            return self._plane(options.data_plane or self._settings.data_plane)
        takes_a_source = {self._ranged.name, ProcessPlane.name}
        if options.data_plane not in (None, "auto", *takes_a_source):
            raise InvalidRequest(
                f"The {options.data_plane} data plane signs with the agent's own credentials, "
                "so it cannot pull with the requester's; ask for the processes or aiobotocore "
                "data plane, or auto."
            )
        plane = self._plane(options.data_plane or self._settings.data_plane)
        # The configured plane gives way when it cannot take a source.
        return plane if plane.name in takes_a_source else self._ranged

    def _wants_streamer(self, choice: DataPlaneName) -> bool:
        return choice == "streamer" or (choice == "auto" and AUTO_DATA_PLANE == "streamer")

    def _plane(self, choice: DataPlaneName) -> DataPlane:
        wanted = AUTO_DATA_PLANE if choice == "auto" else choice
        if wanted == "processes":
            if self._processes is not None:
                return self._processes
            if choice == "processes":
                raise InvalidRequest(
                    f"This agent has no processes data plane ({self._processes_missing}); "
                    "ask for the threads or aiobotocore data plane, or auto."
                )
            wanted = "threads"  # auto: the next best
        if wanted == "threads":
            if self._threads is not None:
                return self._threads
            if choice == "threads":
                raise InvalidRequest(
                    f"The threads data plane reads from S3 and this agent's source is "
                    f"{self._source.name}; ask for the aiobotocore data plane or auto."
                )
            return self._ranged  # auto: fall back cleanly
        if not self._wants_streamer(choice):
            return self._ranged
        if self._streamer is not None:
            return self._streamer
        if choice == "streamer":
            raise InvalidRequest(
                f"This agent has no streamer data plane ({self._streamer_missing}); ask for "
                "the aiobotocore data plane or auto."
            )
        return self._ranged  # auto: fall back cleanly


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
