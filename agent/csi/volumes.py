"""What a NodePublishVolume asks for, checked: the volume's attributes, the pod, the target.

Everything here arrives from the kubelet, which copies it from a pod spec any user
of the namespace may write: attributes are checked against a closed list (a typo
is an error, not a silent default), the target must be a volume directory of a pod
under the kubelet's own directory, and the pod's namespace and service account (set
by the kubelet itself when the CSIDriver has ``podInfoOnMount``) decide the tenant.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent._config import CsiTenantSettings
from agent._exceptions import AccessDenied, Conflict, InvalidRequest

__all__ = [
    "Pod",
    "VolumeAsk",
    "check_pod_owns_target",
    "check_target",
    "pod_of",
    "tenant_for",
    "volume_ask",
]

# Set by the kubelet (podInfoOnMount), never by the pod's author.
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_UID = "csi.storage.k8s.io/pod.uid"
SERVICE_ACCOUNT = "csi.storage.k8s.io/serviceAccount.name"
_KUBELET_PREFIX = "csi.storage.k8s.io/"
# What a pod's author may set in volumeAttributes.
_ATTRIBUTES = frozenset({"uri", "include", "exclude", "tier", "socket"})
_MAX_VALUE = 4096
_MAX_GLOBS = 64
_MAX_TARGET = 4096
# Where the kubelet puts a csi volume of a pod, under <kubelet_dir>/pods/ (None: any name).
_VOLUME_LAYOUT = (None, "volumes", "kubernetes.io~csi", None, "mount")

VolumeKind = Literal["model", "socket"]


@dataclass(frozen=True, slots=True)
class VolumeAsk:
    """A volume's attributes: a model (uri, globs, tier) or the tenant's API socket."""

    kind: VolumeKind
    uri: str = ""
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    tier: Literal["shm", "disk"] | None = None


@dataclass(frozen=True, slots=True)
class Pod:
    """The pod a volume is for, as the kubelet names it."""

    namespace: str
    name: str
    uid: str
    service_account: str

    @property
    def client_name(self) -> str:
        """How the agent's logs and lease listings name the pod (within the agent's 256
        characters for a client name: a pod name may be 253 on its own)."""
        return f"{self.namespace[:63]}/{self.name[:160]} (csi)"


def volume_ask(context: Mapping[str, str]) -> VolumeAsk:
    """The volume's attributes, or InvalidRequest naming what is wrong with them."""
    unknown = sorted(
        k for k in context if k not in _ATTRIBUTES and not k.startswith(_KUBELET_PREFIX)
    )
    if unknown:
        raise InvalidRequest(
            f"unknown volumeAttributes {', '.join(repr(k[:64]) for k in unknown[:8])}: a prewarm "
            f"volume takes {', '.join(sorted(_ATTRIBUTES))}"
        )
    for name in _ATTRIBUTES & context.keys():
        if len(context[name]) > _MAX_VALUE or "\x00" in context[name]:
            raise InvalidRequest(
                f"volumeAttributes {name!r} is longer than {_MAX_VALUE} or has NUL"
            )
    socket = context.get("socket", "").strip().lower()
    if socket not in ("", "true", "false"):
        raise InvalidRequest(f'volumeAttributes socket must be "true" or "false", not {socket!r}')
    if socket == "true":
        if context.keys() & {"uri", "include", "exclude", "tier"}:
            raise InvalidRequest(
                'a socket volume (socket: "true") takes no uri, include, exclude or tier: '
                "declare the model in a volume of its own"
            )
        return VolumeAsk("socket")
    uri = context.get("uri", "").strip()
    if not uri:
        raise InvalidRequest(
            "volumeAttributes has no uri: name the model (uri: s3://bucket/prefix/), or ask "
            'for the agent\'s socket with socket: "true"'
        )
    tier = context.get("tier", "").strip()
    if tier not in ("", "shm", "disk"):
        raise InvalidRequest(f'volumeAttributes tier must be "shm" or "disk", not {tier!r}')
    return VolumeAsk(
        "model",
        uri=uri,
        include=_globs(context, "include"),
        exclude=_globs(context, "exclude"),
        tier="shm" if tier == "shm" else "disk" if tier == "disk" else None,
    )


