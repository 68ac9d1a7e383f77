"""Resolution: a URI and its filters, listed now, become a Snapshot with a content key.

When S3 cannot answer, or the caller asked for no S3 call at all, the newest
cached snapshot of the same URI and filters stands in for it, unchecked.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agent._exceptions import InvalidRequest, NotFound, SourceUnavailable
from agent._snapshot import Snapshot, SourceObject, select_objects, snapshot_key
from agent._uri import ModelUri, safe_relative_path
from agent.pull.snapshot_limits import SnapshotLimit
from agent.source.interface import ListedObject, ObjectSource
from agent.store.catalog import Store
from agent.store.records import CachedModel

__all__ = ["HitWithoutS3Check", "Resolver", "resolve"]

log = logging.getLogger(__name__)

_SELECTING = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prewarm-select")


@dataclass(frozen=True, slots=True)
class HitWithoutS3Check:
    """A cached snapshot served without asking S3 whether it is still current."""

    model: CachedModel


class Resolver:
    """Resolves requests against one source, falling back to the cache as configured.

    With ``fallback`` and a cached snapshot, a listing that fails is answered
    from the cache: at once when no connection can be made (the source does
    not retry that), after ``offline_after`` seconds when S3 is slow to answer.
    """

    def __init__(
        self, source: ObjectSource, store: Store, *, fallback: bool, offline_after: float
    ) -> None:
        self._source = source
        self._store = store
        self._fallback = fallback
        self._offline_after = offline_after

    async def find(
        self,
        uri: ModelUri,
        include: tuple[str, ...],
        exclude: tuple[str, ...],
        *,
        cached_only: bool,
        limits: Sequence[SnapshotLimit] = (),
    ) -> Snapshot | HitWithoutS3Check:
        """The snapshot S3 lists now, or the newest cached one when S3 is not asked or
        cannot answer.

        ``cached_only`` makes no S3 call: the newest cached snapshot, else NotFound.
        ``limits`` cut the listing short (see ``resolve``).
        """
        newest = self._store.newest_for(str(uri), include, exclude)
        if cached_only:
            if newest is None:
                raise _not_cached(uri, include, exclude)
            log.info("serving cached %s (%s) without asking S3 (cached_only)", uri, newest.key)
            return HitWithoutS3Check(newest)
        if newest is None or not self._fallback:
            return await resolve(self._source, uri, include, exclude, limits=limits)
        try:
            async with asyncio.timeout(self._offline_after):
                return await resolve(self._source, uri, include, exclude, limits=limits)
        except (SourceUnavailable, TimeoutError) as exc:
            why = str(exc) or f"no answer to the listing within {self._offline_after:g} s"
            log.warning(
                "S3 unreachable (%s); serving cached %s (%s) unchecked", why, uri, newest.key
            )
            return HitWithoutS3Check(newest)


async def resolve(
    source: ObjectSource,
    uri: ModelUri,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
    *,
    limits: Sequence[SnapshotLimit] = (),
) -> Snapshot:
    """List the prefix and pin down exactly which bytes make this snapshot.

    The files and bytes that pass the filters are counted against ``limits`` as
    each page of the listing arrives: past a limit the listing stops there, with
    LimitExceeded naming it.
    """
    loop = asyncio.get_running_loop()
    listed = 0
    selected: list[SourceObject] = []
    size = 0
    pages = source.list_pages(uri)
    try:
        async for page in pages:
            objects = _objects_of(uri, page)
            listed += len(objects)
            # Up to 256 globs of 1 KiB each against every object can take seconds of
            # CPU: never on the event loop, which answers every other request meanwhile,
            # and in threads of their own, so hostile filters queue behind each other
            # rather than take the threads every file operation of the agent runs in.
            chosen = await loop.run_in_executor(
                _SELECTING, select_objects, objects, include, exclude
            )
            selected += chosen
            size += sum(obj.size for obj in chosen)
            for limit in limits:
                limit.check(uri, len(selected), size, complete=False)
    finally:
        await pages.aclose()  # a listing stopped early asks S3 for no further page
    if not listed:
        raise NotFound(
            f"No objects under {uri}. Check the prefix: it names a directory, "
            "e.g. s3://bucket/models/llama-3-8b/."
        )
    snapshot_of = functools.partial(_snapshot_of, include=include, exclude=exclude)
    return await loop.run_in_executor(_SELECTING, snapshot_of, uri, listed, selected)


def _objects_of(uri: ModelUri, page: Sequence[ListedObject]) -> list[SourceObject]:
    return [
        SourceObject(
            key=item.key,
            relative_path=safe_relative_path(uri, item.key),
            size=item.size,
            etag=item.etag,
            checksum_algorithm=item.checksum_algorithm,
        )
        for item in page
        # Zero-byte keys ending in "/" are folder markers made by consoles, not files.
        if not (item.key.endswith("/") and item.size == 0)
    ]


def _snapshot_of(
    uri: ModelUri,
    listed: int,
    selected: list[SourceObject],
    *,
    include: tuple[str, ...],
    exclude: tuple[str, ...],
) -> Snapshot:
    """The selected objects, checked and keyed (a worker thread's work)."""
    if not selected:
        raise NotFound(
            f"{listed} objects under {uri}, but none passes the include/exclude "
            f"filters {list(include)} / {list(exclude)}. Loosen the filters."
        )
    ordered = sorted(selected, key=lambda o: o.relative_path)
    _check_no_clashes(uri, ordered)
    return Snapshot(
        uri=uri,
        include=include,
        exclude=exclude,
        objects=tuple(ordered),
        key=snapshot_key(uri, include, exclude, ordered),
    )


def _check_no_clashes(uri: ModelUri, objects: Sequence[SourceObject]) -> None:
    """Refuse listings where one object's path is another's directory ("a" and "a/b")."""
    paths = {obj.relative_path for obj in objects}
    for obj in objects:
        parts = obj.relative_path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in paths:
                raise InvalidRequest(
                    f"Under {uri}, {parent!r} is both a file and the directory of "
                    f"{obj.relative_path!r}; a local directory cannot hold both. Exclude one."
                )


def _not_cached(uri: ModelUri, include: tuple[str, ...], exclude: tuple[str, ...]) -> NotFound:
    filters = f" with include {list(include)} / exclude {list(exclude)}"
    return NotFound(
        f"No snapshot of {uri}{filters if include or exclude else ''} is cached on this "
        "node, and cached_only forbids asking S3. Ask without cached_only (drop "
        "--cached-only / PREWARM_CACHED_ONLY) to pull it, or prefetch it on the node "
        "with a models.d manifest."
    )
