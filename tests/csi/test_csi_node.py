"""The CSI node plugin end to end: the real agent, the plugin's Identity and Node services over
a real Unix socket, real bind mounts under a stand-in kubelet directory (issue 26).

Every test checks what a pod would see at the target path, and what the agent holds (the
lease) before and after: no failure may leave a mount or a lease behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from agent._config import Settings, load_settings
from agent._proto.csi.v1 import csi_pb2, csi_pb2_grpc
from agent.client import Client, wait_for_agent
from agent.csi import serving_csi
from agent.csi.mounts import LOCKED_DOWN_OPTIONS, is_mount_point, mount_options, unmount
from agent.testing import AgentProcess, SampleModel

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root (CI runs as root)")

DRIVER = "csi.prewarm.io"


@dataclass
class Node:
    """A stand-in node: the agent, the kubelet's directory, the plugin's settings."""

    agent: AgentProcess
    kubelet: Path
    settings: Settings
    tenant_socket: Path

    def target(self, pod_uid: str, volume: str = "model") -> Path:
        return self.kubelet / "pods" / pod_uid / "volumes" / "kubernetes.io~csi" / volume / "mount"


@pytest.fixture
def node(start_agent_process: object, small_model: SampleModel, tmp_path: Path) -> Iterator[Node]:
    """An agent with tenant team-a (its own bucket only), and [csi] mapping namespace team-a."""
    kubelet = tmp_path / "kubelet"
    (kubelet / "pods").mkdir(parents=True)
    tenant_socket = tmp_path / "sockets" / "team-a.sock"
    tenant_socket.parent.mkdir()
    config = (
        f'[[access.sockets]]\nname = "team-a"\npath = "{tenant_socket}"\nmode = "0660"\n'
        f'sources = ["s3://{small_model.bucket}/*"]\n\n'
        f'[csi]\nendpoint = "{tmp_path / "plugin" / "csi.sock"}"\nkubelet_dir = "{kubelet}"\n'
        f'state_dir = "{tmp_path / "csi-state"}"\nnode_id = "node-1"\n\n'
        '[[csi.tenants]]\ntenant = "team-a"\nnamespaces = ["team-a"]\n'
    )
    agent = start_agent_process(config)  # type: ignore[operator]
    settings = load_settings(agent.config_path).model_copy(
        update={"socket_path": agent.socket_path}
    )
    yield Node(agent, kubelet, settings, tenant_socket)
    for mounted in sorted(kubelet.rglob("mount"), reverse=True):  # never leave a mount behind
        with contextlib.suppress(OSError):
            unmount(mounted)


@contextlib.asynccontextmanager
async def plugin(
    node: Node,
) -> AsyncIterator[tuple[csi_pb2_grpc.IdentityAsyncStub, csi_pb2_grpc.NodeAsyncStub]]:
    """The plugin serving on its endpoint, and stubs that talk to it there."""
    async with (
        serving_csi(node.settings) as plugin_node,
        grpc.aio.insecure_channel(f"unix:{node.settings.csi.endpoint}") as channel,
    ):
        assert plugin_node.recovery is not None
        await plugin_node.recovery  # recorded volumes settled before the test looks
        # On an aio channel the generated stubs are the async ones (the .pyi says so).
        yield csi_pb2_grpc.IdentityStub(channel), csi_pb2_grpc.NodeStub(channel)


def publish_request(
    node: Node,
    pod_uid: str,
    attributes: dict[str, str],
    *,
    namespace: str = "team-a",
    volume: str = "model",
) -> csi_pb2.NodePublishVolumeRequest:
    context = {
        "csi.storage.k8s.io/pod.namespace": namespace,
        "csi.storage.k8s.io/pod.name": "vllm-0",
        "csi.storage.k8s.io/pod.uid": pod_uid,
        "csi.storage.k8s.io/serviceAccount.name": "default",
        "csi.storage.k8s.io/ephemeral": "true",
    } | attributes
    capability = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(),
        access_mode=csi_pb2.VolumeCapability.AccessMode(
            mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
        ),
    )
    target = node.target(pod_uid, volume)
    target.parent.mkdir(parents=True, exist_ok=True)
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=f"csi-{pod_uid}-{volume}",
        target_path=str(target),
        volume_capability=capability,
        volume_context=context,
    )


def unpublish_request(
    request: csi_pb2.NodePublishVolumeRequest,
) -> csi_pb2.NodeUnpublishVolumeRequest:
    return csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=request.volume_id, target_path=request.target_path
    )


def occupy(target: Path) -> None:
    """Put a plain file where the volume's directory should be."""
    target.write_bytes(b"")


