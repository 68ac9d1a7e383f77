"""The CSI node plugin: pods get a cached model (or the agent's socket) as a csi volume.

NodePublishVolume asks the agent for the model on the socket of the pod's tenant
(so the agent checks it exactly as it checks that tenant's pods), with a lease
for the pod, and binds the snapshot read-only at the kubelet's target path;
NodeUnpublishVolume unmounts it and releases the lease. Leases are renewed every
third of their TTL while the volume is published, and every volume has a record
on disk (agent.csi.records), so a restart of the plugin or of the agent loses
neither: ``recover`` renews what is still mounted and cleans up what is not.

The plugin runs as root (it mounts) but holds no S3 credentials and reads no
model: everything about models goes through the agent's sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import wrappers_pb2

from agent import __version__
from agent._config import Settings
from agent._exceptions import (
    AccessDenied,
    AgentUnavailable,
    Conflict,
    InvalidRequest,
    NotFound,
    PrewarmError,
)
from agent._proto.csi.v1 import csi_pb2, csi_pb2_grpc
from agent.client import AsyncClient
from agent.csi.mounts import bind_read_only, is_mount_point, mount_socket, unmount
from agent.csi.records import PublishedVolume, VolumeRecords
from agent.csi.volumes import (
    Pod,
    VolumeAsk,
    check_pod_owns_target,
    check_target,
    pod_of,
    tenant_for,
    volume_ask,
)
from agent.edge.status import abort
from agent.edge.unix_socket import SocketDirectory, clear_stale_socket, owner_only_umask

__all__ = ["CsiNode", "serving_csi"]

log = logging.getLogger(__name__)
_MAX_VOLUME_ID = 256


class CsiNode:
    """Publish and unpublish volumes; keep their leases; pick them up after a restart."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings.csi
        self._sockets = {"node": settings.socket_path} | {
            entry.name: entry.path for entry in settings.access.sockets
        }
        self.records = VolumeRecords(self.settings.state_dir)
        self._locks: dict[str, asyncio.Lock] = {}

    # -- publish -------------------------------------------------------------------------

    async def publish(self, request: csi_pb2.NodePublishVolumeRequest) -> None:
        """Make the volume appear at its target; a repeat of a done publish does nothing."""
        volume_id = _volume_id(request.volume_id)
        if request.volume_capability.WhichOneof("access_type") != "mount":
            raise InvalidRequest("prewarm volumes are mount volumes (volumeMode: Filesystem)")
        ask = volume_ask(request.volume_context)
        pod = pod_of(request.volume_context)
        target = check_target(request.target_path, self.settings.kubelet_dir)
        check_pod_owns_target(pod, target, self.settings.kubelet_dir)
        async with self._lock(volume_id):
            if self._already_published(volume_id, target, ask):
                return
            tenant = tenant_for(pod, self.settings.tenants)
            if ask.kind == "socket":
                await self._publish_socket(volume_id, target, tenant, pod)
            else:
                await self._publish_model(volume_id, target, tenant=tenant, pod=pod, ask=ask)

    def _already_published(self, volume_id: str, target: Path, ask: VolumeAsk) -> bool:
        record = self.records.get(volume_id)
        if record is None:
            return False
        if record.target != str(target):
            raise Conflict(
                f"volume {volume_id!r} is published at {record.target} already; a prewarm volume "
                "is published at one target"
            )
        if record.ask != _ask_text(ask):
            raise Conflict(f"volume {volume_id!r} is published with other attributes already")
        return is_mount_point(target)  # not mounted: a publish cut short, made again

    async def _publish_socket(self, volume_id: str, target: Path, tenant: str, pod: Pod) -> None:
        if tenant == "node":
            raise AccessDenied(
                "socket volumes give a pod its tenant's socket; this namespace is mapped to the "
                "node's own API socket, which is for the node's admin only"
            )
        socket_path = self._sockets[tenant]
        record = PublishedVolume(
            volume_id, str(target), "socket", tenant, "", str(socket_path), pod=pod.client_name
        )
        self.records.save(record)
        _make_target(target)
        await asyncio.to_thread(mount_socket, socket_path, target)
        log.info("published the %s socket for %s at %s", tenant, pod.client_name, target)

    async def _publish_model(
        self, volume_id: str, target: Path, *, tenant: str, pod: Pod, ask: VolumeAsk
    ) -> None:
        async with AsyncClient(self._sockets[tenant]) as client:
            handle = await client.ensure(
                ask.uri,
                tier=ask.tier,
                include=ask.include,
                exclude=ask.exclude,
                lease=True,
                lease_ttl=self.settings.lease_seconds,
                client_name=pod.client_name,
            )
            assert handle.lease is not None  # asked for
            record = PublishedVolume(
                volume_id,
                str(target),
                "model",
                tenant,
                _ask_text(ask),
                str(handle.path),
                handle.lease.id,
                pod.client_name,
            )
            try:
                self.records.save(record)
                _make_target(target)
                await asyncio.to_thread(bind_read_only, handle.path, target)
            except BaseException:
                await _shielded(self._forget(record, client))
                raise
        log.info("published %s (%s) for %s at %s", ask.uri, handle.key, pod.client_name, target)

    # -- unpublish -----------------------------------------------------------------------

    async def unpublish(self, request: csi_pb2.NodeUnpublishVolumeRequest) -> None:
        """Unmount, remove the target, release the lease; a repeat finds nothing to do."""
        volume_id = _volume_id(request.volume_id)
        target = check_target(request.target_path, self.settings.kubelet_dir)
        async with self._lock(volume_id):
            record = self.records.get(volume_id)
            if record is not None and record.target != str(target):
                raise NotFound(f"volume {volume_id!r} is not published at {target}")
            await asyncio.to_thread(_remove_target, target)
            if record is not None:
                await self._release(record)
                self.records.drop(volume_id)

    async def _release(self, record: PublishedVolume) -> None:
        if not record.lease_id:
            return
        async with AsyncClient(self._sockets[record.tenant]) as client:
            await self._forget(record, client)

    async def _forget(self, record: PublishedVolume, client: AsyncClient) -> None:
        """Release the record's lease (already gone is fine) and drop the record."""
        if record.lease_id:
            with contextlib.suppress(NotFound):
                await client.release_lease(record.lease_id)
        self.records.drop(record.volume_id)

    # -- leases across time and restarts -------------------------------------------------

    async def recover(self) -> None:
        """After a restart: a recorded volume still mounted keeps its lease; one the
        kubelet took down meanwhile loses its record and its lease."""
        for record in self.records.all():
            target = Path(record.target)
            if await asyncio.to_thread(is_mount_point, target):
                continue
            log.info("volume %s is no longer mounted at %s; releasing it", record.volume_id, target)
            try:
                await asyncio.to_thread(_remove_target, target)
                await self._release(record)
            except PrewarmError as exc:
                log.warning("could not release volume %s yet: %s", record.volume_id, exc)
            else:
                self.records.drop(record.volume_id)

    async def renew_leases(self) -> None:
        """Renew every published model's lease; one the agent lost is taken again."""
        for record in self.records.all():
            if not record.lease_id:
                continue
            try:
                async with AsyncClient(self._sockets[record.tenant]) as client:
                    await self._renew(record, client)
            except PrewarmError as exc:
                log.warning("could not renew the lease of volume %s: %s", record.volume_id, exc)

    async def _renew(self, record: PublishedVolume, client: AsyncClient) -> None:
        try:
            await client.renew_lease(record.lease_id, self.settings.lease_seconds)
            return
        except NotFound:
            pass  # expired while nobody renewed (the plugin or the agent was down)
        ask = json.loads(record.ask)
        handle = await client.ensure(
            ask["uri"],
            tier=ask["tier"],
            include=ask["include"],
            exclude=ask["exclude"],
            lease=True,
            lease_ttl=self.settings.lease_seconds,
            client_name=record.pod,
        )
        assert handle.lease is not None
        if str(handle.path) != record.source:
            log.warning(
                "volume %s: its lease had expired and %s is now at %s; the pod keeps the copy it "
                "mounted until it restarts",
                record.volume_id,
                ask["uri"],
                handle.path,
            )
        self.records.save(
            PublishedVolume(
                record.volume_id,
                record.target,
                record.kind,
                record.tenant,
                record.ask,
                record.source,
                handle.lease.id,
                record.pod,
            )
        )

    async def keep_leases(self) -> None:
        """Renew leases every third of their TTL, for as long as the plugin runs."""
        while True:
            await asyncio.sleep(self.settings.lease_seconds / 3)
            await self.renew_leases()

    def _lock(self, volume_id: str) -> asyncio.Lock:
        return self._locks.setdefault(volume_id, asyncio.Lock())


