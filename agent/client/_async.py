"""The asyncio client: the same calls as ``Client``, over a grpc.aio channel."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc

from agent._exceptions import AgentUnavailable, NotFound
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc

from . import _convert as convert
from ._compile import AsyncCompileMixin
from ._errors import granted_lease, missing_handle, translate_rpc_error
from ._hold import AsyncLeaseHold
from ._types import (
    AgentStatus,
    DataPlaneName,
    EvictResult,
    LeaseGrant,
    ModelHandle,
    ModelInfo,
    Progress,
    TierName,
    Verification,
)

__all__ = ["AsyncClient", "aensure"]


class AsyncClient(AsyncCompileMixin):
    """A connection to the prewarm agent on this node, for asyncio code.

    Arguments as for ``Client``. Use it with ``async with``, or ``await close()``.
    """

    def __init__(
        self, socket_path: str | os.PathLike[str] | None = None, *, timeout: float | None = None
    ) -> None:
        self._socket_path = convert.resolve_socket_path(socket_path)
        self._timeout = timeout
        # grpc.aio binds a channel to the running event loop, so it is made
        # on first use, inside the loop, not here.
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    @property
    def socket_path(self) -> Path:
        return self._socket_path

    def __repr__(self) -> str:
        return f"AsyncClient(socket_path={str(self._socket_path)!r}, timeout={self._timeout!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    def _get_stub(self) -> Any:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                convert.channel_target(self._socket_path), options=convert.CHANNEL_OPTIONS
            )
            self._stub = pb_grpc.PrewarmStub(self._channel)
        return self._stub

    async def ensure(
        self,
        uri: str,
        *,
        tier: TierName | None = None,
        include: Iterable[str] = (),
        exclude: Iterable[str] = (),
        client_name: str = "",
        progress: Callable[[Progress], None] | None = None,
        lease: bool = False,
        lease_ttl: float | None = None,
        pin: bool = False,
        strict_tier: bool = False,
        data_plane: DataPlaneName | None = None,
        concurrency: int | None = None,
        chunk_size: int | None = None,
    ) -> ModelHandle:
        """Make sure ``uri`` is cached on this node, pulling it if needed, and return it.

        ``progress`` is a plain function, called in the event loop for every
        progress event. The other options are those of ``Client.ensure``.
        """
        request = convert.ensure_request(
            uri,
            tier=tier,
            include=include,
            exclude=exclude,
            client_name=client_name,
            lease=lease,
            lease_ttl=lease_ttl,
            pin=pin,
            strict_tier=strict_tier,
            data_plane=data_plane,
            concurrency=concurrency,
            chunk_size=chunk_size,
        )
        call = self._get_stub().EnsureModel(request, timeout=self._timeout)
        handle: ModelHandle | None = None
        try:
            # Read to the end (see Client.ensure).
            async for event in call:
                got = convert.on_ensure_event(event, progress)
                if got is not None:
                    handle = got
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, self._socket_path) from exc
        finally:
            # Also runs on task cancellation; the agent keeps pulling for others.
            call.cancel()
        if handle is None:
            raise missing_handle(uri, self._socket_path)
        return handle

    @contextlib.asynccontextmanager
    async def leased(
        self,
        uri: str,
        *,
        tier: TierName | None = None,
        include: Iterable[str] = (),
        exclude: Iterable[str] = (),
        client_name: str = "",
        progress: Callable[[Progress], None] | None = None,
        lease_ttl: float | None = None,
        pin: bool = False,
        strict_tier: bool = False,
    ) -> AsyncIterator[ModelHandle]:
        """``ensure(uri, lease=True)``, with the lease held for the life of the block.

        ``async with client.leased(uri) as handle:``; see ``Client.leased``.
        """
        handle = await self.ensure(
            uri,
            tier=tier,
            include=include,
            exclude=exclude,
            client_name=client_name,
            progress=progress,
            lease=True,
            lease_ttl=lease_ttl,
            pin=pin,
            strict_tier=strict_tier,
        )
        grant = granted_lease(handle, self._socket_path)
        try:
            async with AsyncLeaseHold(
                grant,
                name=client_name,
                socket_path=convert.lease_socket_for(grant, self._socket_path),
                timeout=self._timeout or 5.0,
            ):
                yield handle
        finally:
            # As in Client.leased. On cancellation this release is cut short,
            # but the hold's connection is already closed, which ends the lease.
            with contextlib.suppress(NotFound, AgentUnavailable):
                await self.release_lease(grant.id)

    async def renew_lease(self, lease_id: str, ttl: float | None = None) -> LeaseGrant:
        """Extend a lease to ``ttl`` seconds from now; see ``Client.renew_lease``."""
        return convert.lease_from_proto(
            await self._unary(self._get_stub().RenewLease, convert.renew_request(lease_id, ttl))
        )

    async def release_lease(self, lease_id: str) -> None:
        """End a lease now."""
        await self._unary(self._get_stub().ReleaseLease, convert.release_request(lease_id))

    async def get(self, ref: str) -> ModelInfo:
        """One cached model, by URI (its newest snapshot), key, or unique key prefix."""
        response = await self._unary(self._get_stub().GetModel, convert.get_request(ref))
        return convert.model_info_from_proto(response)

    async def list_models(self) -> list[ModelInfo]:
        """Every published snapshot on the node."""
        response = await self._unary(self._get_stub().ListModels, pb.ListModelsRequest())
        return [convert.model_info_from_proto(m) for m in response.models]

    async def evict(self, ref: str, *, force: bool = False) -> EvictResult:
        """Remove a snapshot (by key) or every snapshot of a URI; see ``Client.evict``."""
        response = await self._unary(
            self._get_stub().EvictModel, convert.evict_request(ref, force=force)
        )
        return convert.evict_result_from_proto(response)

    async def pin(self, ref: str, pinned: bool = True) -> ModelInfo:
        """Pin a snapshot (``pinned=False``: unpin it); pressure never evicts a pinned one."""
        response = await self._unary(self._get_stub().PinModel, convert.pin_request(ref, pinned))
        return convert.model_info_from_proto(response)

    async def collect_garbage(self, tier: TierName | None = None) -> EvictResult:
        """Run an eviction pass now, on one tier or (None) both."""
        response = await self._unary(self._get_stub().CollectGarbage, convert.gc_request(tier))
        return convert.gc_result_from_proto(response)

    async def verify(
        self, ref: str | None = None, *, all: bool = False, report_only: bool = False
    ) -> list[Verification]:
        """Re-hash one cached model or every one; see ``Client.verify``."""
        request = convert.verify_request(ref, all=all, report_only=report_only)
        response = await self._unary(self._get_stub().VerifyModels, request)
        return convert.verifications_from_proto(response)

    async def status(self) -> AgentStatus:
        """Agent version, tiers, pulls in flight."""
        return convert.status_from_proto(
            await self._unary(self._get_stub().Status, pb.StatusRequest())
        )

    async def _unary(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, self._socket_path) from exc


async def aensure(
    uri: str,
    *,
    socket_path: str | os.PathLike[str] | None = None,
    tier: TierName | None = None,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    client_name: str = "",
    progress: Callable[[Progress], None] | None = None,
) -> ModelHandle:
    """Open an async client, ensure ``uri`` is cached, close the client.

    To bound the wait, wrap the call in ``asyncio.timeout()``.
    """
    async with AsyncClient(socket_path) as client:
        return await client.ensure(
            uri,
            tier=tier,
            include=include,
            exclude=exclude,
            client_name=client_name,
            progress=progress,
        )
