"""The gRPC edge: protobuf in, domain calls, protobuf out, errors to status codes."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message

from agent._exceptions import InvalidRequest, PrewarmError
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc
from agent._uri import parse_uri
from agent._vocabulary import PullOptions, TierName
from agent._wire import (
    phase_to_proto,
    pull_options_from_proto,
    tier_from_proto,
    tier_to_proto,
    timestamp_to_proto,
)
from agent.compile.cache import CompileCaches
from agent.edge.compile_servicer import CompileCacheApi, compile_scope
from agent.edge.tenancy import requester_keys
from agent.leases.table import LeaseRecord
from agent.pull.flight import Flight, PullProgress
from agent.service.access import Requester, Tenant
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest, LeaseAsk
from agent.service.results import EnsureResult, EvictReport, PullCancellationReport
from agent.store.records import CachedModel, TierUsage

__all__ = ["PrewarmServicer"]


log = logging.getLogger(__name__)


class PrewarmServicer(CompileCacheApi, pb_grpc.PrewarmServicer):
    """The Prewarm service on one socket: every request's requester is that socket's tenant.

    ``tenant`` is None only on the socket of an agent built without access rules.
    """

    def __init__(
        self,
        service: AgentService,
        *,
        socket_path: str,
        tenant: Tenant | None,
        compile_caches: CompileCaches | None = None,
    ) -> None:
        self._service = service
        self._socket_path = socket_path
        self._tenant = tenant
        self._compile_caches = compile_caches

    async def EnsureModel(
        self,
        request: pb.EnsureModelRequest,
        context: grpc.aio.ServicerContext[pb.EnsureModelRequest, pb.EnsureModelEvent],
    ) -> AsyncIterator[pb.EnsureModelEvent]:
        """Progress events, then the handle of the snapshot, cached or pulled."""
        tier, options = _tier_and_options(request)
        yield pb.EnsureModelEvent(progress=pb.Progress(phase=pb.PHASE_RESOLVE))
        try:
            ensure = self._ensure_request(request, tier, options)
            async for event in self._service.ensure(ensure):
                if isinstance(event, PullProgress):
                    yield pb.EnsureModelEvent(progress=_progress(event))
                else:
                    yield pb.EnsureModelEvent(handle=self._handle(event))
        except PrewarmError as exc:
            log.info("EnsureModel %s: %s", request.uri, exc)
            raise  # answered by the interceptor, as every refusal is

    def _ensure_request(
        self, request: pb.EnsureModelRequest, tier: TierName | None, options: PullOptions | None
    ) -> EnsureRequest:
        """The request in domain terms: URI parsed, filters checked, the requester named."""
        return EnsureRequest(
            uri=parse_uri(request.uri),
            include=tuple(request.include),
            exclude=tuple(request.exclude),
            tier=tier,
            strict_tier=request.strict_tier,
            lease=LeaseAsk(request.lease_ttl_seconds or None) if request.lease else None,
            pin=request.pin,
            options=options,
            cached_only=request.cached_only,
            requester=self._requester(request),
            client_name=request.client_name,
            waiter_token=request.waiter_token,
        )

    def _requester(self, request: Message) -> Requester | None:
        """Who asks: this socket's tenant, with the pod's keys if the request carries them.

        None on a socket without a tenant (an agent built without access rules).
        """
        if self._tenant is None:
            return None
        return Requester(self._tenant, requester_keys(request))

    async def GetModel(
        self,
        request: pb.GetModelRequest,
        context: grpc.aio.ServicerContext[pb.GetModelRequest, pb.ModelInfo],
    ) -> pb.ModelInfo:
        """The newest snapshot a ref names, with its files (node socket only)."""
        model = self._service.get(request.ref)
        return self._model_info(model, self._requester(request), with_files=True)

    async def ListModels(
        self,
        request: pb.ListModelsRequest,
        context: grpc.aio.ServicerContext[pb.ListModelsRequest, pb.ListModelsResponse],
    ) -> pb.ListModelsResponse:
        """Every cached snapshot (node socket only)."""
        return pb.ListModelsResponse(
            models=[
                self._model_info(m, self._requester(request), with_files=False)
                for m in self._service.list_models()
            ]
        )

    async def EvictModel(
        self,
        request: pb.EvictModelRequest,
        context: grpc.aio.ServicerContext[pb.EvictModelRequest, pb.EvictModelResponse],
    ) -> pb.EvictModelResponse:
        """Evict the snapshots a ref names (node socket only)."""
        result = await self._service.evict(request.ref, force=request.force)
        log.info(
            "evicted %s: %d snapshots, %d bytes",
            request.ref,
            len(result.evicted),
            result.bytes_freed,
        )
        return self._evict_response(result, self._requester(request))

    async def CancelPull(
        self,
        request: pb.CancelPullRequest,
        context: grpc.aio.ServicerContext[pb.CancelPullRequest, pb.CancelPullResponse],
    ) -> pb.CancelPullResponse:
        """Stop the pulls a ref names, as far as this socket's tenant may."""
        reports = await self._service.cancel_pull(
            request.ref,
            self._requester(request),
            only_if_unwatched=request.only_if_unwatched,
            waiter_token=request.waiter_token,
        )
        return pb.CancelPullResponse(pulls=[_pull_cancellation(r) for r in reports])

    async def RenewLease(
        self,
        request: pb.RenewLeaseRequest,
        context: grpc.aio.ServicerContext[pb.RenewLeaseRequest, pb.Lease],
    ) -> pb.Lease:
        """Renew a lease granted on this socket."""
        if request.ttl_seconds < 0:
            raise InvalidRequest("ttl_seconds must not be negative.")
        renewed = self._service.renew_lease(
            request.id, request.ttl_seconds or None, self._requester(request)
        )
        return self._lease(renewed)

    async def ReleaseLease(
        self,
        request: pb.ReleaseLeaseRequest,
        context: grpc.aio.ServicerContext[pb.ReleaseLeaseRequest, pb.ReleaseLeaseResponse],
    ) -> pb.ReleaseLeaseResponse:
        """Release a lease granted on this socket."""
        self._service.release_lease(request.id, self._requester(request))
        return pb.ReleaseLeaseResponse()

    async def PinModel(
        self,
        request: pb.PinModelRequest,
        context: grpc.aio.ServicerContext[pb.PinModelRequest, pb.ModelInfo],
    ) -> pb.ModelInfo:
        """Pin or unpin the newest snapshot a ref names (node socket only)."""
        model = await self._service.pin(request.ref, request.pinned)
        return self._model_info(model, self._requester(request), with_files=False)

    async def CollectGarbage(
        self,
        request: pb.CollectGarbageRequest,
        context: grpc.aio.ServicerContext[pb.CollectGarbageRequest, pb.CollectGarbageResponse],
    ) -> pb.CollectGarbageResponse:
        """Evict what nothing protects, on one tier or both (node socket only)."""
        tier = tier_from_proto(request.tier)
        result = await self._service.collect_garbage(tier)
        requester = self._requester(request)
        return pb.CollectGarbageResponse(
            evicted=[self._model_info(m, requester, with_files=False) for m in result.evicted],
            bytes_freed=result.bytes_freed,
        )

    async def VerifyModels(
        self,
        request: pb.VerifyModelsRequest,
        context: grpc.aio.ServicerContext[pb.VerifyModelsRequest, pb.VerifyModelsResponse],
    ) -> pb.VerifyModelsResponse:
        """Re-hash cached snapshots; evict those that changed unless report_only."""
        results = await self._service.verify(
            request.ref, every=request.all, report_only=request.report_only
        )
        return pb.VerifyModelsResponse(
            results=[
                pb.ModelVerification(
                    uri=r.model.uri,
                    key=r.model.key,
                    ok=not r.problems,
                    problems=[
                        pb.FileProblem(path=p.path, check=p.check, detail=p.detail)
                        for p in r.problems
                    ],
                    evicted=r.evicted,
                    bytes_checked=r.model.total_bytes,
                    seconds=r.seconds,
                )
                for r in results
            ]
        )

    async def Status(
        self,
        request: pb.StatusRequest,
        context: grpc.aio.ServicerContext[pb.StatusRequest, pb.StatusResponse],
    ) -> pb.StatusResponse:
        """The agent's state as this socket's tenant may see it."""
        status = self._service.status(self._requester(request))
        caches = self._compile_caches
        compiles = caches.statistics(compile_scope(self._tenant)) if caches else (0, 0)
        return pb.StatusResponse(
            version=status.version,
            tiers=[_tier_status(t, status.leased_per_tier.get(t.tier, 0)) for t in status.tiers],
            pulls=[_pull_status(f) for f in status.pulls],
            model_count=status.model_count,
            uptime_seconds=status.uptime_seconds,
            data_plane=status.data_plane,
            socket_path=self._socket_path,
            default_tier=tier_to_proto(status.default_tier),
            lease_count=status.lease_count,
            compile_cache_count=compiles[0],
            compile_cache_bytes=compiles[1],
        )

    def _evict_response(
        self, result: EvictReport, requester: Requester | None
    ) -> pb.EvictModelResponse:
        return pb.EvictModelResponse(
            evicted=[self._model_info(m, requester, with_files=False) for m in result.evicted],
            bytes_freed=result.bytes_freed,
        )

    def _model_info(
        self, model: CachedModel, requester: Requester | None, *, with_files: bool
    ) -> pb.ModelInfo:
        usage = self._service.usage(model.key)
        info = pb.ModelInfo(
            uri=model.uri,
            key=model.key,
            path=str(model.path),
            tier=tier_to_proto(model.tier),
            total_bytes=model.total_bytes,
            file_count=len(model.files),
            created=timestamp_to_proto(model.created),
            last_used=timestamp_to_proto(usage.last_used),
            hit_count=usage.hit_count,
            include=model.include,
            exclude=model.exclude,
            leases=[_lease_info(lease) for lease in self._service.leases_for(model.key, requester)],
            pinned=usage.pinned,
            verified_by=model.verified_by,
        )
        if with_files:
            info.files.extend(_files(model))
        return info

    def _lease(self, lease: LeaseRecord) -> pb.Lease:
        granted = pb.Lease(id=lease.id, key=lease.key, socket_path=self._service.lease_socket_path)
        if lease.expires is not None:
            granted.expires.CopyFrom(timestamp_to_proto(lease.expires))
        return granted

    def _handle(self, result: EnsureResult) -> pb.ModelHandle:
        model, t = result.model, result.timings
        handle = pb.ModelHandle(
            uri=model.uri,
            key=model.key,
            path=str(model.path),
            tier=tier_to_proto(model.tier),
            hit=result.hit,
            files=_files(model),
            total_bytes=model.total_bytes,
            timings=pb.PhaseTimings(
                resolve_seconds=t.resolve,
                wait_seconds=t.wait,
                download_seconds=t.download,
                verify_seconds=t.verify,
                publish_seconds=t.publish,
                total_seconds=t.total,
            ),
            resolved_offline=result.resolved_offline,
            resumed_bytes=result.resumed_bytes,
            owner_uid=os.geteuid(),
            verified_by=model.verified_by,
            joined=result.joined,
        )
        if result.lease is not None:
            handle.lease.CopyFrom(self._lease(result.lease))
        return handle


