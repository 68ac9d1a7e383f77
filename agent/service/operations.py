"""The agent's operations, free of gRPC: what each RPC does, in domain terms."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from agent._config import Settings
from agent._exceptions import Conflict, NotFound
from agent._snapshot import check_globs
from agent._uri import parse_uri, refuse_whole_bucket
from agent._version import __version__
from agent._vocabulary import PullOptions, TierName
from agent.check.hashes import verify_files
from agent.obs.logs import bind_request
from agent.obs.metrics import EVICTIONS
from agent.pull.flight import Flight, PullProgress
from agent.pull.puller import Puller, ScopedSource
from agent.pull.resolver import Unchecked, resolve_or_fall_back
from agent.service import access
from agent.service.results import (
    AgentStatus,
    EnsureResult,
    EvictResult,
    RequestTimings,
    Verification,
    observe_lookup,
    pull_seconds,
)
from agent.source.interface import ObjectSource
from agent.store.eviction import Evictor
from agent.store.leases import LeaseRecord, LeaseTable
from agent.store.records import CachedModel, Usage
from agent.store.store import Store

__all__ = ["AgentService"]

log = logging.getLogger(__name__)


class AgentService:
    """Resolve, hit or pull, lease, list, evict, verify: every RPC's behaviour lives here."""

    def __init__(
        self,
        store: Store,
        puller: Puller,
        source: ObjectSource,
        leases: LeaseTable,
        settings: Settings,
    ) -> None:
        self._store = store
        self._puller = puller
        self._source = source
        self._leases = leases
        self._settings = settings
        self._evictor = Evictor(store, leases, settings.tiers)
        self._started = time.monotonic()
        # Snapshot key -> the sockets that started or joined its pull: a tenant's
        # Status shows those pulls only. Keys no longer in flight are dropped.
        self._pulls_asked: dict[str, set[str]] = {}

    @property
    def default_tier(self) -> TierName:
        return self._settings.default_tier

    @property
    def lease_socket_path(self) -> str:
        return str(self._settings.lease_socket_path)

    async def start(self) -> None:
        """Bring the cache within its budgets after a restart (budgets may have shrunk)."""
        await self._evictor.enforce_watermarks()

    async def ensure(
        self,
        raw_uri: str,
        *,
        tier: TierName | None,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        client_name: str = "",
        lease: bool = False,
        lease_ttl: float | None = None,
        pin: bool = False,
        strict_tier: bool = False,
        options: PullOptions | None = None,
        cached_only: bool = False,
        requester: str = "",
    ) -> AsyncIterator[PullProgress | EnsureResult]:
        """Progress events, then exactly one EnsureResult (or an exception).

        ``cached_only`` answers from the cache without any S3 call: the newest
        cached snapshot of the URI and filters, or NotFound. ``requester`` names
        who asks (the API socket) when no tenant is bound: a lease belongs to
        the asking socket, which alone may renew or release it, and counts
        against its cap.
        """
        started = time.monotonic()
        requester = _calling_socket(requester) or ""
        uri = parse_uri(raw_uri)
        refuse_whole_bucket(uri, self._settings.access.whole_buckets)
        access.check_source(uri)  # before any S3 call, cached_only included
        includes = check_globs(include, what="Include")
        excludes = check_globs(exclude, what="Exclude")
        scoped = _requester_source(self._source)
        if options is not None:
            self._puller.check(options, scoped=scoped is not None)
        found = await resolve_or_fall_back(
            self._source,
            self._store,
            uri,
            includes,
            excludes,
            fallback=self._settings.offline_fallback,
            offline_after=self._settings.offline_after_seconds,
            cached_only=cached_only,
            limits=access.snapshot_limits(),
        )
        if isinstance(found, Unchecked):
            access.check_unchecked()
            bind_request(key=found.model.key)
            elapsed = time.monotonic() - started
            yield await self._answer(
                found.model,
                hit=True,
                offline=True,
                timings=RequestTimings(resolve=elapsed, total=elapsed),
                lease=lease,
                lease_ttl=lease_ttl,
                client_name=client_name,
                pin=pin,
                requester=requester,
            )
            return
        snapshot = found
        await access.check_snapshot(self._source, snapshot)  # the pod's own access, limits
        resolved = time.monotonic()
        bind_request(key=snapshot.key)
        if lease:
            self._leases.check_room(requester)  # before any pull, not after it
        # The claim keeps this snapshot from eviction from before a pull publishes it
        # until this request has its lease and its handle has been sent.
        with self._leases.claim(snapshot.key):
            cached = self._store.get(snapshot.key)
            if cached is not None:
                yield await self._answer(
                    cached,
                    hit=True,
                    offline=False,
                    timings=RequestTimings(
                        resolve=resolved - started, total=time.monotonic() - started
                    ),
                    lease=lease,
                    lease_ttl=lease_ttl,
                    client_name=client_name,
                    pin=pin,
                    requester=requester,
                )
                return
            stale: list[Path] = []
            async with self._evictor.lock:
                flight = self._puller.flight_for(snapshot.key)
                started_it = flight is None
                if flight is None:
                    access.start_pull(snapshot.key, [f.key for f in self._puller.flights()])
                    placed = await self._evictor.make_room(
                        snapshot, tier or self.default_tier, strict=strict_tier
                    )
                    stale = self._store.discard_leftovers_of(str(snapshot.uri), keep=snapshot.key)
                    # The requester's own credentials pull what it starts; one who joins a
                    # pull in progress has passed its own check (list + HEAD) above.
                    flight, _ = self._puller.join(snapshot, placed, options, source=scoped)
            await self._store.purge(stale)  # outside the lock: deleting can take a while
            self._note_pull_asked(snapshot.key, requester)
            log.info(
                "%s pull of %s (%s) on %s for %s",
                "starting" if started_it else "joining",
                uri,
                snapshot.key,
                flight.tier,
                client_name or "anonymous",
                extra={"uri": str(uri), "key": snapshot.key, "client": client_name},
            )
            joined = time.monotonic()
            async for progress in flight.watch():
                yield progress
            model = await flight.result()
            if started_it:
                async with self._evictor.lock:
                    await self._evictor.enforce_watermarks([model.tier])
            done = time.monotonic()
            pulled = flight.timings
            waited = 0.0 if started_it else max(0.0, (done - joined) - pull_seconds(flight))
            yield await self._answer(
                model,
                hit=False,
                offline=False,
                timings=RequestTimings(
                    resolve=resolved - started,
                    wait=waited,
                    download=pulled.download,
                    verify=pulled.verify,
                    publish=pulled.publish,
                    total=done - started,
                ),
                lease=lease,
                lease_ttl=lease_ttl,
                client_name=client_name,
                pin=pin,
                requester=requester,
                resumed_bytes=flight.resumed_bytes,
            )

    async def _answer(
        self,
        model: CachedModel,
        *,
        hit: bool,
        offline: bool,
        timings: RequestTimings,
        lease: bool,
        lease_ttl: float | None,
        client_name: str,
        pin: bool,
        requester: str = "",
        resumed_bytes: int = 0,
    ) -> EnsureResult:
        if self._store.get(model.key) is None:
            # Only a forced or verify eviction gets here: never hand out a path that is gone.
            raise Conflict(
                f"{model.uri} ({model.key}) was evicted before it could be handed out; ask again."
            )
        granted = None
        if lease:
            ttl = _capped_ttl(lease_ttl, self._leases.default_ttl)
            granted = self._leases.grant(model.key, client_name, ttl, grantee=requester)
        if pin:
            await self._store.set_pinned(model.key, True)
        if hit:
            await self._store.record_use(model.key, hit=True)
        observe_lookup(timings, "offline" if offline else "hit" if hit else "miss")
        return EnsureResult(model, hit, offline, timings, granted, resumed_bytes)

    # -- inspection -----------------------------------------------------------------------

    def get(self, ref: str) -> CachedModel:
        """The newest snapshot a ref names."""
        return self._store.find(ref)[-1]

    def list_models(self) -> list[CachedModel]:
        return self._store.models()

    def usage(self, key: str) -> Usage:
        return self._store.usage(key) or Usage(last_used=0.0)

    def leases_for(self, key: str) -> list[LeaseRecord]:
        """The leases on ``key`` the calling socket may see: all on the node's, else its own."""
        leases = self._leases.for_key(key)
        caller = _calling_socket(None)
        if caller is None or caller == access.NODE_TENANT:
            return leases
        return [lease for lease in leases if lease.grantee == caller]

    def status(self) -> AgentStatus:
        """The agent's state as the calling socket may see it.

        A tenant's socket sees only the pulls it started or joined and its own
        leases; the tiers' sizes and counts are node-wide figures that name no
        model. The node's socket sees everything.
        """
        leased = self._leases.leased_keys()
        per_tier: dict[TierName, int] = {}
        for model in self._store.models():
            if model.key in leased:
                per_tier[model.tier] = per_tier.get(model.tier, 0) + 1
        caller = _calling_socket(None)
        everything = caller is None or caller == access.NODE_TENANT
        pulls = self._puller.flights()
        self._forget_ended_pulls(pulls)
        if not everything:
            pulls = [f for f in pulls if caller in self._pulls_asked.get(f.key, ())]
        return AgentStatus(
            version=__version__,
            tiers=tuple(self._store.tier_usage(t) for t in self._store.roots()),
            leased_per_tier=per_tier,
            pulls=tuple(pulls),
            model_count=len(self._store.models()),
            lease_count=self._leases.count(None if everything else caller),
            uptime_seconds=time.monotonic() - self._started,
            data_plane=self._puller.data_plane,
            default_tier=self.default_tier,
        )

    def _note_pull_asked(self, key: str, requester: str) -> None:
        self._forget_ended_pulls(self._puller.flights())
        self._pulls_asked.setdefault(key, set()).add(requester)

    def _forget_ended_pulls(self, flights: Sequence[Flight]) -> None:
        running = {flight.key for flight in flights}
        for key in [k for k in self._pulls_asked if k not in running]:
            del self._pulls_asked[key]

    # -- management -----------------------------------------------------------------------

    async def evict(self, ref: str, *, force: bool = False) -> EvictResult:
        in_flight = self._flights_matching(ref)
        if in_flight:
            raise Conflict(
                f"{ref} is being pulled right now (snapshot {in_flight[0].key}); evict it "
                "after the pull ends."
            )
        targets = self._store.find(ref)
        async with self._evictor.lock:
            self._evictor.check_evictable(targets, force=force)
            evicted = [await self._store.evict(model.key) for model in targets]
        for model in evicted:
            EVICTIONS.labels(model.tier, "manual").inc()
            self._leases.end_all_for(model.key)  # nothing left to protect
        return EvictResult(tuple(evicted), sum(m.total_bytes for m in evicted))

    async def collect_garbage(self, tier: TierName | None = None) -> EvictResult:
        async with self._evictor.lock:
            evicted = await self._evictor.collect_garbage([tier] if tier else ["shm", "disk"])
        return EvictResult(tuple(evicted), sum(m.total_bytes for m in evicted))

    async def pin(self, ref: str, pinned: bool) -> CachedModel:
        return await self._store.set_pinned(self.get(ref).key, pinned)

    def renew_lease(self, lease_id: str, ttl: float | None) -> LeaseRecord:
        """AccessDenied unless the calling socket is the one its lease was granted on."""
        capped = _capped_ttl(ttl, self._leases.default_ttl)
        return self._leases.renew(lease_id, capped, grantee=_calling_socket(None))

    def release_lease(self, lease_id: str) -> None:
        self._leases.release(lease_id, grantee=_calling_socket(None))

    async def verify(self, ref: str, *, every: bool, report_only: bool) -> list[Verification]:
        """Re-hash cached files; a snapshot that changed is evicted unless report_only."""
        if every:
            models = self._store.models()
        elif ref:
            models = self._store.find(ref)
        else:
            raise NotFound("Name a model to verify (URI or key), or ask for --all.")
        results: list[Verification] = []
        for model in models:
            started = time.monotonic()
            expected = [(f.path, f.size, f.digest) for f in model.files]
            problems = await asyncio.to_thread(
                verify_files, model.path, expected, model.hash_chunk_size
            )
            evicted = False
            if problems and not report_only and self._store.get(model.key) is not None:
                log.error(
                    "snapshot %s of %s failed verification; evicting it",
                    model.key,
                    model.uri,
                    extra={"key": model.key, "problems": [p.path for p in problems]},
                )
                await self._store.evict(model.key)
                EVICTIONS.labels(model.tier, "verify").inc()
                evicted = True
            results.append(
                Verification(model, tuple(problems), evicted, time.monotonic() - started)
            )
        return results

    def _flights_matching(self, ref: str) -> list[Flight]:
        if "://" in ref:
            uri = str(parse_uri(ref))
            return [f for f in self._puller.flights() if str(f.snapshot.uri) == uri]
        key = ref.lower()
        return [f for f in self._puller.flights() if key and f.key.startswith(key)]


def _calling_socket(unbound: str | None) -> str | None:
    """The tenant (socket) the current request came in on; ``unbound`` when none is bound."""
    bound = access.current_requester()
    return bound.tenant.name if bound is not None else unbound


def _capped_ttl(requested: float | None, default: float) -> float | None:
    """The lease TTL the calling socket may have: a tenant's is capped (max_lease_seconds)."""
    bound = access.current_requester()
    return requested if bound is None else bound.tenant.lease_ttl(requested, default)


def _requester_source(source: ObjectSource) -> ScopedSource | None:
    """The source a pull this request starts goes through: the requester's keys, if it sent any.

    Not opened here: the puller opens it when the pull starts and closes it when it ends.
    """
    bound = access.current_requester()
    keys = bound.keys if bound is not None else None
    if keys is None or not isinstance(source, access.CredentialScopedSource):
        return None  # no keys, or a source check_snapshot already refused them for
    return source.with_credentials(keys.access_key_id, keys.secret_access_key, keys.session_token)
