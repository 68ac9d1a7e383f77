"""The compile-cache RPCs, as a mixin of the gRPC servicer (see _api.PrewarmServicer)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from ._compile_cache import CompileCacheInfo, CompileCaches, EnsuredCompileCache
from ._compile_keys import CompileKeyParts
from ._exceptions import Conflict, PrewarmError
from ._proto.prewarm.v1 import prewarm_pb2 as pb

__all__ = ["CompileCacheApi", "parts_from_proto", "parts_to_proto"]

log = logging.getLogger(__name__)

_LOCK_STATE = {
    "waiting": pb.CompileLockEvent.STATE_WAITING,
    "granted": pb.CompileLockEvent.STATE_GRANTED,
}


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: PrewarmError) -> NoReturn:
    # _api imports this module for the mixin, so its status mapping is imported late.
    from ._api import status_code_for

    await context.abort(status_code_for(error), str(error))
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


def parts_from_proto(parts: pb.CompileKeyParts) -> CompileKeyParts:
    return CompileKeyParts(
        engine=parts.engine,
        engine_version=parts.engine_version,
        torch_version=parts.torch_version,
        triton_version=parts.triton_version,
        cuda_version=parts.cuda_version,
        gpu_name=parts.gpu_name,
        model_key=parts.model_key,
        tensor_parallel=parts.tensor_parallel,
        pipeline_parallel=parts.pipeline_parallel,
        data_parallel=parts.data_parallel,
        config_hash=parts.config_hash,
        extras=dict(parts.extras),
    )


def parts_to_proto(parts: CompileKeyParts) -> pb.CompileKeyParts:
    return pb.CompileKeyParts(
        engine=parts.engine,
        engine_version=parts.engine_version,
        torch_version=parts.torch_version,
        triton_version=parts.triton_version,
        cuda_version=parts.cuda_version,
        gpu_name=parts.gpu_name,
        model_key=parts.model_key,
        tensor_parallel=parts.tensor_parallel,
        pipeline_parallel=parts.pipeline_parallel,
        data_parallel=parts.data_parallel,
        config_hash=parts.config_hash,
        extras=dict(parts.extras),
    )


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _info(info: CompileCacheInfo) -> pb.CompileCacheInfo:
    message = pb.CompileCacheInfo(
        key=info.key,
        path=str(info.path),
        parts=parts_to_proto(info.parts),
        bytes=info.bytes,
        file_count=info.file_count,
        created=_timestamp(info.created),
        last_used=_timestamp(info.last_used),
        uploaded_digest=info.uploaded_digest,
        restored=info.restored,
    )
    if info.uploaded:
        message.uploaded.CopyFrom(_timestamp(info.uploaded))
    return message


def _handle(ensured: EnsuredCompileCache) -> pb.CompileCacheHandle:
    info = ensured.info
    return pb.CompileCacheHandle(
        key=info.key,
        path=str(info.path),
        env=ensured.env,
        restored=ensured.restored,
        restore_seconds=ensured.restore_seconds,
        restore_note=ensured.restore_note,
        parts=parts_to_proto(info.parts),
        bytes=info.bytes,
        file_count=info.file_count,
    )


class CompileCacheApi:
    """EnsureCompileCache, List/Evict/Push/PullCompileCache and CompileLock."""

    _compile_caches: CompileCaches | None

    def _caches(self) -> CompileCaches:
        if self._compile_caches is None:
            raise Conflict("This agent was started without compile caches.")
        return self._compile_caches

    async def EnsureCompileCache(
        self,
        request: pb.EnsureCompileCacheRequest,
        context: grpc.aio.ServicerContext[pb.EnsureCompileCacheRequest, pb.CompileCacheHandle],
    ) -> pb.CompileCacheHandle:
        try:
            ensured = await self._caches().ensure(
                parts_from_proto(request.parts),
                skip_restore=request.skip_restore,
                client_name=request.client_name,
            )
        except PrewarmError as exc:
            await _abort(context, exc)
        return _handle(ensured)

    async def ListCompileCaches(
        self,
        request: pb.ListCompileCachesRequest,
        context: grpc.aio.ServicerContext[
            pb.ListCompileCachesRequest, pb.ListCompileCachesResponse
        ],
    ) -> pb.ListCompileCachesResponse:
        try:
            caches = await self._caches().caches()
        except PrewarmError as exc:
            await _abort(context, exc)
        return pb.ListCompileCachesResponse(caches=[_info(c) for c in caches])

    async def EvictCompileCache(
        self,
        request: pb.EvictCompileCacheRequest,
        context: grpc.aio.ServicerContext[
            pb.EvictCompileCacheRequest, pb.EvictCompileCacheResponse
        ],
    ) -> pb.EvictCompileCacheResponse:
        try:
            evicted = await self._caches().evict(request.key)
        except PrewarmError as exc:
            await _abort(context, exc)
        return pb.EvictCompileCacheResponse(
            evicted=[_info(c) for c in evicted], bytes_freed=sum(c.bytes for c in evicted)
        )

    async def PushCompileCache(
        self,
        request: pb.PushCompileCacheRequest,
        context: grpc.aio.ServicerContext[pb.PushCompileCacheRequest, pb.PushCompileCacheResponse],
    ) -> pb.PushCompileCacheResponse:
        try:
            outcome = await self._caches().push(request.key)
        except PrewarmError as exc:
            await _abort(context, exc)
        return pb.PushCompileCacheResponse(
            uploaded=outcome.uploaded,
            uri=outcome.uri,
            digest=outcome.digest,
            bytes=outcome.bytes,
            skipped_reason=outcome.skipped_reason,
        )

    async def PullCompileCache(
        self,
        request: pb.PullCompileCacheRequest,
        context: grpc.aio.ServicerContext[pb.PullCompileCacheRequest, pb.CompileCacheHandle],
    ) -> pb.CompileCacheHandle:
        try:
            ensured = await self._caches().pull(request.key)
        except PrewarmError as exc:
            await _abort(context, exc)
        return _handle(ensured)

    async def CompileLock(
        self,
        request: pb.CompileLockRequest,
        context: grpc.aio.ServicerContext[pb.CompileLockRequest, pb.CompileLockEvent],
    ) -> AsyncIterator[pb.CompileLockEvent]:
        name = request.client_name or "anonymous"
        try:
            # aclosing: the lock passes on the moment this call ends, even when
            # gRPC cancels it because the pod went away.
            async with contextlib.aclosing(
                self._caches().hold_lock(parts_from_proto(request.parts), name)
            ) as events:
                async for event in events:
                    if event.state == "granted":
                        log.info("compile lock %s granted to %s", event.key, name)
                    yield pb.CompileLockEvent(
                        state=_LOCK_STATE[event.state],
                        key=event.key,
                        holder=event.holder,
                        warm=event.warm,
                    )
        except PrewarmError as exc:
            await _abort(context, exc)