def endpoint_mode(node: Node) -> int | None:
    """The plugin socket's permission bits (None: no socket)."""
    try:
        return node.settings.csi.endpoint.stat().st_mode & 0o777
    except FileNotFoundError:
        return None


def files_seen(target: Path) -> list[str]:
    """What a pod sees in the volume: every file, relative to it."""
    return sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())


def write_error(target: Path) -> int:
    """The errno a pod gets writing a new file into the volume (0: the write went through)."""
    try:
        (target / "planted").write_bytes(b"x")
    except OSError as exc:
        return exc.errno or -1
    return 0


def gone(target: Path) -> bool:
    """Neither mounted nor present: what the kubelet expects after unpublish."""
    return not is_mount_point(target) and not target.exists()


def records(node: Node) -> list[Path]:
    """The plugin's volume records on disk."""
    state = node.settings.csi.state_dir
    return sorted(state.glob("*.json")) if state.exists() else []


def leases_on(node: Node, uri: str) -> list[str]:
    """Client names of the leases on ``uri``'s snapshot (none if it is not cached)."""
    with Client(node.agent.socket_path) as client:
        try:
            info = client.get(uri)
        except Exception:
            return []
    return [lease.client_name for lease in info.leases]


async def test_identity_names_the_driver_and_is_ready(node: Node) -> None:
    """GetPluginInfo gives the driver's name and the agent's version; no controller
    capability; Probe answers ready; NodeGetInfo gives the configured node id."""
    async with plugin(node) as (identity, node_stub):
        info = await identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
        assert info.name == DRIVER
        assert info.vendor_version
        capabilities = await identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
        assert list(capabilities.capabilities) == []
        probe = await identity.Probe(csi_pb2.ProbeRequest())
        assert probe.ready.value is True
        assert (await node_stub.NodeGetInfo(csi_pb2.NodeGetInfoRequest())).node_id == "node-1"
        node_caps = await node_stub.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest())
        assert list(node_caps.capabilities) == []
        assert endpoint_mode(node) == 0o600  # root's alone
    assert endpoint_mode(node) is None  # removed when the plugin stops


async def test_publish_binds_the_model_read_only_with_a_lease_and_unpublish_undoes_both(
    node: Node, small_model: SampleModel
) -> None:
    """A publish mounts the snapshot at the target (files readable, writes refused with
    EROFS) and leases it for the pod; a second publish is a no-op; unpublish unmounts,
    removes the target and releases the lease; a second unpublish is a no-op."""
    request = publish_request(node, uuid.uuid4().hex, {"uri": small_model.uri})
    target = Path(request.target_path)
    async with plugin(node) as (_identity, stub):
        await stub.NodePublishVolume(request)
        assert (mount_options(target) or set()) >= LOCKED_DOWN_OPTIONS
        assert files_seen(target) == sorted(k[len(small_model.prefix) :] for k in small_model.keys)
        assert write_error(target) == errno.EROFS
        assert leases_on(node, small_model.uri) == ["team-a/vllm-0 (csi)"]
        await stub.NodePublishVolume(request)  # idempotent
        assert leases_on(node, small_model.uri) == ["team-a/vllm-0 (csi)"]

        await stub.NodeUnpublishVolume(unpublish_request(request))
        assert gone(target)
        assert leases_on(node, small_model.uri) == []
        await stub.NodeUnpublishVolume(unpublish_request(request))  # idempotent
    assert records(node) == []