def _globs(context: Mapping[str, str], name: str) -> tuple[str, ...]:
    globs = tuple(g.strip() for g in context.get(name, "").split(",") if g.strip())
    if len(globs) > _MAX_GLOBS:
        raise InvalidRequest(
            f"volumeAttributes {name} has {len(globs)} globs; at most {_MAX_GLOBS}"
        )
    return globs


def pod_of(context: Mapping[str, str]) -> Pod:
    """The pod the kubelet names in the volume context; Conflict when it names none."""
    values = [context.get(key, "") for key in (POD_NAMESPACE, POD_NAME, POD_UID, SERVICE_ACCOUNT)]
    if not all(values):
        raise Conflict(
            "the kubelet sent no pod namespace, name, uid or service account: the CSIDriver "
            "object must set podInfoOnMount: true (packaging/k8s/csi-driver.yaml)"
        )
    return Pod(*values)


def tenant_for(pod: Pod, tenants: Sequence[CsiTenantSettings]) -> str:
    """The tenant whose socket serves ``pod``: the first [[csi.tenants]] entry that names
    its namespace (and its service account, when the entry lists any)."""
    for entry in tenants:
        if pod.namespace in entry.namespaces and (
            not entry.service_accounts or pod.service_account in entry.service_accounts
        ):
            return entry.tenant
    raise AccessDenied(
        f"no [[csi.tenants]] entry of this node's prewarm serves namespace {pod.namespace!r} "
        f"(service account {pod.service_account!r}); ask the cluster's admin to map it to a tenant"
    )


def check_pod_owns_target(pod: Pod, target: Path, kubelet_dir: Path) -> None:
    """The pod the context names must be the one whose directory the target is in.

    The kubelet writes the pod's keys over any of the same name in the pod's own
    volumeAttributes only when the CSIDriver has podInfoOnMount; without it, a pod's
    author could name another namespace's tenant. The target path is the kubelet's
    own (pods/<uid>/...), and no author knows a pod's uid before it exists.
    """
    uid = target.relative_to(Path(os.path.normpath(kubelet_dir)) / "pods").parts[0]
    if uid != pod.uid:
        raise AccessDenied(
            f"the volume context names pod uid {pod.uid[:64]!r} but the target is in pod "
            f"{uid!r}'s directory: pod keys set by the pod's author, not the kubelet? The "
            "CSIDriver object must set podInfoOnMount: true"
        )


def check_target(target: str, kubelet_dir: Path) -> Path:
    """The target path, if it is a volume directory of a pod under ``kubelet_dir``/pods.

    Absolute and normal (no ``..``, no doubled slashes), with no link in the
    part that exists: a mount lands exactly where the kubelet will look.
    """
    if not target or len(target) > _MAX_TARGET or "\x00" in target:
        raise InvalidRequest("target_path is empty, too long, or has NUL")
    path = Path(target)
    pods = Path(os.path.normpath(kubelet_dir)) / "pods"
    if not path.is_absolute() or os.path.normpath(target) != target:
        raise InvalidRequest(f"target_path {target!r} is not an absolute, normal path")
    parts = path.relative_to(pods).parts if pods in path.parents else ()
    if len(parts) != len(_VOLUME_LAYOUT) or any(
        want is not None and part != want for part, want in zip(parts, _VOLUME_LAYOUT, strict=True)
    ):
        raise InvalidRequest(
            f"target_path {target!r} is not a pod's volume under {pods} "
            "(<uid>/volumes/kubernetes.io~csi/<name>/mount)"
        )
    existing = path if os.path.lexists(path) else path.parent
    if os.path.realpath(existing) != str(existing):
        raise InvalidRequest(f"target_path {target!r} goes through a symbolic link")
    return path