def _tier_and_options(
    request: pb.EnsureModelRequest,
) -> tuple[TierName | None, PullOptions | None]:
    """The tier and pull options a request asks for, checked before anything is sent back."""
    tier = tier_from_proto(request.tier)
    if request.tier and tier is None:
        raise InvalidRequest(f"Unknown tier {request.tier}; use shm or disk.")
    if request.lease_ttl_seconds < 0:
        raise InvalidRequest("lease_ttl_seconds must not be negative.")
    if not request.HasField("pull_options"):
        return tier, None
    return tier, pull_options_from_proto(request.pull_options)


def _files(model: CachedModel) -> list[pb.FileEntry]:
    return [pb.FileEntry(path=f.path, size=f.size, etag=f.etag) for f in model.files]


def _progress(progress: PullProgress) -> pb.Progress:
    return pb.Progress(
        phase=phase_to_proto(progress.phase),
        bytes_done=progress.bytes_done,
        bytes_total=progress.bytes_total,
        files_done=progress.files_done,
        files_total=progress.files_total,
        key=progress.key,
    )


def _tier_status(usage: TierUsage, leased: int) -> pb.TierStatus:
    return pb.TierStatus(
        tier=tier_to_proto(usage.tier),
        root=str(usage.root),
        capacity_bytes=usage.capacity_bytes,
        used_bytes=usage.used_bytes,
        free_bytes=usage.free_bytes,
        model_count=usage.model_count,
        budget_bytes=usage.budget_bytes,
        reserve_bytes=usage.reserve_bytes,
        staging_bytes=usage.staging_bytes,
        leased_count=leased,
        pinned_count=usage.pinned_count,
        resumable_count=usage.resumable_count,
        resumable_bytes=usage.resumable_bytes,
    )