def _volume_id(volume_id: str) -> str:
    if not volume_id or len(volume_id) > _MAX_VOLUME_ID or "\x00" in volume_id:
        raise InvalidRequest(f"volume_id must be 1 to {_MAX_VOLUME_ID} characters, without NUL")
    return volume_id


def _ask_text(ask: VolumeAsk) -> str:
    if ask.kind == "socket":
        return ""
    return json.dumps(
        {"uri": ask.uri, "include": ask.include, "exclude": ask.exclude, "tier": ask.tier},
        sort_keys=True,
    )


def _make_target(target: Path) -> None:
    """The target directory, made if the kubelet left it to the plugin (0750, root's)."""
    with contextlib.suppress(FileExistsError):
        target.mkdir(mode=0o750)
    if not target.is_dir() or target.is_symlink():
        raise InvalidRequest(f"target_path {target} is not a directory")


def _remove_target(target: Path) -> None:
    unmount(target)
    with contextlib.suppress(FileNotFoundError):
        target.rmdir()


async def _shielded(work: Any) -> None:
    """Finish ``work`` even if the call that started it is being cancelled."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


# -- gRPC --------------------------------------------------------------------------------


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    """Who the plugin is: the driver's name and version, no controller, always ready."""

    def __init__(self, driver_name: str) -> None:
        self._name = driver_name

    async def GetPluginInfo(
        self, request: csi_pb2.GetPluginInfoRequest, context: Any
    ) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=self._name, vendor_version=__version__)

    async def GetPluginCapabilities(
        self, request: csi_pb2.GetPluginCapabilitiesRequest, context: Any
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        return csi_pb2.GetPluginCapabilitiesResponse()  # a node plugin only

    async def Probe(self, request: csi_pb2.ProbeRequest, context: Any) -> csi_pb2.ProbeResponse:
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))


