"""The manifest directory, watched: what it lists is pulled, pinned and unpinned.

Every ``*.toml`` file in ``manifests.directory`` (``/etc/prewarm/models.d``)
lists models (the format is in agent.prefetch.schema and docs/manifests.md).
The directory is read when the agent starts and watched (watchfiles) while it
runs. An entry that appears is pulled in the background through the same path
as a pod's request (``AgentService.ensure``: single flight, placement,
eviction, metrics), at most ``manifests.concurrency`` at a time. A pinned
entry's snapshot is pinned once cached; when the entry goes away (or loses
``pin``), the snapshot the manifest pinned is unpinned. Pins the manifests
made are remembered in a small state file (agent.prefetch.pins), so an entry
removed while the agent was down is unpinned at the next start, and a pin
someone made by hand is never undone by a manifest.

A file that cannot be read, is not valid TOML, or does not follow the schema is
reported in the log with its path and line and ignored; a file that was good
and turns bad keeps its last good entries until it is fixed or removed, so a
half-saved edit never unpins anything. Nothing here stops the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from watchfiles import awatch

from agent._config import ManifestSettings
from agent._exceptions import NotFound, PrewarmError, SourceChanged, SourceUnavailable
from agent._uri import parse_uri
from agent.obs.logs import bind_request
from agent.obs.metrics import MANIFEST_ERRORS
from agent.prefetch.pins import load_pins, save_pins
from agent.prefetch.schema import (
    CompileSpec,
    Identity,
    ManifestEntry,
    ManifestError,
    read_manifest,
)
from agent.service.access import Requester
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult

# CompileSpec is part of CompileCacheHook's signature, so it is offered here too.
__all__ = ["CompileCacheHook", "ManifestWatcher"]

log = logging.getLogger(__name__)

# Transient S3 trouble at boot should not leave a node without its models:
# retry those pulls with capped exponential backoff until the entry changes.
_RETRY_BASE_SECONDS = 5.0
_RETRY_CAP_SECONDS = 300.0

# Called with an entry's compile-cache key parts and the model's snapshot key
# once the model is cached; restores (or creates) that compile cache.
CompileCacheHook = Callable[[CompileSpec, str], Awaitable[object]]


class ManifestWatcher:
    """Reads, watches and acts on the manifest directory; owns every task it starts.

    ``async with ManifestWatcher(service, settings, state_path):`` reads the
    directory, starts the pulls it asks for and watches it until the block
    exits; exiting stops the watch and cancels prefetches that are still
    running (a pull they started goes on for anyone else waiting on it, and is
    resumable after a shutdown). ``compile_cache`` restores compile caches
    named by ``[model.compile]`` tables; without it those tables are only
    validated.
    """

    def __init__(
        self,
        service: AgentService,
        settings: ManifestSettings,
        state_path: Path,
        *,
        compile_cache: CompileCacheHook | None = None,
        requester: Requester | None = None,
    ) -> None:
        """``state_path`` keeps the pins manifests made, so an entry's removal unpins only those."""
        self._service = service
        # Who the prefetches ask as: the node (its sources, its limits) in the daemon.
        self._requester = requester
        self._directory = settings.directory
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._state_path = state_path
        self._compile_cache = compile_cache
        self._files: dict[Path, _FileState] = {}
        self._desired: dict[Identity, ManifestEntry] = {}
        self._prefetches: dict[Identity, asyncio.Task[None]] = {}
        # Snapshot key each pinned entry had pinned; only pins made here.
        self._pinned: dict[Identity, str] = {}
        self._stop = asyncio.Event()
        self._refreshing = asyncio.Lock()
        self._tasks: asyncio.TaskGroup | None = None

    @property
    def entries(self) -> tuple[ManifestEntry, ...]:
        """What the manifests currently ask for (merged across files)."""
        return tuple(self._desired.values())

    async def __aenter__(self) -> Self:
        """Read the directory, start the pulls it asks for, then watch it."""
        self._pinned = await asyncio.to_thread(load_pins, self._state_path)
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        try:
            if await asyncio.to_thread(self._directory.is_dir):
                # Watch first, read second: a file written in between is seen by both.
                self._tasks.create_task(self._watch(), name="manifest-watch")
            else:
                log.info(
                    "no manifest directory %s: prefetch is off (create it and restart "
                    "prewarmd to use manifests)",
                    self._directory,
                    extra={"directory": str(self._directory)},
                )
            await self._refresh()
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop the watch and cancel the prefetches still running."""
        assert self._tasks is not None
        # The watch thread checks this event; cancelling alone would wait for its timeout.
        self._stop.set()
        for task in self._prefetches.values():
            task.cancel()
        await self._tasks.__aexit__(exc_type, exc, tb)

    async def _watch(self) -> None:
        try:
            async for _ in awatch(
                self._directory, stop_event=self._stop, recursive=False, watch_filter=None
            ):
                # Any change re-reads the whole directory: files are small, and a
                # ConfigMap update swaps a symlink rather than touching the files.
                await self._refresh()
        except OSError as exc:
            log.error(
                "cannot watch manifest directory %s (%s); changes need a restart of prewarmd",
                self._directory,
                exc,
                extra={"directory": str(self._directory)},
            )

    async def _refresh(self) -> None:
        async with self._refreshing:  # the first read and the first change may overlap
            await self._refresh_now()

    async def _refresh_now(self) -> None:
        self._files = await asyncio.to_thread(_read_directory, self._directory, self._files)
        desired: dict[Identity, ManifestEntry] = {}
        for state in self._files.values():
            for entry in state.entries:
                seen = desired.get(entry.identity)
                if seen is None:
                    desired[entry.identity] = entry
                elif entry.pin and not seen.pin:
                    # Listed twice: the first listing wins, and any pin holds.
                    desired[entry.identity] = seen.pinned()
        await self._apply(desired)

    async def _apply(self, desired: dict[Identity, ManifestEntry]) -> None:
        assert self._tasks is not None
        previous, self._desired = self._desired, desired
        for identity, old in previous.items():
            if desired.get(identity) != old:
                task = self._prefetches.pop(identity, None)
                if task is not None:
                    task.cancel()
        # Pins made for entries that are gone or no longer pinned, including
        # ones removed while the agent was down (they come from the state file).
        for identity in list(self._pinned):
            entry = desired.get(identity)
            if entry is None or not entry.pin:
                await self._unpin(identity, "no manifest pins it any more")
        # Every listed entry not being fetched right now is ensured again: a hit
        # costs one listing, and it brings back a model evicted by hand, picks
        # up new objects under its prefix, and retries an entry that failed.
        for identity, entry in desired.items():
            if identity not in self._prefetches:
                self._prefetches[identity] = self._tasks.create_task(
                    self._prefetch(entry), name=f"prefetch-{entry.uri}"
                )

    async def _prefetch(self, entry: ManifestEntry) -> None:
        bind_request(uri=entry.uri, client=f"manifest {entry.path.name}", manifest=entry.where)
        try:
            failures = 0
            while True:
                try:
                    async with self._slots:
                        result = await self._ensure(entry)
                    await self._after_pull(entry, result)
                    return
                except (SourceUnavailable, SourceChanged) as exc:
                    failures += 1
                    delay = min(_RETRY_CAP_SECONDS, _RETRY_BASE_SECONDS * 2 ** (failures - 1))
                    MANIFEST_ERRORS.labels("pull").inc()
                    log.warning(
                        "prefetch of %s (%s) failed, retrying in %.0f s: %s",
                        entry.uri,
                        entry.where,
                        delay,
                        exc,
                    )
                    await asyncio.sleep(delay)
        except PrewarmError as exc:
            MANIFEST_ERRORS.labels("pull").inc()
            log.error(
                "prefetch of %s (%s) failed: %s; fix the entry (or the bucket) and save the "
                "file to try again",
                entry.uri,
                entry.where,
                exc,
            )
        except Exception:
            MANIFEST_ERRORS.labels("pull").inc()
            log.exception("prefetch of %s (%s) failed unexpectedly", entry.uri, entry.where)
        finally:
            if self._prefetches.get(entry.identity) is asyncio.current_task():
                del self._prefetches[entry.identity]

    async def _ensure(self, entry: ManifestEntry) -> EnsureResult:
        request = EnsureRequest(
            uri=parse_uri(entry.uri),
            include=tuple(entry.include),
            exclude=tuple(entry.exclude),
            tier=entry.tier,
            strict_tier=entry.strict_tier,
            requester=self._requester,
            client_name=f"manifest {entry.path.name}",
        )
        events = self._service.ensure(request)
        result: EnsureResult | None = None
        # Read to the end, as a client does: the stream ends right after the result.
        async for event in events:
            if isinstance(event, EnsureResult):
                result = event
        if result is None:
            raise PrewarmError(f"The agent gave no answer for {entry.uri}; this is a bug.")
        return result

    async def _after_pull(self, entry: ManifestEntry, result: EnsureResult) -> None:
        key = result.model.key
        log.info(
            "prefetched %s (%s) from %s: %s",
            entry.uri,
            key,
            entry.where,
            "already cached" if result.hit else "pulled",
            extra={"key": key, "hit": result.hit},
        )
        owned = self._pinned.get(entry.identity)
        if owned is not None and owned != key:
            # The URI's objects changed: the old snapshot needs no protection now.
            await self._unpin(entry.identity, f"{entry.uri} now resolves to {key}")
        if entry.pin:
            await self._pin(entry, key)
        if entry.compile is not None:
            await self._restore_compile_cache(entry, entry.compile, key)

    async def _pin(self, entry: ManifestEntry, key: str) -> None:
        """Pin the entry's snapshot unless it is pinned already (by this watcher or by hand)."""
        # The snapshot's own usage says whether it is pinned, not the record: a
        # snapshot evicted by force and pulled again comes back unpinned under the
        # same key, while the record still names that key.
        if self._service.usage(key).pinned:
            if self._pinned.get(entry.identity) != key:
                log.info(
                    "%s (%s) was already pinned by hand; leaving that pin alone", entry.uri, key
                )
            return
        # Recorded first: if the entry goes away while the pin is being
        # written, the removal finds it and undoes it.
        self._pinned[entry.identity] = key
        await self._service.pin(key, True)
        await self._save_state()
        log.info("pinned %s (%s) for %s", entry.uri, key, entry.where)

    async def _restore_compile_cache(
        self, entry: ManifestEntry, spec: CompileSpec, key: str
    ) -> None:
        if self._compile_cache is None:
            log.info("%s names a compile cache; this agent serves none, skipped", entry.where)
            return
        try:
            await self._compile_cache(spec, key)
        except PrewarmError as exc:
            # The model is cached either way; pods just compile cold.
            MANIFEST_ERRORS.labels("compile").inc()
            log.error("compile cache of %s (%s) not restored: %s", entry.uri, entry.where, exc)

    async def _unpin(self, identity: Identity, reason: str) -> None:
        key = self._pinned.pop(identity, None)
        if key is None:
            return  # undone meanwhile
        with contextlib.suppress(NotFound):  # evicted by force meanwhile: nothing to undo
            await self._service.pin(key, False)
            log.info("unpinned %s (%s): %s", identity[0], key, reason, extra={"key": key})
        await self._save_state()

    async def _save_state(self) -> None:
        try:
            await asyncio.to_thread(save_pins, self._state_path, self._pinned)
        except OSError as exc:
            log.warning(
                "cannot record manifest pins in %s (%s); an entry removed while the agent is "
                "down will stay pinned until unpinned by hand",
                self._state_path,
                exc,
            )


