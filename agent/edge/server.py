"""The gRPC servers on the API socket and the tenants' sockets: servicers, health, interceptors.

The daemon claims the socket path early (``ApiServer.claim``, before anything
that could touch the cache), then serves inside ``ApiServer.serving`` once the
service is up, and calls ``drain`` when it is asked to stop: health turns
NOT_SERVING at once, and calls in progress get the grace period to end.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agent._proto.prewarm.v1 import prewarm_pb2, prewarm_pb2_grpc
from agent.compile.cache import CompileCaches
from agent.edge.connection_limits import connection_options
from agent.edge.interceptor import RequestObserver
from agent.edge.servicer import PrewarmServicer
from agent.edge.tenancy import TenantBinder
from agent.edge.unix_socket import (
    SocketDirectory,
    clear_stale_socket,
    owner_only_umask,
    socket_group_id,
)
from agent.service.access import Tenant
from agent.service.operations import AgentService

__all__ = ["SERVICE_NAME", "ApiServer", "ServerLimits", "TenantSocket"]

log = logging.getLogger("agent.daemon")

SERVICE_NAME = prewarm_pb2.DESCRIPTOR.services_by_name["Prewarm"].full_name


@dataclass(frozen=True, slots=True)
class TenantSocket:
    """One tenant's socket file: where it is, who may open it, and whose it is."""

    path: Path
    mode: int
    group: str
    # None on the API socket of an agent built without access rules (in-process tests).
    tenant: Tenant | None


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What every socket's server allows: the grace period, request size, open connections."""

    # How long calls in progress may take to end once the server stops.
    grace_seconds: float
    max_request_bytes: int = 4 * 1024**2
    # Per socket (see agent.edge.connection_limits).
    max_connections: int = 256


class ApiServer:
    """The Prewarm service, health and reflection on the API socket and each tenant's socket.

    ``api`` is the API socket (its mode and group secure the file; a group of
    "" keeps the daemon's); its tenant, the node's, is the requester of every
    request that comes in on it. Each of ``tenant_sockets`` gets a server of
    its own, so every request's tenant is the socket it arrived on.
    ``limits`` hold for every socket.
    """

    def __init__(
        self,
        api: TenantSocket,
        limits: ServerLimits,
        *,
        tenant_sockets: Sequence[TenantSocket] = (),
        compile_cache_uri: str | None = None,
    ) -> None:
        self._api = api
        self._limits = limits
        self._tenant_sockets = tuple(tenant_sockets)
        self._compile_cache_uri = compile_cache_uri
        self._health: list[health.aio.HealthServicer] = []

    @property
    def socket_path(self) -> Path:
        """The API socket's path."""
        return self._api.path

    @property
    def connection_capacity(self) -> int:
        """Connections every socket together may hold open (each socket's cap, summed)."""
        return self._limits.max_connections * len(self._sockets())

    def claim(self) -> None:
        """Check the groups and the paths now: refuse a live socket before any work starts.

        A second daemon on the same socket must fail before it resumes pulls
        or touches the cache the first one serves.
        """
        for socket in self._sockets():
            socket_group_id(socket.group)
            clear_stale_socket(socket.path, "the API")

    @contextlib.asynccontextmanager
    async def serving(
        self, service: AgentService, compile_caches: CompileCaches | None = None
    ) -> AsyncIterator[None]:
        """Serve until the block ends; then stop within the grace period and remove the sockets."""
        async with contextlib.AsyncExitStack() as stack:
            for socket in self._sockets():
                await stack.enter_async_context(self._serving_one(socket, service, compile_caches))
            yield

    async def drain(self) -> None:
        """Health answers NOT_SERVING from now on; calls in progress go on."""
        for servicer in self._health:
            await servicer.enter_graceful_shutdown()

    def _sockets(self) -> list[TenantSocket]:
        return [self._api, *self._tenant_sockets]

    @contextlib.asynccontextmanager
    async def _serving_one(
        self, socket: TenantSocket, service: AgentService, compile_caches: CompileCaches | None
    ) -> AsyncIterator[None]:
        path, tenant = socket.path, socket.tenant
        gid = socket_group_id(socket.group)
        clear_stale_socket(path, "the API")
        interceptors: list[grpc.aio.ServerInterceptor] = [RequestObserver(SERVICE_NAME)]
        if tenant is not None:
            interceptors.append(TenantBinder(SERVICE_NAME, tenant, self._compile_cache_uri))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", self._limits.max_request_bytes),
                *connection_options(self._limits.max_connections),
            ],
        )
        servicer = PrewarmServicer(
            service, socket_path=str(path), tenant=tenant, compile_caches=compile_caches
        )
        prewarm_pb2_grpc.add_PrewarmServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        directory = SocketDirectory(path)
        inode: int | None = None
        try:
            with owner_only_umask():
                server.add_insecure_port(f"unix:{directory.bind_address}")  # binds it now
            inode = directory.secure(socket.mode, gid)
            await server.start()
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            self._health.append(health_servicer)
            yield
        finally:
            if health_servicer in self._health:
                self._health.remove(health_servicer)
            try:
                await server.stop(self._limits.grace_seconds)
                directory.remove_own(inode)
            finally:
                directory.close()
