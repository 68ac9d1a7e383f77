"""The CSI node plugin: pods get a cached model (or their tenant's socket) as a csi volume.

NodePublishVolume asks the agent for the model on the socket of the pod's tenant
(so the agent checks it exactly as it checks that tenant's pods), holds a lease
on it for the pod, and binds the snapshot read-only at the kubelet's target path;
NodeUnpublishVolume unmounts it and ends the lease.

Each lease is held open on the agent's lease socket (``AsyncClient.leased``), as
a pod's own client holds one: it survives a restart of the agent (the hold takes
it back, or a new lease on the same cached snapshot), and it ends when the
plugin exits. Every volume has a record on disk (agent.csi.records), so when
the plugin starts again it holds the lease of each volume still mounted again
and forgets the volumes the kubelet took down meanwhile.

The plugin runs as root (it mounts) but holds no S3 credentials and reads no
model: everything about models goes through the agent's sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
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
    PrewarmError,
)
from agent._proto.csi.v1 import csi_pb2, csi_pb2_grpc
from agent.client import AsyncClient, ModelHandle
from agent.csi.mounts import (
    LOCKED_DOWN_OPTIONS,
    bind_read_only,
    make_private,
    mount_options,
    unmount,
)
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
# How long recovery waits between tries while the agent is not answering.
_RECOVERY_RETRY_SECONDS = 5.0


class CsiNode:
    """Publish and unpublish volumes; hold their leases; pick them up after a restart."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings.csi
        # The kubelet's directory as the kernel resolves it (it is often a link to a data disk).
        self.kubelet_dir = Path(os.path.realpath(self.settings.kubelet_dir))
        self._sockets = {"node": settings.socket_path} | {
            entry.name: entry.path for entry in settings.access.sockets
        }
        self.records = VolumeRecords(self.settings.state_dir)
        self._staging = self.settings.state_dir / "staging"
        self._locks: dict[str, asyncio.Lock] = {}
        self._holds: dict[str, contextlib.AsyncExitStack] = {}
        # The recovery of recorded volumes that serving_csi starts (None before it serves).
        self.recovery: asyncio.Task[None] | None = None

    async def aclose(self) -> None:
        """End every hold (the leases end with them) and take the staging area down."""
        for hold in list(self._holds.values()):
            await _end_hold(hold)
        self._holds.clear()
        await asyncio.to_thread(unmount, self._staging)

    def prepare(self) -> None:
        """The private staging area every read-only bind is made in first."""
        make_private(self._staging)

    # -- publish -------------------------------------------------------------------------

    async def publish(self, request: csi_pb2.NodePublishVolumeRequest) -> None:
        """Make the volume appear at its target; a repeat of a done publish does nothing."""
        volume_id = _volume_id(request.volume_id)
        if request.volume_capability.WhichOneof("access_type") != "mount":
            raise InvalidRequest("prewarm volumes are mount volumes (volumeMode: Filesystem)")
        ask = volume_ask(request.volume_context)
        pod = pod_of(request.volume_context)
        target = check_target(request.target_path, self.kubelet_dir)
        check_pod_owns_target(pod, target, self.kubelet_dir)
        async with self._lock(volume_id):
            if self._already_published(volume_id, target, ask):
                return
            tenant = tenant_for(pod, self.settings.tenants)
            if ask.kind == "socket":
                await self._publish_socket(volume_id, target, tenant, pod)
            else:
                await self._publish_model(volume_id, target, tenant=tenant, pod=pod, ask=ask)

    def _already_published(self, volume_id: str, target: Path, ask: VolumeAsk) -> bool:
        """True when the volume is done; False when it has to be made (again)."""
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
        options = mount_options(target)
        if options is not None and options >= LOCKED_DOWN_OPTIONS:
            return True
        # Cut short (a crash between its steps): undone, to be made whole again.
        unmount(target)
        self.records.drop(volume_id)
        return False

    async def _publish_socket(self, volume_id: str, target: Path, tenant: str, pod: Pod) -> None:
        if tenant == "node":
            raise AccessDenied(
                "socket volumes give a pod its tenant's socket; this namespace is mapped to the "
                "node's own API socket, which is for the node's admin only"
            )
        directory = _socket_directory(self._sockets[tenant], tenant)
        record = PublishedVolume(
            volume_id, str(target), "socket", tenant, "", str(directory), pod.client_name
        )
        await self._mount(record, directory, target)
        log.info("published the %s socket for %s at %s", tenant, pod.client_name, target)

    async def _publish_model(
        self, volume_id: str, target: Path, *, tenant: str, pod: Pod, ask: VolumeAsk
    ) -> None:
        hold = contextlib.AsyncExitStack()
        try:
            # A client per hold: its channel lives as long as the lease, and a new
            # volume never waits out the reconnect backoff of another's.
            client = await hold.enter_async_context(AsyncClient(self._sockets[tenant]))
            handle = await hold.enter_async_context(
                client.leased(
                    ask.uri,
                    tier=ask.tier,
                    include=ask.include,
                    exclude=ask.exclude,
                    client_name=pod.client_name,
                )
            )
            source = _snapshot_directory(handle)
            record = PublishedVolume(
                volume_id,
                str(target),
                "model",
                tenant,
                _ask_text(ask),
                str(source),
                pod.client_name,
            )
            await self._mount(record, source, target)
        except BaseException:
            await _shielded(_end_hold(hold))
            raise
        self._holds[volume_id] = hold
        log.info("published %s (%s) for %s at %s", ask.uri, handle.key, pod.client_name, target)

    async def _mount(self, record: PublishedVolume, source: Path, target: Path) -> None:
        """Record the volume, then bind ``source`` at ``target``; on failure undo both."""
        self.records.save(record)
        staging = self._staging / hashlib.sha256(record.volume_id.encode()).hexdigest()[:32]
        try:
            _make_target(target)
            # A thread, finished even when the call is cancelled: the mount and its undoing
            # must not overlap.
            await _shielded(asyncio.to_thread(bind_read_only, source, target, staging))
        except BaseException:
            await _shielded(asyncio.to_thread(_remove_target, target))
            self.records.drop(record.volume_id)
            raise

    # -- unpublish -----------------------------------------------------------------------

    async def unpublish(self, request: csi_pb2.NodeUnpublishVolumeRequest) -> None:
        """Unmount and remove the target, end the lease; a repeat finds nothing to do.

        Never waits on the agent: closing the hold's connection ends the lease
        whether or not the agent answers the release.
        """
        volume_id = _volume_id(request.volume_id)
        target = check_target(request.target_path, self.kubelet_dir)
        async with self._lock(volume_id):
            await asyncio.to_thread(_remove_target, target)
            record = self.records.get(volume_id)
            if record is not None and record.target != str(target):
                return  # another target of this id: the kubelet's call was for this one only
            hold = self._holds.pop(volume_id, None)
            if hold is not None:
                await _end_hold(hold)
            self.records.drop(volume_id)
        self._locks.pop(volume_id, None)

    # -- after a restart -----------------------------------------------------------------

    async def recover(self) -> None:
        """Hold the lease of every recorded volume still mounted again; forget the others.

        Runs once the plugin serves, retrying while the agent does not answer (it
        may be starting too); a volume unpublished meanwhile is left alone.
        """
        for record in self.records.all():
            async with self._lock(record.volume_id):
                await self._recover(record)

    async def _recover(self, record: PublishedVolume) -> None:
        target = Path(record.target)
        if self.records.get(record.volume_id) is None or record.volume_id in self._holds:
            return  # unpublished or published again since the list was read
        if mount_options(target) is None:
            log.info(
                "volume %s is no longer mounted at %s; forgetting it", record.volume_id, target
            )
            await asyncio.to_thread(_remove_target, target)
            self.records.drop(record.volume_id)
            return
        if record.kind != "model":
            return
        if record.tenant not in self._sockets:
            log.warning(
                "volume %s belongs to tenant %r, which the config no longer has; its lease is "
                "not held again",
                record.volume_id,
                record.tenant,
            )
            return
        while self.records.get(record.volume_id) is not None:
            try:
                await self._hold_again(record)
                return
            except AgentUnavailable as exc:
                log.info("volume %s: %s; trying again", record.volume_id, exc)
                await asyncio.sleep(_RECOVERY_RETRY_SECONDS)
            except PrewarmError as exc:
                log.warning(
                    "volume %s: its lease could not be held again: %s", record.volume_id, exc
                )
                return

    async def _hold_again(self, record: PublishedVolume) -> None:
        ask = json.loads(record.ask)
        hold = contextlib.AsyncExitStack()
        try:
            client = await hold.enter_async_context(AsyncClient(self._sockets[record.tenant]))
            handle = await hold.enter_async_context(
                client.leased(
                    ask["uri"],
                    tier=ask["tier"],
                    include=ask["include"],
                    exclude=ask["exclude"],
                    client_name=record.pod,
                    cached_only=True,  # the copy on the node, never a pull
                )
            )
        except BaseException:
            await _end_hold(hold)
            raise
        if str(handle.path) != record.source:
            await _end_hold(hold)
            log.warning(
                "volume %s: %s is no longer cached as the copy the pod mounted (%s); the pod "
                "keeps reading that copy, unleased, until it restarts",
                record.volume_id,
                ask["uri"],
                record.source,
            )
            return
        self._holds[record.volume_id] = hold

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


