"""Pulls: a snapshot's objects into a staging directory, checked, then published.

One flight per snapshot key. Each pull gets a ``Tuning`` (concurrency, chunk
size, timeouts: agent.source.tuning) and a data plane, which the registry in
agent.source.plane_registry picks by name (``auto`` included) from the config
and the request that started it; requests that join a flight get that flight's.
Completed ranges are journaled, so a pull interrupted by a crash or a shutdown
resumes instead of starting over, as long as it asks for the same chunk size.

A flight may pull through a source of its own (a requester's credentials,
``join(..., source=...)``): it is opened when the flight's task starts and
closed when it ends, so no client outlives its pull. The processes plane
presigns its GETs with it and the aiobotocore plane reads through it (the
registry's ``through``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Self

from agent._config import IntegritySettings, S3Settings
from agent._exceptions import PrewarmError, SourceUnavailable
from agent._snapshot import Snapshot
from agent._vocabulary import DataPlaneName, PullOptions, TierName
from agent.check.hashes import check_object_checksum
from agent.check.signatures import SignatureRule
from agent.pull.flight import Flight
from agent.pull.staging import StagingFiles, open_staging, verify_before_publish
from agent.source.interface import ObjectSource
from agent.source.plane import DataPlane, plan_ranges, write_in_thread
from agent.source.plane_registry import DataPlanes
from agent.source.process_plane import Resolver
from agent.source.tuning import Tuning, node_gbps, tune
from agent.store.catalog import Store
from agent.store.records import CachedFile, CachedModel

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
        *,
        resolve: Resolver | None = None,
        signatures: tuple[SignatureRule, ...] = (),
    ) -> None:
        """``resolve``: how the S3 data plane learns the endpoint's addresses (DNS when None);
        ``signatures``: which sources' models must carry a verified signature."""
        self._store = store
        self._source = source
        self._settings = settings
        self._integrity = integrity or IntegritySettings()
        self._signatures = signatures
        self._flights: dict[str, Flight] = {}
        self._pulls: dict[str, tuple[DataPlane, Tuning, ScopedSource | None]] = {}
        self._tasks: asyncio.TaskGroup | None = None
        self._gbps = node_gbps(settings)
        self._planes = DataPlanes(source, settings, gbps=self._gbps, resolve=resolve)

    async def __aenter__(self) -> Self:
        """Start the data planes (workers, clients) and the task group pulls run in."""
        await self._planes.__aenter__()
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Cancel every pull, wait for them, close the data planes."""
        assert self._tasks is not None
        for flight in list(self._flights.values()):
            flight.cancel()
        try:
            await self._tasks.__aexit__(exc_type, exc, tb)
        finally:
            await self._planes.__aexit__(exc_type, exc, tb)
            # A flight cancelled before its task ever ran never settled itself.
            for flight in list(self._flights.values()):
                self._abandon(flight)

    @property
    def data_plane(self) -> str:
        """The data plane a request that names none gets."""
        return self._planes.default.name

    def plane(self, name: DataPlaneName) -> DataPlane:
        """The data plane a request naming ``name`` gets (InvalidRequest if there is none)."""
        return self._planes.choose(name)

    def flights(self) -> list[Flight]:
        """The pulls in flight now."""
        return list(self._flights.values())

    def flight_for(self, key: str) -> Flight | None:
        """The flight pulling ``key``, if one is."""
        return self._flights.get(key)

    def stop(self, flight: Flight, because: PrewarmError) -> None:
        """Cancel ``flight``'s pull on request: its waiters get ``because``, and what it
        journaled stays in staging for a later pull to resume (``stopped`` waits for that)."""
        flight.cancel(because)

    async def stopped(self, flight: Flight) -> int:
        """Wait until a stopped flight's pull has unwound, nothing writing to its staging any
        more; the bytes complete there, which a later pull of the snapshot resumes from."""
        await flight.ended()
        if self._flights.get(flight.key) is flight:
            self._abandon(flight)  # cancelled before its task ever ran
        leftover = self._store.leftover(flight.key)
        kept = leftover.kept_bytes if leftover is not None else 0
        log.info("pull of %s cancelled; %d bytes kept for a later pull", flight.snapshot.uri, kept)
        return kept

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
        plane = self._planes.choose(options.data_plane)
        tuning = tune(
            self._settings, snapshot.total_bytes, options, plane=plane.name, gbps=self._gbps
        )
        flight = Flight(snapshot, tier)
        self._flights[snapshot.key] = flight
        self._pulls[snapshot.key] = (plane, tuning, source)
        log.info(
            "pulling %s with %s: %s %d GETs in flight, %d-byte chunks%s",
            snapshot.uri,
            plane.name,
            "from" if tuning.adaptive else "pinned at",
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
            self._abandon(flight)  # shutdown or a cancel: the journal lets the next pull resume
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
        ended = self._store.end_staging(flight.key, keep=keep_staging, kept_bytes=flight.kept_bytes)
        await self._store.purge(ended)
        if model is not None:
            flight.succeed(model)
        else:
            assert error is not None
            flight.fail(error)

    def _abandon(self, flight: Flight) -> None:
        """Settle a cancelled flight at once, keeping its staging directory for resume."""
        self._flights.pop(flight.key, None)
        self._pulls.pop(flight.key, None)
        self._store.end_staging(flight.key, keep=True, kept_bytes=flight.kept_bytes)
        flight.abandon()

    async def _pull(self, flight: Flight) -> CachedModel:
        plane, tuning, scoped = self._pulls[flight.key]
        if scoped is None:
            return await self._pull_through(flight, plane, tuning, self._source)
        async with scoped as source:  # closed when this pull ends, however it ends
            return await self._pull_through(
                flight, self._planes.with_source(plane, source), tuning, source
            )

    async def _pull_through(
        self, flight: Flight, plane: DataPlane, tuning: Tuning, source: ObjectSource
    ) -> CachedModel:
        snapshot = flight.snapshot
        chunk = tuning.chunk_size
        root = self._store.staging_path(flight.tier, snapshot.key)
        staging = await _open_staging(root, snapshot, chunk, flight.tier)
        try:
            started = time.monotonic()
            for obj in snapshot.objects:
                done = staging.done_bytes(obj)
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
            verified_by = await self._check_signature(flight, staging)
            verified = time.monotonic()
            flight.timings = replace(flight.timings, verify=verified - downloaded)
            flight.set_phase("publish")
            staging.close()
            model = await self._store.publish(root, _model_for(flight, digests, chunk, verified_by))
            flight.timings = replace(flight.timings, publish=time.monotonic() - verified)
            flight.set_phase("done")
            log.info("published %s as %s", snapshot.uri, snapshot.key)
            return model
        finally:
            # What a later pull resumes from, if this one stopped short.
            flight.kept_bytes = staging.journaled_bytes()
            staging.close()

    async def _verify(
        self, flight: Flight, staging: StagingFiles, source: ObjectSource
    ) -> dict[str, str]:
        # Let it finish if the pull is cancelled meanwhile: it reads the staging descriptors.
        await write_in_thread(
            functools.partial(
                verify_before_publish,
                staging,
                safetensors_headers=self._integrity.safetensors_headers,
                durable=flight.tier == "disk",
            )
        )
        if self._integrity.s3_checksums:
            await self._check_s3_checksums(flight, staging, source)
        return staging.file_digests()

    async def _check_signature(self, flight: Flight, staging: StagingFiles) -> str:
        """Verify the model's signature where a rule asks for one; what verified it."""
        rule = next((r for r in self._signatures if r.applies_to(flight.snapshot.uri)), None)
        if rule is None:
            return ""
        return await asyncio.to_thread(rule.verify, staging.data_dir)

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

    def check(self, options: PullOptions) -> None:
        """InvalidRequest if a pull with these options could not start."""
        self._planes.choose(options.data_plane)


async def _open_staging(
    root: Path, snapshot: Snapshot, chunk_size: int, tier: TierName
) -> StagingFiles:
    """``open_staging`` in a worker thread; if the pull is cancelled meanwhile, the files it
    opened are closed once it returns, so a cancel never leaves a descriptor behind."""
    opening = asyncio.ensure_future(
        asyncio.to_thread(open_staging, root, snapshot, chunk_size, tier)
    )
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        await asyncio.wait([opening])
        if not opening.cancelled() and opening.exception() is None:
            opening.result().close()
        raise


def _model_for(
    flight: Flight, digests: dict[str, str], chunk_size: int, verified_by: str
) -> CachedModel:
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
        verified_by=verified_by,
    )
