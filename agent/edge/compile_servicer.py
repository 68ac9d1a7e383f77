"""The compile-cache RPCs, as a mixin of the gRPC servicer (see agent.edge.servicer).

Every call runs in the caller's compile scope: a tenant socket's requests make,
see, lock, pull, push and report only the caches of its own compile domain
(another domain's key is NOT_FOUND, as a key that does not exist); the node's
API socket sees every domain and makes its own caches in ``node``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from agent._exceptions import Conflict
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._wire import parts_from_proto, parts_to_proto, timestamp_to_proto
from agent.compile.cache import (
    NODE_SCOPE,
    CompactOutcome,
    CompileCacheReport,
    CompileCaches,
    EnsuredCompileCache,
    PushOutcome,
    Scope,
)
from agent.compile.verdict import Verdict
from agent.compile.why import Nearest
from agent.service.access import NODE_TENANT, Tenant

__all__ = ["CompileCacheApi"]

log = logging.getLogger(__name__)

_LOCK_STATE = {
    "waiting": pb.CompileLockEvent.STATE_WAITING,
    "granted": pb.CompileLockEvent.STATE_GRANTED,
}


def compile_scope(tenant: Tenant | None) -> Scope:
    """The compile scope of a socket's requests: its tenant's domain, or the node's."""
    if tenant is None or tenant.name == NODE_TENANT:
        return NODE_SCOPE
    return Scope(tenant.compile_domain or tenant.name)


def _info(info: CompileCacheReport) -> pb.CompileCacheInfo:
    message = pb.CompileCacheInfo(
        domain=info.domain,
        key=info.key,
        path=str(info.path),
        parts=parts_to_proto(info.parts),
        bytes=info.bytes,
        file_count=info.file_count,
        created=timestamp_to_proto(info.created),
        last_used=timestamp_to_proto(info.last_used),
        uploaded_digest=info.uploaded_digest,
        restored=info.restored,
        publish_on_ready=info.publish_on_ready,
        signed_by=info.signed_by,
    )
    if info.uploaded:
        message.uploaded.CopyFrom(timestamp_to_proto(info.uploaded))
    if info.last_verdict is not None:
        message.last_verdict.CopyFrom(_verdict(info.last_verdict))
    return message


def _verdict(verdict: Verdict) -> pb.CompileVerdict:
    return pb.CompileVerdict(
        verdict=verdict.verdict,
        grown=[
            pb.SubCacheGrowth(sub_cache=sub, files_added=files, bytes_added=size)
            for sub, (files, size) in sorted(verdict.grown.items())
        ],
        at=timestamp_to_proto(verdict.at),
        client_name=verdict.client,
    )


def _push(outcome: PushOutcome) -> pb.PushCompileCacheResponse:
    return pb.PushCompileCacheResponse(
        uploaded=outcome.uploaded,
        uri=outcome.uri,
        digest=outcome.digest,
        bytes=outcome.bytes,
        skipped_reason=outcome.skipped_reason,
    )


def _nearest(nearest: Nearest) -> pb.CompileNearest:
    return pb.CompileNearest(
        key=nearest.key,
        location=nearest.location,
        signed_by=nearest.signed_by,
        changes=[
            pb.CompileKeyChange(part=c.name, cached=c.cached, wanted=c.wanted)
            for c in nearest.changes
        ],
        summary=nearest.describe(),
    )