def _snapshot_directory(handle: ModelHandle) -> Path:
    """The snapshot's directory, if the path the agent answered reaches it without a link.

    The plugin mounts as root what this names: a link anywhere on the way (made by
    whoever could write the tier root) would bind another host directory into a pod.
    """
    path = handle.path
    if not path.is_absolute() or os.path.realpath(path) != str(path) or not path.is_dir():
        raise Conflict(
            f"the agent answered {str(path)[:200]!r}, which is not a directory reached without "
            "a link; nothing was mounted"
        )
    return path


def _socket_directory(socket_path: Path, tenant: str) -> Path:
    """The directory of the tenant's socket, if it holds that socket and nothing else.

    A socket volume binds the directory, not the socket: the agent makes its
    socket anew each time it starts, and a bound socket file would stay the old,
    dead one in every pod.
    """
    directory = socket_path.parent
    if os.path.realpath(directory) != str(directory):
        raise Conflict(f"the socket of tenant {tenant!r} is reached through a link; not mounted")
    try:
        entries = sorted(entry.name for entry in os.scandir(directory))
    except OSError as exc:
        raise Conflict(f"the socket directory of tenant {tenant!r}: {exc.strerror}") from exc
    if entries not in ([], [socket_path.name]):
        raise Conflict(
            f"a socket volume binds the directory of tenant {tenant!r}'s socket, and "
            f"{directory} holds other entries too; give the tenant's socket a directory of its "
            f'own ([[access.sockets]] path = "/run/prewarm/{tenant}/agent.sock")'
        )
    return directory