def _lease_info(lease: LeaseRecord) -> pb.LeaseInfo:
    # No id: a lease id is a capability, returned only to the requester of its EnsureModel.
    info = pb.LeaseInfo(
        client_name=lease.client_name,
        acquired=timestamp_to_proto(lease.acquired),
        held=lease.held,
    )
    if lease.holder is not None:
        info.pid, info.uid, info.gid = lease.holder.pid, lease.holder.uid, lease.holder.gid
    if lease.expires is not None:
        info.expires.CopyFrom(timestamp_to_proto(lease.expires))
    return info


def _pull_cancellation(report: PullCancellationReport) -> pb.PullCancellation:
    flight = report.flight
    return pb.PullCancellation(
        uri=str(flight.snapshot.uri),
        key=flight.key,
        tier=tier_to_proto(flight.tier),
        cancelled=report.cancelled,
        other_waiters=report.other_waiters,
        kept_bytes=report.kept_bytes,
        total_bytes=flight.snapshot.total_bytes,
    )


def _pull_status(flight: Flight) -> pb.PullStatus:
    return pb.PullStatus(
        uri=str(flight.snapshot.uri),
        key=flight.key,
        tier=tier_to_proto(flight.tier),
        progress=_progress(flight.progress),
        waiters=flight.waiters,
        started=timestamp_to_proto(flight.started),
    )
