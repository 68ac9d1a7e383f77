"""The gRPC server on the API socket: servicers, health, reflection, the interceptor.

The daemon claims the socket path early (``ApiServer.claim``, before anything
that could touch the cache), then serves inside ``ApiServer.serving`` once the
service is up, and calls ``drain`` when it is asked to stop: health turns
NOT_SERVING at once, and calls in progress get the grace period to end.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from agent._proto.prewarm.v1 import prewarm_pb2, prewarm_pb2_grpc
from agent.compile.cache import CompileCaches
from agent.edge.interceptor import RequestObserver
from agent.edge.servicer import PrewarmServicer
from agent.edge.unix_socket import (
    clear_stale_socket,
    owner_only_umask,
    remove_own_socket,
    secure_socket,
    socket_group_id,
)
from agent.service.operations import AgentService

__all__ = ["SERVICE_NAME", "ApiServer"]

log = logging.getLogger("agent.daemon")

SERVICE_NAME = prewarm_pb2.DESCRIPTOR.services_by_name["Prewarm"].full_name


class ApiServer:
    """The Prewarm service, health and reflection on one Unix socket.

    ``mode`` and ``group`` (a group name; empty keeps the daemon's) secure the
    socket file; ``grace_seconds`` is how long calls in progress may take to
    end once the server stops.
    """

    def __init__(self, socket_path: Path, mode: int, group: str, grace_seconds: float) -> None:
        self._path = Path(socket_path)
        self._mode = mode
        self._group = group
        self._grace_seconds = grace_seconds
        self._health: health.aio.HealthServicer | None = None

    @property
    def socket_path(self) -> Path:
        return self._path

    def claim(self) -> None:
        """Check the group and the path now: refuse a live socket before any work starts.

        A second daemon on the same socket must fail before it resumes pulls
        or touches the cache the first one serves.
        """
        socket_group_id(self._group)
        clear_stale_socket(self._path, "the API")

    @contextlib.asynccontextmanager
    async def serving(
        self, service: AgentService, compile_caches: CompileCaches | None = None
    ) -> AsyncIterator[None]:
        """Serve until the block ends; then stop within the grace period and remove the socket."""
        gid = socket_group_id(self._group)
        clear_stale_socket(self._path, "the API")
        server = grpc.aio.server(interceptors=[RequestObserver(SERVICE_NAME)])
        servicer = PrewarmServicer(
            service, socket_path=str(self._path), compile_caches=compile_caches
        )
        prewarm_pb2_grpc.add_PrewarmServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        inode: int | None = None
        try:
            with owner_only_umask():
                server.add_insecure_port(f"unix:{self._path}")  # binds the socket now
            inode = self._path.stat().st_ino
            await server.start()
            secure_socket(self._path, self._mode, gid)
            for name in ("", SERVICE_NAME):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            self._health = health_servicer
            yield
        finally:
            self._health = None
            await server.stop(self._grace_seconds)
            remove_own_socket(self._path, inode)

    async def drain(self) -> None:
        """Health answers NOT_SERVING from now on; calls in progress go on."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
