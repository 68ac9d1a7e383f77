"""The agent's operations, free of gRPC: what each RPC does, in domain terms."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agent._config import Settings
from agent._exceptions import Cancelled, Conflict, InvalidRequest, NoSpace, NotFound, quoted
from agent._snapshot import Snapshot, key_prefix
from agent._uri import parse_uri, refuse_whole_bucket
from agent._version import __version__
from agent._vocabulary import TierName
from agent.check.hashes import verify_files
from agent.leases.table import LeaseRecord, LeaseTable
from agent.obs.logs import bind_request
from agent.obs.metrics import EVICTIONS
from agent.pull.flight import Flight, PullProgress, PullTimings, Waiter
from agent.pull.puller import Puller, ScopedSource
from agent.pull.resolver import HitWithoutS3Check, Resolver
from agent.service import access
from agent.service.access import Requester, RequesterKeys
from agent.service.request import EnsureRequest
from agent.service.results import (
    EnsureResult,
    EvictReport,
    PullCancellationReport,
    RequestTimings,
    StatusReport,
    VerifyReport,
    observe_lookup,
)
from agent.source.interface import ObjectSource
from agent.store.catalog import Store
from agent.store.eviction import Evictor
from agent.store.records import CachedModel, Usage

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
        *,
        settings: Settings,
    ) -> None:
        self._store = store
        self._puller = puller
        self._source = source
        self._leases = leases
        self._settings = settings
        self._evictor = Evictor(store, leases, settings.tiers)
        self._resolver = Resolver(
            source,
            store,
            fallback=settings.offline_fallback,
            offline_after=settings.offline_after_seconds,
        )
        self._started = time.monotonic()
        # Snapshot key -> the sockets that started or joined its pull: a tenant's
        # Status shows those pulls only. Keys no longer in flight are dropped.
        self._pulls_asked: dict[str, set[str]] = {}

    @property
    def default_tier(self) -> TierName:
        """The tier a pull goes to when its request names none."""
        return self._settings.default_tier

    @property
    def lease_socket_path(self) -> str:
        """Where pods hold their leases open (handed out with every lease)."""
        return str(self._settings.lease_socket_path)

    async def start(self) -> None:
        """Bring the cache within its budgets after a restart (budgets may have shrunk)."""
        await self._evictor.enforce_watermarks()

    async def ensure(self, request: EnsureRequest) -> AsyncIterator[PullProgress | EnsureResult]:
        """Progress events, then exactly one EnsureResult (or an exception).

        Three steps: check the request (before any S3 call, cached_only
        included), resolve it and check the requester's access to the
        snapshot, then answer it from the cache (a hit) or from a pull it
        starts or joins (a miss).
        """
        clock = _Clock()
        scoped = self._check(request)
        found = await self._resolver.find(
            request.uri,
            request.include,
            request.exclude,
            cached_only=request.cached_only,
            limits=access.snapshot_limits(request.requester),
        )
        if isinstance(found, HitWithoutS3Check):
            yield await self._answer_without_s3_check(request, found.model, clock)
            return
        await access.check_snapshot(self._source, found, request.requester)
        clock.resolved()
        bind_request(key=found.key)
        if request.lease is not None:
            # Before any pull, not after it.
            self._leases.check_room(request.grantee)
            self._check_share(request, found)
        # The claim keeps this snapshot from eviction from before a pull publishes it
        # until this request has its lease and its handle has been sent.
        with self._leases.claim(found.key):
            cached = self._store.get(found.key)
            if cached is not None:
                yield await self._answer(request, cached, _Answered("hit", clock.hit_timings()))
                return
            async for event in self._pull(request, found, clock, scoped=scoped):
                yield event

    def _check_share(self, request: EnsureRequest, snapshot: Snapshot) -> None:
        """NoSpace when leasing ``snapshot`` would take the requester's socket past its share
        of the tier (``tier_share``): its other leased snapshots there, plus this one."""
        requester = request.requester
        share = requester.tenant.tier_share if requester is not None else None
        held = self._leases.keys_of(request.grantee)
        if requester is None or share is None or snapshot.key in held:
            return
        cached = self._store.get(snapshot.key)
        tier = cached.tier if cached is not None else (request.tier or self.default_tier)
        models = [self._store.get(key) for key in held]
        held_bytes = sum(m.total_bytes for m in models if m is not None and m.tier == tier)
        cap = int(share * self._store.limits(tier).ceiling())
        if held_bytes + snapshot.total_bytes > cap:
            raise NoSpace(
                f"Socket {requester.name!r} holds {held_bytes} bytes of leased snapshots on "
                f"the {tier} tier, and {snapshot.total_bytes} more would take it past its "
                f"share of the tier ({share:.0%}, {cap} bytes; [[access.sockets]] tier_share). "
                "Release leases it no longer uses, then ask again."
            )

    def _check(self, request: EnsureRequest) -> bool:
        """Refuse a request the settings forbid before S3 is asked; whether its pull is scoped.

        A scoped pull goes through the requester's own credentials.
        """
        refuse_whole_bucket(request.uri, self._settings.access.whole_buckets)
        access.check_source(request.uri, request.requester)
        scoped = _scoped_keys(self._source, request.requester) is not None
        if request.options is not None:
            self._puller.check(request.options)
        return scoped

    async def _answer_without_s3_check(
        self, request: EnsureRequest, model: CachedModel, clock: _Clock
    ) -> EnsureResult:
        """Answer from a cached snapshot that S3 was not asked about (offline)."""
        access.check_unchecked(request.requester)
        bind_request(key=model.key)
        clock.resolved()
        return await self._answer(request, model, _Answered("offline", clock.hit_timings()))

    async def _pull(
        self, request: EnsureRequest, snapshot: Snapshot, clock: _Clock, *, scoped: bool
    ) -> AsyncIterator[PullProgress | EnsureResult]:
        """Start or join the snapshot's pull, relay its progress, answer with its model."""
        flight, started_it, stale = await self._join(request, snapshot, scoped=scoped)
        # Counted as waiting from here, before any await, so that a cancel asked for
        # only if nobody waits never stops a pull this request has just started or joined.
        with flight.waiting(Waiter(request.grantee, request.waiter_token)):
            await self._store.purge(stale)  # outside the lock: deleting can take a while
            self._note_pull_asked(snapshot.key, request.grantee)
            log.info(
                "%s pull of %s (%s) on %s for %s",
                "starting" if started_it else "joining",
                request.uri,
                snapshot.key,
                flight.tier,
                request.client_name or "anonymous",
                extra={"uri": str(request.uri), "key": snapshot.key, "client": request.client_name},
            )
            joined = time.monotonic()
            async for progress in flight.watch():
                yield progress
            model = await flight.result()
        if started_it:
            async with self._evictor.lock:
                await self._evictor.enforce_watermarks([model.tier])
        # A joiner's wait is its own; the pull's phases, which began before it, are the pull's.
        waited = 0.0 if started_it else time.monotonic() - joined
        timings = clock.miss_timings(flight.timings, waited)
        answered = _Answered("miss", timings, flight.resumed_bytes, joined=not started_it)
        yield await self._answer(request, model, answered)

    async def _join(
        self, request: EnsureRequest, snapshot: Snapshot, *, scoped: bool
    ) -> tuple[Flight, bool, list[Path]]:
        """The snapshot's flight, started here (room made) if none runs.

        True when this request started it; then the leftovers of the URI's other
        snapshots, which can never resume now, to purge.
        """
        async with self._evictor.lock:
            flight = self._puller.flight_for(snapshot.key)
            if flight is not None:
                return flight, False, []
            in_flight = [f.key for f in self._puller.flights()]
            access.start_pull(snapshot.key, in_flight, request.requester)
            placed = await self._evictor.make_room(
                snapshot, request.tier or self.default_tier, strict=request.strict_tier
            )
            stale = self._store.discard_leftovers_of(str(snapshot.uri), keep=snapshot.key)
            # The requester's own credentials pull what it starts; one who joins a
            # pull in progress has passed its own check (list + HEAD) above.
            source = _scoped_source(self._source, request.requester) if scoped else None
            flight, _ = self._puller.join(snapshot, placed, request.options, source=source)
        return flight, True, stale

    async def _answer(
        self, request: EnsureRequest, model: CachedModel, lookup: _Answered
    ) -> EnsureResult:
        """Hand ``model`` out: lease it, pin it, count the lookup."""
        if self._store.get(model.key) is None:
            # Only a forced or verify eviction gets here: never hand out a path that is gone.
            raise Conflict(
                f"{model.uri} ({model.key}) was evicted before it could be handed out; ask again."
            )
        granted = None
        if request.lease is not None:
            ttl = _capped_ttl(request.lease.ttl, self._leases.default_ttl, request.requester)
            granted = self._leases.grant(
                model.key, request.client_name, ttl, grantee=request.grantee
            )
        if request.pin:
            await self._store.set_pinned(model.key, True)
        hit = lookup.kind != "miss"
        if hit:
            await self._store.record_use(model.key, hit=True)
        observe_lookup(lookup.timings, lookup.kind)
        return EnsureResult(
            model,
            hit,
            lookup.kind == "offline",
            lookup.timings,
            granted,
            lookup.resumed_bytes,
            joined=lookup.joined,
        )

    # -- inspection -----------------------------------------------------------------------

    def get(self, ref: str) -> CachedModel:
        """The newest snapshot a ref names."""
        return self._store.find(ref)[-1]

    def list_models(self) -> list[CachedModel]:
        """Every cached snapshot."""
        return self._store.models()

    def usage(self, key: str) -> Usage:
        """How a snapshot has been used (hits, last use, pin); zeros for one never used."""
        return self._store.usage(key) or Usage(last_used=0.0)

    def leases_for(self, key: str, requester: Requester | None = None) -> list[LeaseRecord]:
        """The leases on ``key`` the requester may see: all on the node's socket, else its own."""
        leases = self._leases.for_key(key)
        if requester is None or requester.sees_everything:
            return leases
        return [lease for lease in leases if lease.grantee == requester.name]

    def status(self, requester: Requester | None = None) -> StatusReport:
        """The agent's state as the requester's socket may see it.

        A tenant's socket sees only the pulls it started or joined and its own
        leases; the tiers' sizes and counts are node-wide figures that name no
        model. The node's socket sees everything.
        """
        leased = self._leases.leased_keys()
        per_tier: dict[TierName, int] = {}
        for model in self._store.models():
            if model.key in leased:
                per_tier[model.tier] = per_tier.get(model.tier, 0) + 1
        # None: the node's socket or an in-process caller, who see everything.
        caller = None if requester is None or requester.sees_everything else requester.name
        pulls = self._puller.flights()
        self._forget_ended_pulls(pulls)
        if caller is not None:
            pulls = [f for f in pulls if caller in self._pulls_asked.get(f.key, ())]
        return StatusReport(
            version=__version__,
            tiers=tuple(self._store.tier_usage(t) for t in self._store.roots()),
            leased_per_tier=per_tier,
            pulls=tuple(pulls),
            model_count=len(self._store.models()),
            lease_count=self._leases.count(caller),
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

    async def cancel_pull(
        self,
        ref: str,
        requester: Requester | None = None,
        *,
        only_if_unwatched: bool = False,
        waiter_token: str = "",
    ) -> list[PullCancellationReport]:
        """Stop the pulls ``ref`` names: every pull of a URI, or the one of a key (prefix).

        The requester may stop only what it may pull, checked as EnsureModel checks it,
        and a tenant's socket only pulls that no other socket waits on (Conflict). With a
        ``waiter_token``, only the pulls the caller's own request of that token waited on
        (waits on, or did until it gave up) are named, and that request is not counted as
        waiting. ``only_if_unwatched`` leaves a pull running while another request waits
        on it. Each stopped pull's waiters get Cancelled; what it journaled stays in
        staging, and the next request resumes from it.
        """
        caller = Waiter(_grantee(requester) or "", waiter_token)
        flights = self._pulls_named(ref, requester)
        if waiter_token:  # only the pulls the caller's own request waited on
            flights = [flight for flight in flights if flight.waited_on_by(caller)]
            if not flights:
                raise _no_pull(ref)
        for flight in flights:
            await access.check_snapshot(self._source, flight.snapshot, requester)
        flights = self._still_pulling(ref, flights)
        # From here to the stops nothing awaits: no request joins a pull unseen.
        plans = [(flight, flight.waiting_besides(caller)) for flight in flights]
        left = {flight.key for flight, others in plans if only_if_unwatched and others}
        stopping = [(flight, others) for flight, others in plans if flight.key not in left]
        for flight, others in stopping:
            _check_stoppable(flight, others, requester)
        for flight, _ in stopping:
            self._puller.stop(flight, _cancelled(flight))
        return [
            PullCancellationReport(flight, False, len(others), 0)
            if flight.key in left
            else PullCancellationReport(flight, True, 0, await self._puller.stopped(flight))
            for flight, others in plans
        ]

    def _pulls_named(self, ref: str, requester: Requester | None) -> list[Flight]:
        """The pulls in progress that ``ref`` names and the requester may see.

        A URI the requester may not pull is AccessDenied; a key names only pulls of
        sources it may pull (others are not its to see); NotFound when none matches.
        """
        flights = self._puller.flights()
        if "://" in ref:
            uri = parse_uri(ref)
            access.check_source(uri, requester)
            named = [f for f in flights if f.snapshot.uri == uri]
        else:
            key = key_prefix(ref)
            if key is None:
                raise InvalidRequest(
                    f"{quoted(ref)} is neither an s3:// URI nor a snapshot key (8 to 32 hex "
                    "digits). Copy the URI or the key of a pull from `prewarm status`."
                )
            named = [
                f
                for f in flights
                if f.key.startswith(key) and access.may_pull(f.snapshot.uri, requester)
            ]
            if len(named) > 1:
                raise InvalidRequest(
                    f"Key prefix {key} matches {len(named)} pulls in progress; give more digits."
                )
        if not named:
            raise _no_pull(ref)
        return named

    def _still_pulling(self, ref: str, flights: list[Flight]) -> list[Flight]:
        """Those of ``flights`` not yet ended (the access checks took a while); NotFound if none."""
        running = [f for f in flights if self._puller.flight_for(f.key) is f]
        if not running:
            raise _no_pull(ref)
        return running

    async def evict(self, ref: str, *, force: bool = False) -> EvictReport:
        """Evict every snapshot ``ref`` names; Conflict while one is being pulled."""
        in_flight = self._flights_matching(ref)
        if in_flight:
            key = in_flight[0].key
            raise Conflict(
                f"{quoted(ref)} is being pulled right now (snapshot {key}), and eviction "
                f"{'even with --force ' if force else ''}never takes a model from under its "
                f"pull. Stop the pull with `prewarm cancel {key}` (its bytes stay in staging "
                "for a later pull to resume), or evict it after the pull ends."
            )
        targets = self._store.find(ref)
        async with self._evictor.lock:
            self._evictor.check_evictable(targets, force=force)
            evicted = [await self._store.evict(model.key) for model in targets]
        for model in evicted:
            EVICTIONS.labels(model.tier, "manual").inc()
            self._leases.end_all_for(model.key)  # nothing left to protect
        return EvictReport(tuple(evicted), sum(m.total_bytes for m in evicted))

    async def collect_garbage(self, tier: TierName | None = None) -> EvictReport:
        """Evict what is neither leased, pinned nor recently used, on one tier or both."""
        async with self._evictor.lock:
            evicted = await self._evictor.collect_garbage([tier] if tier else ["shm", "disk"])
        return EvictReport(tuple(evicted), sum(m.total_bytes for m in evicted))

    async def pin(self, ref: str, pinned: bool) -> CachedModel:
        """Pin (or unpin) the newest snapshot ``ref`` names."""
        return await self._store.set_pinned(self.get(ref).key, pinned)

    def renew_lease(
        self, lease_id: str, ttl: float | None, requester: Requester | None = None
    ) -> LeaseRecord:
        """AccessDenied unless the requester's socket is the one its lease was granted on."""
        capped = _capped_ttl(ttl, self._leases.default_ttl, requester)
        return self._leases.renew(lease_id, capped, grantee=_grantee(requester))

    def release_lease(self, lease_id: str, requester: Requester | None = None) -> None:
        """End a lease; AccessDenied unless the requester's socket is the one it was granted on."""
        self._leases.release(lease_id, grantee=_grantee(requester))

    async def verify(self, ref: str, *, every: bool, report_only: bool) -> list[VerifyReport]:
        """Re-hash cached files; a snapshot that changed is evicted unless report_only."""
        if every:
            models = self._store.models()
        elif ref:
            models = self._store.find(ref)
        else:
            raise NotFound("Name a model to verify (URI or key), or ask for --all.")
        results: list[VerifyReport] = []
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
                VerifyReport(model, tuple(problems), evicted, time.monotonic() - started)
            )
        return results

    def _flights_matching(self, ref: str) -> list[Flight]:
        if "://" in ref:
            uri = parse_uri(ref)
            return [f for f in self._puller.flights() if f.snapshot.uri == uri]
        key = ref.lower()
        return [f for f in self._puller.flights() if key and f.key.startswith(key)]


