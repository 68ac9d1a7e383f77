"""The gRPC edge: protobuf in, domain calls, protobuf out, errors to status codes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from ._exceptions import (
    AccessDenied,
    Conflict,
    IntegrityError,
    InvalidRequest,
    NoSpace,
    NotFound,
    PrewarmError,
    SourceChanged,
    SourceUnavailable,
)
from ._proto.prewarm.v1 import prewarm_pb2 as pb
from ._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc
from ._puller import Flight, PullProgress
from ._service import AgentService, EnsureResult
from ._snapshot import TierName
from ._store import CachedModel, TierUsage

__all__ = ["PrewarmServicer", "status_code_for"]

log = logging.getLogger(__name__)

_STATUS_BY_ERROR: tuple[tuple[type[PrewarmError], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AccessDenied, grpc.StatusCode.PERMISSION_DENIED),
    (NoSpace, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (SourceChanged, grpc.StatusCode.ABORTED),
    (SourceUnavailable, grpc.StatusCode.UNAVAILABLE),
    (IntegrityError, grpc.StatusCode.DATA_LOSS),
)
_TIER_TO_PB: dict[TierName, pb.Tier.ValueType] = {"shm": pb.TIER_SHM, "disk": pb.TIER_DISK}
_PB_TO_TIER: dict[pb.Tier.ValueType, TierName] = {v: k for k, v in _TIER_TO_PB.items()}
_PHASE_TO_PB: dict[str, pb.Phase.ValueType] = {
    "resolve": pb.PHASE_RESOLVE,
    "download": pb.PHASE_DOWNLOAD,
    "verify": pb.PHASE_VERIFY,
    "publish": pb.PHASE_PUBLISH,
    "done": pb.PHASE_DONE,
}


def status_code_for(error: PrewarmError) -> grpc.StatusCode:
    for error_type, code in _STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: PrewarmError) -> NoReturn:
    await context.abort(status_code_for(error), str(error))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


class PrewarmServicer(pb_grpc.PrewarmServicer):
    def __init__(self, service: AgentService, *, socket_path: str) -> None:
        self._service = service
        self._socket_path = socket_path

    async def EnsureModel(
        self,
        request: pb.EnsureModelRequest,
        context: grpc.aio.ServicerContext[pb.EnsureModelRequest, pb.EnsureModelEvent],
    ) -> AsyncIterator[pb.EnsureModelEvent]:
        tier = _PB_TO_TIER.get(request.tier) if request.tier else None
        if request.tier and tier is None:
            await _abort(context, InvalidRequest(f"Unknown tier {request.tier}; use shm or disk."))
        yield pb.EnsureModelEvent(progress=pb.Progress(phase=pb.PHASE_RESOLVE))
        try:
            async for event in self._service.ensure(
                request.uri,
                tier=tier,
                include=list(request.include),
                exclude=list(request.exclude),
                client_name=request.client_name,
            ):
                if isinstance(event, PullProgress):
                    yield pb.EnsureModelEvent(progress=_progress(event))
                else:
                    yield pb.EnsureModelEvent(handle=_handle(event))
        except PrewarmError as exc:
            log.info("EnsureModel %s: %s", request.uri, exc)
            await _abort(context, exc)

    async def GetModel(
        self,
        request: pb.GetModelRequest,
        context: grpc.aio.ServicerContext[pb.GetModelRequest, pb.ModelInfo],
    ) -> pb.ModelInfo:
        try:
            return self._model_info(self._service.get(request.ref), with_files=True)
        except PrewarmError as exc:
            await _abort(context, exc)

    async def ListModels(
        self,
        request: pb.ListModelsRequest,
        context: grpc.aio.ServicerContext[pb.ListModelsRequest, pb.ListModelsResponse],
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(
            models=[self._model_info(m, with_files=False) for m in self._service.list_models()]
        )

    async def EvictModel(
        self,
        request: pb.EvictModelRequest,
        context: grpc.aio.ServicerContext[pb.EvictModelRequest, pb.EvictModelResponse],
    ) -> pb.EvictModelResponse:
        try:
            result = await self._service.evict(request.ref)
        except PrewarmError as exc:
            await _abort(context, exc)
        log.info(
            "evicted %s: %d snapshots, %d bytes",
            request.ref,
            len(result.evicted),
            result.bytes_freed,
        )
        return pb.EvictModelResponse(
            evicted=[self._model_info(m, with_files=False) for m in result.evicted],
            bytes_freed=result.bytes_freed,
        )

    async def Status(
        self,
        request: pb.StatusRequest,
        context: grpc.aio.ServicerContext[pb.StatusRequest, pb.StatusResponse],
    ) -> pb.StatusResponse:
        status = self._service.status()
        return pb.StatusResponse(
            version=status.version,
            tiers=[_tier_status(t) for t in status.tiers],
            pulls=[_pull_status(f) for f in status.pulls],
            model_count=status.model_count,
            uptime_seconds=status.uptime_seconds,
            data_plane=status.data_plane,
            socket_path=self._socket_path,
            default_tier=_TIER_TO_PB[status.default_tier],
        )

    def _model_info(self, model: CachedModel, *, with_files: bool) -> pb.ModelInfo:
        last_used, hits = self._service.usage(model.key)
        info = pb.ModelInfo(
            uri=model.uri,
            key=model.key,
            path=str(model.path),
            tier=_TIER_TO_PB[model.tier],
            total_bytes=model.total_bytes,
            file_count=len(model.files),
            created=_timestamp(model.created),
            last_used=_timestamp(last_used),
            hit_count=hits,
            include=model.include,
            exclude=model.exclude,
        )
        if with_files:
            info.files.extend(_files(model))
        return info


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _files(model: CachedModel) -> list[pb.FileEntry]:
    return [pb.FileEntry(path=f.path, size=f.size, etag=f.etag) for f in model.files]


def _progress(progress: PullProgress) -> pb.Progress:
    return pb.Progress(
        phase=_PHASE_TO_PB[progress.phase],
        bytes_done=progress.bytes_done,
        bytes_total=progress.bytes_total,
        files_done=progress.files_done,
        files_total=progress.files_total,
        key=progress.key,
    )


def _handle(result: EnsureResult) -> pb.ModelHandle:
    model, t = result.model, result.timings
    return pb.ModelHandle(
        uri=model.uri,
        key=model.key,
        path=str(model.path),
        tier=_TIER_TO_PB[model.tier],
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
    )


def _tier_status(usage: TierUsage) -> pb.TierStatus:
    return pb.TierStatus(
        tier=_TIER_TO_PB[usage.tier],
        root=str(usage.root),
        capacity_bytes=usage.capacity_bytes,
        used_bytes=usage.used_bytes,
        free_bytes=usage.free_bytes,
        model_count=usage.model_count,
    )


def _pull_status(flight: Flight) -> pb.PullStatus:
    return pb.PullStatus(
        uri=str(flight.snapshot.uri),
        key=flight.key,
        tier=_TIER_TO_PB[flight.tier],
        progress=_progress(flight.progress),
        waiters=flight.waiters,
        started=_timestamp(flight.started),
    )