async def test_a_namespace_no_tenant_serves_is_refused_with_nothing_left_behind(
    node: Node, small_model: SampleModel
) -> None:
    """A pod in a namespace no [[csi.tenants]] entry maps gets PERMISSION_DENIED naming the
    namespace; no mount, no lease, no record."""
    request = publish_request(node, uuid.uuid4().hex, {"uri": small_model.uri}, namespace="other")
    async with plugin(node) as (_identity, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.NodePublishVolume(request)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'other'" in (refused.value.details() or "")
    assert not is_mount_point(Path(request.target_path))
    assert leases_on(node, small_model.uri) == []
    assert records(node) == []


async def test_a_uri_the_tenant_may_not_read_is_refused_by_the_agent(node: Node) -> None:
    """The plugin asks on the tenant's socket, so the agent's own rule refuses a source
    outside the tenant's list: PERMISSION_DENIED, nothing mounted, no record kept."""
    request = publish_request(node, uuid.uuid4().hex, {"uri": "s3://someone-elses-bucket/m/"})
    async with plugin(node) as (_identity, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.NodePublishVolume(request)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not is_mount_point(Path(request.target_path))
    assert records(node) == []


@pytest.mark.parametrize(
    ("attributes", "target", "why"),
    [
        ({"uri": "s3://b/m/", "tire": "shm"}, None, "unknown volumeAttributes 'tire'"),
        ({}, None, "has no uri"),
        ({"uri": "s3://b/m/", "tier": "gpu"}, None, "tier must be"),
        ({"socket": "true", "uri": "s3://b/m/"}, None, "takes no uri"),
        ({"uri": "s3://b/m/"}, "/etc/mount", "is not a pod's volume"),
        ({"uri": "s3://b/m/"}, "{kubelet}/pods/../../etc", "not an absolute, normal path"),
    ],
)
async def test_bad_requests_get_invalid_argument_naming_the_problem(
    node: Node, attributes: dict[str, str], target: str | None, why: str
) -> None:
    """Typos, missing or contradictory attributes and targets outside the kubelet's pods
    directory are INVALID_ARGUMENT with a message that says what to fix; nothing is mounted."""
    request = publish_request(node, uuid.uuid4().hex, attributes)
    if target is not None:
        request.target_path = target.format(kubelet=node.kubelet)
    async with plugin(node) as (_identity, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.NodePublishVolume(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert why in (refused.value.details() or "")
    assert records(node) == []


def link_volumes_elsewhere(request: csi_pb2.NodePublishVolumeRequest, elsewhere: Path) -> None:
    """Swap the pod's volumes directory for a link to ``elsewhere``."""
    volumes = Path(request.target_path).parent
    volumes.rmdir()
    elsewhere.mkdir()
    volumes.symlink_to(elsewhere)


async def test_a_target_reached_through_a_symlink_is_refused(node: Node, tmp_path: Path) -> None:
    """A target whose parent is a link elsewhere (to /etc, say) is refused: the mount would
    land outside the pod's volume directory."""
    request = publish_request(node, uuid.uuid4().hex, {"uri": "s3://b/m/"})
    link_volumes_elsewhere(request, tmp_path / "elsewhere")
    async with plugin(node) as (_identity, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.NodePublishVolume(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "symbolic link" in (refused.value.details() or "")
    assert files_seen(tmp_path / "elsewhere") == []


def agent_version_through(target: Path, name: str) -> str:
    """The agent's version, asked through the socket ``name`` in a socket volume. The host's
    path is longer than a socket address may be (the pod's is short): reach it through a
    descriptor of the volume's directory."""
    directory = os.open(target, os.O_PATH | os.O_DIRECTORY)
    try:
        with Client(f"/proc/self/fd/{directory}/{name}") as client:
            return client.status().version
    finally:
        os.close(directory)


async def test_a_socket_volume_holds_the_tenants_socket_and_outlives_an_agent_restart(
    node: Node,
) -> None:
    """socket: "true" binds the tenant's socket directory (its socket alone) read-only: a
    client reaches the agent through it, also after the agent restarted (and made its socket
    anew); unpublish takes it away."""
    request = publish_request(node, uuid.uuid4().hex, {"socket": "true"}, volume="agent")
    target = Path(request.target_path)
    name = node.tenant_socket.name
    async with plugin(node) as (_identity, stub):
        await stub.NodePublishVolume(request)
        assert (mount_options(target) or set()) >= LOCKED_DOWN_OPTIONS
        assert agent_version_through(target, name)
        assert write_error(target) == errno.EROFS
        node.agent.restart()
        wait_for_agent(node.tenant_socket, 60)
        assert agent_version_through(target, name)
        await stub.NodeUnpublishVolume(unpublish_request(request))
    assert gone(target)
    assert records(node) == []


async def test_a_socket_directory_shared_with_other_files_is_not_bound(
    node: Node, tmp_path: Path
) -> None:
    """The tenant's socket directory holding anything else (another tenant's socket, say) is
    FAILED_PRECONDITION naming the fix: binding it would show the pod the other entries."""
    (node.tenant_socket.parent / "other.sock").write_bytes(b"")
    request = publish_request(node, uuid.uuid4().hex, {"socket": "true"}, volume="agent")
    async with plugin(node) as (_identity, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.NodePublishVolume(request)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "a directory of its own" in (refused.value.details() or "")
    assert gone(Path(request.target_path))
    assert records(node) == []


async def test_a_restart_of_plugin_and_agent_between_publish_and_unpublish_leaks_nothing(
    node: Node, small_model: SampleModel
) -> None:
    """The plugin stops (its held leases end with it), the kubelet takes one volume down
    meanwhile, the agent restarts, the plugin starts: the mounted volume's lease is held
    again from its record (on the cached copy, no pull), the other volume is forgotten;
    unpublish then removes the rest. (A held lease across a restart of the agent alone is the
    client's hold, tests/leases/test_lease_restarts.py.)"""
    kept = publish_request(node, uuid.uuid4().hex, {"uri": small_model.uri})
    dropped = publish_request(node, uuid.uuid4().hex, {"uri": small_model.uri}, volume="other")
    async with plugin(node) as (_identity, stub):
        await stub.NodePublishVolume(kept)
        await stub.NodePublishVolume(dropped)
        assert len(leases_on(node, small_model.uri)) == 2
    assert leases_on(node, small_model.uri) == []  # the plugin's holds ended with it
    unmount(Path(dropped.target_path))  # as the kubelet's own cleanup would, say
    node.agent.restart()
    async with plugin(node) as (_identity, stub):
        assert is_mount_point(Path(kept.target_path))
        assert leases_on(node, small_model.uri) == ["team-a/vllm-0 (csi)"]
        assert gone(Path(dropped.target_path))
        await stub.NodeUnpublishVolume(unpublish_request(kept))
    assert gone(Path(kept.target_path))
    assert leases_on(node, small_model.uri) == []
    assert records(node) == []


async def test_a_mount_that_fails_after_the_lease_was_granted_releases_it(
    node: Node, small_model: SampleModel
) -> None:
    """The target is a plain file, found only after the agent granted the lease: the publish
    fails (INVALID_ARGUMENT) and the lease and the record are gone again."""
    request = publish_request(node, uuid.uuid4().hex, {"uri": small_model.uri})
    occupy(Path(request.target_path))
    async with plugin(node) as (_identity, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.NodePublishVolume(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a directory" in (refused.value.details() or "")
    assert leases_on(node, small_model.uri) == []
    assert records(node) == []


async def test_with_the_agent_down_a_publish_is_unavailable_and_leaves_nothing(
    node: Node, small_model: SampleModel
) -> None:
    """No agent on the tenant's socket: UNAVAILABLE (the kubelet retries), no mount, no
    record; once the agent is back the same publish succeeds."""
    request = publish_request(node, uuid.uuid4().hex, {"uri": small_model.uri})
    node.agent.stop()
    async with plugin(node) as (_identity, stub):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.NodePublishVolume(request)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not is_mount_point(Path(request.target_path))
        assert records(node) == []
        node.agent.start()
        wait_for_agent(node.tenant_socket, 60)  # the tenant's socket is bound after the API's
        await stub.NodePublishVolume(request)
        assert is_mount_point(Path(request.target_path))
        await stub.NodeUnpublishVolume(unpublish_request(request))