@dataclass(slots=True)
class _Clock:
    """When a request started and when its snapshot was resolved: its answer's timings."""

    started: float = field(default_factory=time.monotonic)
    resolved_at: float = 0.0

    def resolved(self) -> None:
        self.resolved_at = time.monotonic()

    def hit_timings(self) -> RequestTimings:
        return RequestTimings(
            resolve=self.resolved_at - self.started, total=time.monotonic() - self.started
        )

    def miss_timings(self, pulled: PullTimings, waited: float) -> RequestTimings:
        return RequestTimings(
            resolve=self.resolved_at - self.started,
            wait=waited,
            download=pulled.download,
            verify=pulled.verify,
            publish=pulled.publish,
            total=time.monotonic() - self.started,
        )


@dataclass(frozen=True, slots=True)
class _Answered:
    """How a request was answered: from the cache (hit, offline) or by a pull (miss) that it
    started or ``joined``."""

    kind: Literal["hit", "miss", "offline"]
    timings: RequestTimings
    resumed_bytes: int = 0
    joined: bool = False


def _no_pull(ref: str) -> NotFound:
    return NotFound(
        f"No pull of {quoted(ref)} is in progress on this node, so there is nothing to cancel "
        "(it may have finished already). `prewarm status` lists the pulls in flight."
    )