@dataclass(frozen=True, slots=True)
class _FileState:
    # (mtime_ns, size, inode): the file is parsed again (and reported again) only
    # when this changes, so a bad file is logged once, not at every event.
    signature: tuple[int, int, int]
    # Its entries, or the last good ones while it is bad.
    entries: tuple[ManifestEntry, ...]


def _read_directory(directory: Path, known: Mapping[Path, _FileState]) -> dict[Path, _FileState]:
    """Every manifest's entries; a bad file keeps its last good entries (none if new)."""
    try:
        paths = sorted(
            p for p in directory.glob("*.toml") if not p.name.startswith(".") and p.is_file()
        )
    except OSError as exc:
        log.error("cannot list manifest directory %s: %s", directory, exc)
        return dict(known)
    files: dict[Path, _FileState] = {}
    for path in paths:
        try:
            stat = path.stat()  # follows symlinks: a ConfigMap swap changes the target
        except OSError:
            continue  # removed since the listing
        signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        previous = known.get(path)
        if previous is not None and previous.signature == signature:
            files[path] = previous
            continue
        try:
            files[path] = _FileState(signature, read_manifest(path))
        except ManifestError as exc:
            MANIFEST_ERRORS.labels("file").inc()
            kept = previous.entries if previous is not None else ()
            log.error(
                "%s %s",
                exc,
                f"Keeping its previous {len(kept)} entries until it is fixed."
                if kept
                else "The file is ignored until it is fixed.",
                extra={"file": str(exc.path), "line": exc.line},
            )
            files[path] = _FileState(signature, kept)
    return files