def _make_target(target: Path) -> None:
    """The target directory, made if the kubelet left it to the plugin (0750, root's)."""
    with contextlib.suppress(FileExistsError):
        target.mkdir(mode=0o750)
    if not target.is_dir() or target.is_symlink():
        raise InvalidRequest(f"target_path {target} is not a directory")


def _remove_target(target: Path) -> None:
    unmount(target)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        target.rmdir()


async def _end_hold(hold: contextlib.AsyncExitStack) -> None:
    """End a lease hold; the agent not answering the release is fine (the closed
    connection ends the lease)."""
    with contextlib.suppress(PrewarmError):
        await hold.aclose()


async def _shielded(work: Any) -> Any:
    """Finish ``work`` even if the call that started it is being cancelled."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


# -- gRPC --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _answered(context: Any, doing: str) -> AsyncIterator[None]:
    """What the kubelet sees of a failure: UNAVAILABLE while the agent does not answer (it
    retries), the error tree's status for a refusal, INTERNAL for a mount call that failed."""
    try:
        yield
    except AgentUnavailable as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    except PrewarmError as exc:
        await abort(context, exc)
    except OSError as exc:
        await context.abort(grpc.StatusCode.INTERNAL, f"could not {doing} the volume: {exc}")


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
        async with _answered(context, "mount"):
            await self._node.publish(request)
        return csi_pb2.NodePublishVolumeResponse()

    async def NodeUnpublishVolume(
        self, request: csi_pb2.NodeUnpublishVolumeRequest, context: Any
    ) -> csi_pb2.NodeUnpublishVolumeResponse:
        async with _answered(context, "unmount"):
            await self._node.unpublish(request)
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
    recorded volumes are recovered in the background once it serves."""
    node = CsiNode(settings)
    node.prepare()
    endpoint = settings.csi.endpoint
    endpoint.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    clear_stale_socket(endpoint, "the CSI plugin")
    server = grpc.aio.server()
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityServicer(settings.csi.driver_name), server)
    csi_pb2_grpc.add_NodeServicer_to_server(NodeServicer(node), server)
    directory = SocketDirectory(endpoint)
    inode: int | None = None
    try:
        with owner_only_umask():
            server.add_insecure_port(f"unix:{directory.bind_address}")
        inode = directory.secure(0o600, None)
        await server.start()
        node.recovery = asyncio.create_task(node.recover())
        log.info("CSI node plugin %s serving at %s", settings.csi.driver_name, endpoint)
        yield node
    finally:
        if node.recovery is not None:
            node.recovery.cancel()
        try:
            await server.stop(settings.shutdown_grace_seconds)
            directory.remove_own(inode)
        finally:
            directory.close()
            await node.aclose()