def _check_stoppable(flight: Flight, others: Sequence[Waiter], requester: Requester | None) -> None:
    """Conflict when ``flight`` cannot be stopped: it is publishing, or the requester is a
    tenant's socket and another socket's requests wait on it."""
    if flight.progress.phase in ("publish", "done"):
        raise Conflict(
            f"The pull of {flight.snapshot.uri} is publishing its snapshot, past the point where "
            f"it can be stopped; it is cached in a moment (`prewarm evict {flight.key}` then, "
            "if it is not wanted)."
        )
    if requester is None or requester.sees_everything:
        return
    if any(waiter.socket != requester.name for waiter in others):
        raise Conflict(
            f"Requests on another socket wait on the pull of {flight.snapshot.uri}; socket "
            f"{requester.name!r} may stop only pulls that no other socket waits on. Ask the "
            "node's admin (`prewarm cancel` on the node's API socket)."
        )


def _cancelled(flight: Flight) -> Cancelled:
    """What the requests waiting on ``flight`` are told when it is stopped."""
    return Cancelled(
        f"The pull of {flight.snapshot.uri} (snapshot {flight.key}) was cancelled (CancelPull, "
        "`prewarm cancel`) before it finished. The bytes it had written stay in staging: ask "
        "again and the pull resumes from them."
    )


def _grantee(requester: Requester | None) -> str | None:
    """Whose leases a requester may renew or release: its socket's; None checks nothing."""
    return None if requester is None else requester.name


def _capped_ttl(
    requested: float | None, default: float, requester: Requester | None
) -> float | None:
    """The lease TTL the requester may have: a tenant's is capped (max_lease_seconds)."""
    return requested if requester is None else requester.lease_ttl(requested, default)


def _scoped_keys(source: ObjectSource, requester: Requester | None) -> RequesterKeys | None:
    """The keys a pull this request starts signs with: the requester's, if it sent any.

    None for no keys, or for a source check_snapshot already refused them for.
    """
    keys = requester.keys if requester is not None else None
    if keys is None or not isinstance(source, access.CredentialScopedSource):
        return None
    return keys


def _scoped_source(source: ObjectSource, requester: Requester | None) -> ScopedSource | None:
    """The source a pull this request starts goes through: the requester's keys, if it sent any.

    Not opened here: the puller opens it when the pull starts and closes it when it ends.
    """
    keys = _scoped_keys(source, requester)
    if keys is None or not isinstance(source, access.CredentialScopedSource):
        return None
    return source.with_credentials(keys.access_key_id, keys.secret_access_key, keys.session_token)