def _compaction(outcome: CompactOutcome) -> pb.CompactCompileCacheResponse:
    return pb.CompactCompileCacheResponse(
        compacted=outcome.compacted,
        uri=outcome.uri,
        archives_before=outcome.archives_before,
        retired_deleted=outcome.retired_deleted,
        skipped_reason=outcome.skipped_reason,
        archive_bytes=outcome.archive_bytes,
    )


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
    """EnsureCompileCache, List/Evict/Push/Pull/Explain/CompactCompileCache, CompileLock and
    CompileReady."""

    _compile_caches: CompileCaches | None
    _tenant: Tenant | None

    def _caches(self) -> CompileCaches:
        if self._compile_caches is None:
            raise Conflict("This agent was started without compile caches.")
        return self._compile_caches

    async def EnsureCompileCache(
        self,
        request: pb.EnsureCompileCacheRequest,
        context: grpc.aio.ServicerContext[pb.EnsureCompileCacheRequest, pb.CompileCacheHandle],
    ) -> pb.CompileCacheHandle:
        """The compile cache for the request's parts in the caller's scope, restored if asked."""
        ensured = await self._caches().ensure(
            parts_from_proto(request.parts),
            scope=compile_scope(self._tenant),
            skip_restore=request.skip_restore,
            client_name=request.client_name,
            publish_on_ready=request.publish_on_ready,
        )
        return _handle(ensured)

    async def CompileReady(
        self,
        request: pb.CompileReadyRequest,
        context: grpc.aio.ServicerContext[pb.CompileReadyRequest, pb.CompileReadyResponse],
    ) -> pb.CompileReadyResponse:
        """A compile finished: record its verdict and, if uploads are on, push the cache."""
        ready = await self._caches().ready(
            request.key,
            request.client_name,
            scope=compile_scope(self._tenant),
            launch_phases=dict(request.launch_phases),
        )
        response = pb.CompileReadyResponse(key=ready.key, verdict=_verdict(ready.verdict))
        if ready.nearest is not None:
            response.nearest.CopyFrom(_nearest(ready.nearest))
        if ready.push is not None:
            response.upload.CopyFrom(_push(ready.push))
        else:
            response.upload.CopyFrom(
                pb.PushCompileCacheResponse(skipped_reason="uploads are off on this agent")
            )
        return response

    async def ListCompileCaches(
        self,
        request: pb.ListCompileCachesRequest,
        context: grpc.aio.ServicerContext[
            pb.ListCompileCachesRequest, pb.ListCompileCachesResponse
        ],
    ) -> pb.ListCompileCachesResponse:
        """The compile caches of the caller's scope."""
        caches = await self._caches().caches(compile_scope(self._tenant))
        return pb.ListCompileCachesResponse(caches=[_info(c) for c in caches])

    async def EvictCompileCache(
        self,
        request: pb.EvictCompileCacheRequest,
        context: grpc.aio.ServicerContext[
            pb.EvictCompileCacheRequest, pb.EvictCompileCacheResponse
        ],
    ) -> pb.EvictCompileCacheResponse:
        """Evict a compile cache of the caller's scope (node socket only)."""
        evicted = await self._caches().evict(request.key, compile_scope(self._tenant))
        return pb.EvictCompileCacheResponse(
            evicted=[_info(c) for c in evicted], bytes_freed=sum(c.bytes for c in evicted)
        )

    async def PushCompileCache(
        self,
        request: pb.PushCompileCacheRequest,
        context: grpc.aio.ServicerContext[pb.PushCompileCacheRequest, pb.PushCompileCacheResponse],
    ) -> pb.PushCompileCacheResponse:
        """Upload a compile cache of the caller's scope to S3."""
        outcome = await self._caches().push(request.key, compile_scope(self._tenant))
        return _push(outcome)

    async def PullCompileCache(
        self,
        request: pb.PullCompileCacheRequest,
        context: grpc.aio.ServicerContext[pb.PullCompileCacheRequest, pb.CompileCacheHandle],
    ) -> pb.CompileCacheHandle:
        """Restore a compile cache of the caller's scope from S3."""
        ensured = await self._caches().pull(request.key, compile_scope(self._tenant))
        return _handle(ensured)

    async def ExplainCompileCache(
        self,
        request: pb.ExplainCompileCacheRequest,
        context: grpc.aio.ServicerContext[
            pb.ExplainCompileCacheRequest, pb.ExplainCompileCacheResponse
        ],
    ) -> pb.ExplainCompileCacheResponse:
        """The nearest other key of a cache's model in the caller's scope, and what differs."""
        why = await self._caches().explain(request.key, compile_scope(self._tenant))
        response = pb.ExplainCompileCacheResponse(key=why.key, s3_note=why.s3_note)
        if why.nearest is not None:
            response.nearest.CopyFrom(_nearest(why.nearest))
        return response

    async def CompactCompileCache(
        self,
        request: pb.CompactCompileCacheRequest,
        context: grpc.aio.ServicerContext[
            pb.CompactCompileCacheRequest, pb.CompactCompileCacheResponse
        ],
    ) -> pb.CompactCompileCacheResponse:
        """Make a key's archives in S3 (of the caller's scope) one archive."""
        outcome = await self._caches().compact(request.key, compile_scope(self._tenant))
        return _compaction(outcome)

    async def CompileLock(
        self,
        request: pb.CompileLockRequest,
        context: grpc.aio.ServicerContext[pb.CompileLockRequest, pb.CompileLockEvent],
    ) -> AsyncIterator[pb.CompileLockEvent]:
        """Hold the node lock on a compile key: waiting, then granted, until the call ends."""
        name = request.client_name or "anonymous"
        # aclosing: the lock passes on the moment this call ends, even when
        # gRPC cancels it because the pod went away.
        async with contextlib.aclosing(
            self._caches().hold_lock(
                parts_from_proto(request.parts), name, compile_scope(self._tenant)
            )
        ) as events:
            async for event in events:
                if event.state == "granted":
                    log.info("compile lock %s granted to %s", event.key, name)
                yield pb.CompileLockEvent(
                    state=_LOCK_STATE[event.state],
                    # Locks are named <domain>/<key>; the pod knows its key alone.
                    key=event.key.rpartition("/")[2],
                    holder=event.holder,
                    warm=event.warm,
                )
