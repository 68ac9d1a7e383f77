"""The agent's operations, free of gRPC: what each RPC does, in domain terms."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from ._exceptions import Conflict, InvalidRequest, NotFound, SourceUnavailable
from ._puller import Flight, Puller, PullProgress
from ._s3 import ObjectSource
from ._snapshot import (
    Snapshot,
    SourceObject,
    TierName,
    check_globs,
    select_objects,
    snapshot_key,
)
from ._store import CachedModel, Store, TierUsage
from ._uri import ModelUri, parse_uri, safe_relative_path
from ._version import __version__

__all__ = ["AgentService", "AgentStatus", "EnsureResult", "EvictResult", "RequestTimings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestTimings:
    resolve: float = 0.0
    wait: float = 0.0
    download: float = 0.0
    verify: float = 0.0
    publish: float = 0.0
    total: float = 0.0


@dataclass(frozen=True, slots=True)
class EnsureResult:
    model: CachedModel
    hit: bool
    resolved_offline: bool
    timings: RequestTimings


@dataclass(frozen=True, slots=True)
class EvictResult:
    evicted: tuple[CachedModel, ...]
    bytes_freed: int


@dataclass(frozen=True, slots=True)
class AgentStatus:
    version: str
    tiers: tuple[TierUsage, ...]
    pulls: tuple[Flight, ...]
    model_count: int
    uptime_seconds: float
    data_plane: str
    default_tier: TierName


class AgentService:
    """Resolve, hit or pull, list, evict: every RPC's behaviour lives here."""

    def __init__(
        self,
        store: Store,
        puller: Puller,
        source: ObjectSource,
        *,
        default_tier: TierName,
        offline_fallback: bool,
        offline_after_seconds: float = 2.0,
    ) -> None:
        self._store = store
        self._puller = puller
        self._source = source
        self._default_tier: TierName = default_tier
        self._offline_fallback = offline_fallback
        self._offline_after = offline_after_seconds
        self._started = time.monotonic()

    @property
    def default_tier(self) -> TierName:
        return self._default_tier

    async def resolve(
        self, uri: ModelUri, include: tuple[str, ...], exclude: tuple[str, ...]
    ) -> Snapshot:
        """List the prefix and pin down exactly which bytes make this snapshot."""
        listed = await self._source.list_objects(uri)
        objects = [
            SourceObject(
                key=item.key,
                relative_path=safe_relative_path(uri, item.key),
                size=item.size,
                etag=item.etag,
            )
            for item in listed
            # Zero-byte keys ending in "/" are folder markers made by consoles, not files.
            if not (item.key.endswith("/") and item.size == 0)
        ]
        if not objects:
            raise NotFound(
                f"No objects under {uri}. Check the prefix: it names a directory, "
                "e.g. s3://bucket/models/llama-3-8b/."
            )
        selected = sorted(select_objects(objects, include, exclude), key=lambda o: o.relative_path)
        if not selected:
            raise NotFound(
                f"{len(objects)} objects under {uri}, but none passes the include/exclude "
                f"filters {list(include)} / {list(exclude)}. Loosen the filters."
            )
        _check_no_clashes(uri, selected)
        return Snapshot(
            uri=uri,
            include=include,
            exclude=exclude,
            objects=tuple(selected),
            key=snapshot_key(uri, include, exclude, selected),
        )

    async def ensure(
        self,
        raw_uri: str,
        *,
        tier: TierName | None,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        client_name: str = "",
    ) -> AsyncIterator[PullProgress | EnsureResult]:
        """Progress events, then exactly one EnsureResult (or an exception)."""
        started = time.monotonic()
        uri = parse_uri(raw_uri)
        includes = check_globs(include, what="Include")
        excludes = check_globs(exclude, what="Exclude")
        fallback = (
            self._store.newest_for(str(uri), includes, excludes) if self._offline_fallback else None
        )
        try:
            # With a cached snapshot to fall back on, a pod should not sit through
            # botocore's whole retry schedule against an unreachable endpoint.
            async with asyncio.timeout(self._offline_after if fallback else None):
                snapshot = await self.resolve(uri, includes, excludes)
        except (SourceUnavailable, TimeoutError):
            cached = fallback
            if cached is None:
                raise
            log.warning("S3 unreachable; serving cached %s (%s) unchecked", uri, cached.key)
            await self._store.record_use(cached.key, hit=True)
            elapsed = time.monotonic() - started
            yield EnsureResult(cached, True, True, RequestTimings(resolve=elapsed, total=elapsed))
            return
        resolved = time.monotonic()
        cached = self._store.get(snapshot.key)
        if cached is not None:
            await self._store.record_use(cached.key, hit=True)
            done = time.monotonic()
            yield EnsureResult(
                cached,
                hit=True,
                resolved_offline=False,
                timings=RequestTimings(resolve=resolved - started, total=done - started),
            )
            return
        flight, started_it = self._puller.join(snapshot, tier or self._default_tier)
        log.info(
            "%s pull of %s (%s) for %s",
            "starting" if started_it else "joining",
            uri,
            snapshot.key,
            client_name or "anonymous",
        )
        joined = time.monotonic()
        async for progress in flight.watch():
            yield progress
        model = await flight.result()
        await self._store.record_use(model.key, hit=False)
        done = time.monotonic()
        pulled = flight.timings
        waited = 0.0 if started_it else max(0.0, (done - joined) - _pull_seconds(flight))
        yield EnsureResult(
            model,
            hit=False,
            resolved_offline=False,
            timings=RequestTimings(
                resolve=resolved - started,
                wait=waited,
                download=pulled.download,
                verify=pulled.verify,
                publish=pulled.publish,
                total=done - started,
            ),
        )

    def get(self, ref: str) -> CachedModel:
        """The newest snapshot a ref names."""
        return self._store.find(ref)[-1]

    def list_models(self) -> list[CachedModel]:
        return self._store.models()

    async def evict(self, ref: str) -> EvictResult:
        in_flight = self._flights_matching(ref)
        if in_flight:
            raise Conflict(
                f"{ref} is being pulled right now (snapshot {in_flight[0].key}); evict it "
                "after the pull ends."
            )
        targets = self._store.find(ref)
        evicted = [await self._store.evict(model.key) for model in targets]
        return EvictResult(tuple(evicted), sum(m.total_bytes for m in evicted))

    def _flights_matching(self, ref: str) -> list[Flight]:
        if "://" in ref:
            uri = str(parse_uri(ref))
            return [f for f in self._puller.flights() if str(f.snapshot.uri) == uri]
        key = ref.lower()
        return [f for f in self._puller.flights() if key and f.key.startswith(key)]

    def status(self) -> AgentStatus:
        return AgentStatus(
            version=__version__,
            tiers=tuple(self._store.tier_usage(t) for t in self._store.roots()),
            pulls=tuple(self._puller.flights()),
            model_count=len(self._store.models()),
            uptime_seconds=time.monotonic() - self._started,
            data_plane=self._source.name,
            default_tier=self._default_tier,
        )

    def usage(self, key: str) -> tuple[float, int]:
        usage = self._store.usage(key)
        return (usage.last_used, usage.hit_count) if usage else (0.0, 0)


def _pull_seconds(flight: Flight) -> float:
    t = flight.timings
    return t.download + t.verify + t.publish


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
