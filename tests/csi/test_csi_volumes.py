"""What the CSI plugin accepts from the kubelet before it touches anything: attributes, the
pod, the tenant it maps to, the target path (in-process; no mounts, no agent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent._config import CsiTenantSettings, Settings
from agent._exceptions import AccessDenied, Conflict, InvalidRequest
from agent.csi.mounts import _unescape
from agent.csi.volumes import (
    Pod,
    VolumeAsk,
    check_pod_owns_target,
    check_target,
    pod_of,
    tenant_for,
    volume_ask,
)

KUBELET = Path("/var/lib/kubelet")
POD_KEYS = {
    "csi.storage.k8s.io/pod.namespace": "team-a",
    "csi.storage.k8s.io/pod.name": "vllm-0",
    "csi.storage.k8s.io/pod.uid": "1234",
    "csi.storage.k8s.io/serviceAccount.name": "inference",
}


def test_a_model_volume_takes_uri_globs_and_tier_and_ignores_the_kubelets_keys() -> None:
    """uri, comma-separated include/exclude (blanks dropped) and tier make the ask; the
    kubelet's own csi.storage.k8s.io/* keys are not the author's and pass."""
    ask = volume_ask(
        POD_KEYS
        | {
            "uri": " s3://b/m/ ",
            "include": "*.safetensors, *.json,,",
            "exclude": "x*",
            "tier": "disk",
        }
    )
    assert ask == VolumeAsk("model", "s3://b/m/", ("*.safetensors", "*.json"), ("x*",), "disk")


def test_a_socket_volume_is_asked_with_socket_true_alone() -> None:
    """socket: "true" asks for the tenant's socket; "false" is a model volume like no key."""
    assert volume_ask({"socket": "TRUE"}).kind == "socket"
    assert volume_ask({"socket": "false", "uri": "s3://b/m/"}).kind == "model"
    with pytest.raises(InvalidRequest, match='must be "true" or "false"'):
        volume_ask({"socket": "yes"})


def test_too_many_globs_and_oversized_values_are_refused() -> None:
    """65 include globs, or a value over 4 KiB, is INVALID_ARGUMENT, not a slow request."""
    with pytest.raises(InvalidRequest, match="at most 64"):
        volume_ask({"uri": "s3://b/m/", "include": ",".join(f"g{n}" for n in range(65))})
    with pytest.raises(InvalidRequest, match="longer than 4096"):
        volume_ask({"uri": "s3://b/" + "m" * 5000})


def test_a_context_without_pod_keys_says_the_csidriver_needs_pod_info() -> None:
    """No pod keys means the CSIDriver lacks podInfoOnMount: FAILED_PRECONDITION saying so."""
    with pytest.raises(Conflict, match="podInfoOnMount: true"):
        pod_of({"uri": "s3://b/m/"})
    assert pod_of(POD_KEYS) == Pod("team-a", "vllm-0", "1234", "inference")


def test_tenants_match_by_namespace_then_service_account_first_entry_wins() -> None:
    """An entry with service accounts serves only those; the first matching entry decides;
    no match is PERMISSION_DENIED naming the namespace and account."""
    tenants = [
        CsiTenantSettings(tenant="ci", namespaces=["team-a"], service_accounts=["builder"]),
        CsiTenantSettings(tenant="team-a", namespaces=["team-a", "team-a-dev"]),
    ]
    assert tenant_for(Pod("team-a", "p", "u", "builder"), tenants) == "ci"
    assert tenant_for(Pod("team-a", "p", "u", "inference"), tenants) == "team-a"
    assert tenant_for(Pod("team-a-dev", "p", "u", "builder"), tenants) == "team-a"
    with pytest.raises(AccessDenied, match=r"'team-b'.*'builder'"):
        tenant_for(Pod("team-b", "p", "u", "builder"), tenants)


def test_the_target_must_be_a_pods_volume_under_the_kubelets_directory() -> None:
    """Relative, un-normal, outside pods/, or the pods directory itself: INVALID_ARGUMENT."""
    good = "/var/lib/kubelet/pods/1234/volumes/kubernetes.io~csi/model/mount"
    assert check_target(good, KUBELET) == Path(good)
    for bad in (
        "var/lib/kubelet/pods/1234/v",
        "/var/lib/kubelet/pods/1234//v",
        "/var/lib/kubelet/pods/1234/../../../../etc",
        "/var/lib/kubelet/pods",
        "/var/lib/kubelet/pods/1234",
        "/var/lib/kubelet/plugins/x/y",
        "",
        "/var/lib/kubelet/pods/1234/v\x00",
    ):
        with pytest.raises(InvalidRequest):
            check_target(bad, KUBELET)


def test_the_pod_named_in_the_context_must_own_the_target_directory() -> None:
    """Pod keys whose uid is not the uid in the kubelet's target path (an author naming
    another namespace when podInfoOnMount is off) are PERMISSION_DENIED."""
    target = Path("/var/lib/kubelet/pods/1234/volumes/kubernetes.io~csi/model/mount")
    check_pod_owns_target(Pod("team-a", "p", "1234", "sa"), target, KUBELET)
    with pytest.raises(AccessDenied, match="podInfoOnMount"):
        check_pod_owns_target(Pod("team-a", "p", "9999", "sa"), target, KUBELET)


def test_mountinfo_escapes_are_read_back_as_the_path() -> None:
    """mountinfo writes a space as \\040 and a backslash as \\134; other text is kept."""
    assert _unescape(r"/a\040b\134c") == "/a b\\c"
    assert _unescape("/plain") == "/plain"
    assert _unescape("/end\\04") == "/end\\04"


def test_a_csi_tenant_on_a_requester_scoped_socket_is_refused_at_load() -> None:
    """A [[csi.tenants]] entry naming a requester_scoped socket would have every volume
    refused (the plugin has no pod credentials): the config is refused, saying why."""
    with pytest.raises(ValueError, match="requester_scoped"):
        Settings(
            access={"sockets": [{"name": "t", "path": "/run/t/a.sock", "requester_scoped": True}]},
            csi={"tenants": [{"tenant": "t", "namespaces": ["t"]}]},
        )