class NodeServicer(csi_pb2_grpc.NodeServicer):
    """Publish and unpublish through ``CsiNode``; refusals become CSI status codes."""

    def __init__(self, node: CsiNode) -> None:
        self._node = node

    async def NodePublishVolume(
        self, request: csi_pb2.NodePublishVolumeRequest, context: Any
    ) -> csi_pb2.NodePublishVolumeResponse:
        try:
            await self._node.publish(request)
        except AgentUnavailable as exc:  # the kubelet retries: the agent may be starting
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except PrewarmError as exc:
            await abort(context, exc)
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"could not mount the volume: {exc}")
        return csi_pb2.NodePublishVolumeResponse()

    async def NodeUnpublishVolume(
        self, request: csi_pb2.NodeUnpublishVolumeRequest, context: Any
    ) -> csi_pb2.NodeUnpublishVolumeResponse:
        try:
            await self._node.unpublish(request)
        except AgentUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except PrewarmError as exc:
            await abort(context, exc)
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"could not unmount the volume: {exc}")
        return csi_pb2.NodeUnpublishVolumeResponse()

    async def NodeGetCapabilities(
        self, request: csi_pb2.NodeGetCapabilitiesRequest, context: Any
    ) -> csi_pb2.NodeGetCapabilitiesResponse:
        return csi_pb2.NodeGetCapabilitiesResponse()  # publish/unpublish only

    async def NodeGetInfo(
        self, request: csi_pb2.NodeGetInfoRequest, context: Any
    ) -> csi_pb2.NodeGetInfoResponse:
        node_id = self._node.settings.node_id or socket.gethostname()
        return csi_pb2.NodeGetInfoResponse(node_id=node_id)


@contextlib.asynccontextmanager
async def serving_csi(settings: Settings) -> AsyncIterator[CsiNode]:
    """Serve Identity and Node on ``[csi].endpoint`` (root only, 0600) until the block ends;
    recorded volumes are recovered first and their leases kept renewed meanwhile."""
    node = CsiNode(settings)
    await node.recover()
    await node.renew_leases()
    endpoint = settings.csi.endpoint
    endpoint.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    clear_stale_socket(endpoint, "the CSI plugin")
    server = grpc.aio.server()
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityServicer(settings.csi.driver_name), server)
    csi_pb2_grpc.add_NodeServicer_to_server(NodeServicer(node), server)
    directory = SocketDirectory(endpoint)
    inode: int | None = None
    renewing = asyncio.create_task(node.keep_leases())
    try:
        with owner_only_umask():
            server.add_insecure_port(f"unix:{directory.bind_address}")
        inode = directory.secure(0o600, None)
        await server.start()
        log.info("CSI node plugin %s serving at %s", settings.csi.driver_name, endpoint)
        yield node
    finally:
        renewing.cancel()
        try:
            await server.stop(settings.shutdown_grace_seconds)
            directory.remove_own(inode)
        finally:
            directory.close()
