"""The asyncio client: the same calls as ``Client``, over a grpc.aio channel."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc

from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc

from . import _convert as convert
from ._errors import missing_handle, translate_rpc_error
from ._types import AgentStatus, EvictResult, ModelHandle, ModelInfo, Progress, TierName

__all__ = ["AsyncClient", "aensure"]


class AsyncClient:
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
    ) -> ModelHandle:
        """Make sure ``uri`` is cached on this node, pulling it if needed, and return it.

        ``progress`` is a plain function, called in the event loop for every progress event.
        """
        request = convert.ensure_request(
            uri, tier=tier, include=include, exclude=exclude, client_name=client_name
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

    async def get(self, ref: str) -> ModelInfo:
        """One cached model, by URI (its newest snapshot), key, or unique key prefix."""
        response = await self._unary(self._get_stub().GetModel, convert.get_request(ref))
        return convert.model_info_from_proto(response)

    async def list_models(self) -> list[ModelInfo]:
        """Every published snapshot on the node."""
        response = await self._unary(self._get_stub().ListModels, pb.ListModelsRequest())
        return [convert.model_info_from_proto(m) for m in response.models]

    async def evict(self, ref: str) -> EvictResult:
        """Remove a snapshot (by key) or every snapshot of a URI from the cache."""
        response = await self._unary(self._get_stub().EvictModel, convert.evict_request(ref))
        return convert.evict_result_from_proto(response)

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
