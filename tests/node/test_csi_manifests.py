"""What ships beside the agent for Kubernetes: one version, CSI volumes, the role's trust.

The image tag and wheel names that packaging/ and the docs tell people to build
and pull are the project's own version. The CSI driver's manifests are held to
what the plugin (agent/csi) needs: the CSIDriver's fields, one socket path for
the plugin, the registrar and the config, the kubelet's directory mounted with
Bidirectional propagation; and the example pod that uses it to the restricted
Pod Security standard, checked by a checker shown to catch the hostPath pods.
The IAM role's trust policies let the DaemonSet's own service account assume it,
and nothing else. On the systemd route, prewarm-csi.service runs the plugin
after the agent, as root and in the host's mount namespace (no sandbox setting
that would hide its mounts from the kubelet), install.sh installs it, and
csi-registrar.yaml registers it with the DaemonSet's own registrar container.
The rest of the Kubernetes manifests' checks are in test_k8s_manifests.py, whose
helpers these tests share.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from test_k8s_manifests import (
    K8S,
    KUBERNETES_VERSIONS,
    MANIFESTS,
    config_text,
    container,
    daemonset_pod,
    daemonset_settings,
    documents,
    find,
)
from test_systemd import systemd_tool

from agent._config import CsiSettings, Settings, load_settings
from agent._uri import parse_uri
from agent.csi.volumes import (
    POD_NAME,
    POD_NAMESPACE,
    POD_UID,
    SERVICE_ACCOUNT,
    pod_of,
    tenant_for,
    volume_ask,
)
from agent.service import access

REPO = Path(__file__).resolve().parents[2]
DRIVER = CsiSettings().driver_name

# -- one version ---------------------------------------------------------------------------

# registry.example.com/prewarm:0.2.0 (an image of the agent, under any registry),
# prewarm_agent-0.2.0-py3-none-any.whl and the Image Builder component's
# --semantic-version 0.2.0; "<version>" placeholders are no claim of a version.
IMAGE_TAG = re.compile(r"/prewarm:([\w.+-]+|<[^>\s]+>)")
WHEEL_VERSION = re.compile(r"prewarm_agent-([\w.+]+|<[^>\s]+>)-py3")
COMPONENT_VERSION = re.compile(r"--semantic-version ([\w.+-]+|<[^>\s]+>)")


def project_version() -> str:
    """pyproject's fallback_version: the newest release (tests/project/test_habits.py)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    version: str = pyproject["tool"]["setuptools_scm"]["fallback_version"]
    return version


def version_references(text: str) -> list[str]:
    """The versions ``text`` names in image tags of the agent, wheel file names and the Image
    Builder component's version."""
    found = IMAGE_TAG.findall(text) + WHEEL_VERSION.findall(text) + COMPONENT_VERSION.findall(text)
    return [version for version in found if not version.startswith("<")]


def versioned_files() -> list[Path]:
    """Everything in packaging/, the docs and the README: what people copy commands from."""
    packaging = (path for path in (REPO / "packaging").rglob("*") if path.is_file())
    return sorted([*packaging, *(REPO / "docs").rglob("*.md"), REPO / "README.md"])


def test_every_image_tag_and_wheel_name_is_the_projects_version() -> None:
    """Each registry.../prewarm:<tag>, prewarm_agent-<v>-py3 wheel name and Image Builder
    --semantic-version in packaging/, docs/ and the README is pyproject's fallback_version, so
    a copied build command, image reference or pip install names the release the tree is."""
    version = project_version()
    stale = {
        f"{path.relative_to(REPO)}: {found}"
        for path in versioned_files()
        for found in version_references(path.read_text(errors="replace"))
        if found != version
    }
    assert not stale, f"not {version}:\n" + "\n".join(sorted(stale))
    # The manifests do name it: a scan that found nothing would pass vacuously.
    assert version_references((REPO / "packaging" / "k8s" / "daemonset.yaml").read_text())


def test_the_version_scan_finds_tags_and_wheel_names_and_skips_placeholders() -> None:
    """The scan reads the tag of an agent image under any registry, the version of a wheel
    name and of the Image Builder component, leaves other images and <version> placeholders
    alone, and so would catch a stale one."""
    text = (
        "image: registry.example.com/prewarm:0.1.0\n"
        "docker build -t REGISTRY/prewarm:0.1.1 .\n"
        "image: registry.example.com/vllm-openai-prewarm:latest\n"
        "COPY dist/prewarm_agent-0.1.2-py3-none-any.whl /tmp/\n"
        "pip install 'prewarm_agent-<version>-py3-none-any.whl[cli]'\n"
        "image: registry.example.com/prewarm:<tag>\n"
        "aws imagebuilder create-component --semantic-version 0.1.3 --platform Linux\n"
        "--semantic-version <version>\n"
    )
    assert version_references(text) == ["0.1.0", "0.1.1", "0.1.2", "0.1.3"]


# -- the CSI manifests: valid for the API ------------------------------------------------------

CSI_MANIFESTS = {
    "csi-driver.yaml": ["CSIDriver"],
    "csi-pod.yaml": ["Namespace", "Pod"],
    "csi-registrar.yaml": ["Namespace", "DaemonSet"],
}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("name", "kinds"), CSI_MANIFESTS.items(), ids=list(CSI_MANIFESTS))
def test_the_csi_manifests_hold_their_objects_and_validate_strictly(
    name: str, kinds: list[str], version: str
) -> None:
    """Each CSI manifest holds the objects it is for, and each passes kubernetes-validate in
    strict mode (an unknown field fails), as every manifest test_k8s_manifests.py finds does."""
    path = K8S / name
    assert path in MANIFESTS
    docs = documents(path)
    assert [doc["kind"] for doc in docs] == kinds
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


# -- the CSIDriver -----------------------------------------------------------------------------


def test_the_csidriver_is_an_attachless_ephemeral_driver_that_gets_pod_info(
    tmp_path: Path,
) -> None:
    """The CSIDriver object is named as the plugin's driver (its default and the DaemonSet's
    config), needs no attach, passes the pod's identity on mount (the plugin maps tenants by
    it), serves inline volumes only and leaves ownership alone (a read-only volume)."""
    driver = find(K8S / "csi-driver.yaml", "CSIDriver")
    assert driver["metadata"]["name"] == DRIVER == daemonset_settings(tmp_path).csi.driver_name
    assert driver["spec"] == {
        "attachRequired": False,
        "podInfoOnMount": True,
        "volumeLifecycleModes": ["Ephemeral"],
        "fsGroupPolicy": "None",
    }


# -- the DaemonSet: prewarm-csi and its registrar ----------------------------------------------


def host_path(name: str, path: Path) -> Path | None:
    """Where ``path`` inside the DaemonSet's container ``name`` is on the host, through the
    deepest mount that holds it (None: not in a hostPath volume, or in no mount)."""
    volumes = {v["name"]: v for v in daemonset_pod()["spec"]["volumes"]}
    mounts = sorted(
        container(name).get("volumeMounts", []),
        key=lambda mount: len(Path(mount["mountPath"]).parts),
        reverse=True,
    )
    for mount in mounts:
        inside = Path(mount["mountPath"])
        if path == inside or inside in path.parents:
            source = volumes[mount["name"]].get("hostPath")
            return Path(source["path"]) / path.relative_to(inside) if source else None
    return None


def registrar_args() -> dict[str, str]:
    args: list[str] = container("node-driver-registrar")["args"]
    return dict(arg.split("=", 1) for arg in args)


def test_the_registrar_registers_the_socket_the_plugin_serves(tmp_path: Path) -> None:
    """The registrar registers the host path of the plugin's socket ([csi].endpoint of the
    ConfigMap's config, the default there) and dials the same socket through its own mount;
    the plugin sees that path at the same place on the host."""
    endpoint = daemonset_settings(tmp_path).csi.endpoint
    args = registrar_args()
    assert Path(args["--kubelet-registration-path"]) == endpoint
    assert host_path("node-driver-registrar", Path(args["--csi-address"])) == endpoint
    assert host_path("prewarm-csi", endpoint) == endpoint
    # The kubelet's plugin registry, where the registrar leaves its registration socket.
    assert host_path("node-driver-registrar", Path("/registration")) == Path(
        "/var/lib/kubelet/plugins_registry"
    )


def test_the_plugin_mounts_the_kubelet_directory_bidirectionally_and_nothing_in_it(
    tmp_path: Path,
) -> None:
    """prewarm-csi is privileged and mounts [csi].kubelet_dir at its host path with
    Bidirectional propagation (its mounts must reach the kubelet), with no other mount nested
    inside it; no other container propagates mounts; its records are on the host."""
    csi = daemonset_settings(tmp_path).csi
    plugin = container("prewarm-csi")
    assert plugin["securityContext"]["privileged"] is True
    propagating = {
        (c["name"], m["mountPath"], m["mountPropagation"])
        for c in daemonset_pod()["spec"]["containers"] + daemonset_pod()["spec"]["initContainers"]
        for m in c.get("volumeMounts", [])
        if "mountPropagation" in m
    }
    assert propagating == {("prewarm-csi", str(csi.kubelet_dir), "Bidirectional")}
    assert host_path("prewarm-csi", csi.kubelet_dir / "pods" / "uid" / "volumes") == (
        csi.kubelet_dir / "pods" / "uid" / "volumes"
    )
    nested = [
        m["mountPath"]
        for m in plugin["volumeMounts"]
        if csi.kubelet_dir in Path(m["mountPath"]).parents
    ]
    assert not nested
    assert host_path("prewarm-csi", csi.state_dir) == csi.state_dir


def uncommented_csi_example(text: str) -> str:
    """The ConfigMap's agent.toml with its commented-out example ("#[table]", "#key = value")
    switched on; its prose comments ("# ...") stay comments."""
    return re.sub(r"(?m)^#(?=\[|\w+ = )", "", text)


def csi_example_settings(tmp_path: Path) -> Settings:
    config = tmp_path / "agent-with-csi.toml"
    config.write_text(uncommented_csi_example(config_text()))
    return load_settings(config)


def test_the_plugin_reaches_the_agents_sockets_and_tiers_at_their_host_paths(
    tmp_path: Path,
) -> None:
    """The agent answers with host paths: prewarm-csi mounts the socket directory (the API
    socket and the example tenant's) and both tiers at the host's own paths, to bind from."""
    settings = csi_example_settings(tmp_path)
    paths = [
        settings.socket_path,
        *(entry.path for entry in settings.access.sockets),
        settings.tiers.shm_root / "snapshots",
        settings.tiers.disk_root / "snapshots",
    ]
    assert Path("/run/prewarm/team-a/agent.sock") in paths  # the example tenant's
    for path in paths:
        assert host_path("prewarm-csi", path) == path, path


def test_the_plugin_runs_prewarm_csi_on_the_agents_config_with_the_nodes_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prewarm-csi runs the image's prewarm-csi on the file the agent reads (same ConfigMap,
    same path), and its environment sets [csi].node_id to the node's name, a setting the
    config loader takes."""
    plugin = container("prewarm-csi")
    agent_config = container("prewarmd")["args"][-1]
    assert plugin["command"] == ["/opt/prewarm/bin/prewarm-csi", "--config", agent_config]
    assert host_path("prewarm-csi", Path(agent_config)) is None  # a ConfigMap, not the host's
    assert {
        m["name"] for m in plugin["volumeMounts"] if m["mountPath"] == "/etc/prewarm/config"
    } == {"config"}
    env = {item["name"]: item for item in plugin["env"]}
    assert env["PREWARM_CSI__NODE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    config = tmp_path / "agent.toml"
    config.write_text(config_text())
    monkeypatch.setenv("PREWARM_CSI__NODE_ID", "ip-10-0-0-1.ec2.internal")
    assert load_settings(config).csi.node_id == "ip-10-0-0-1.ec2.internal"


def test_the_registrar_runs_as_roots_uid_with_nothing_else() -> None:
    """The registrar, which only needs the uid that owns the two sockets, is not privileged,
    cannot escalate, has every capability dropped and none added, and a read-only root."""
    security = container("node-driver-registrar")["securityContext"]
    assert "privileged" not in security
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True


def test_only_the_agents_container_gets_the_service_accounts_aws_credentials() -> None:
    """The EKS webhooks skip every container but prewarmd when they inject the role's
    credentials: the plugin, the registrar and the init container read nothing from S3."""
    pod = daemonset_pod()
    skipped = pod["metadata"]["annotations"]["eks.amazonaws.com/skip-containers"].split(",")
    names = {c["name"] for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]}
    assert set(skipped) == names - {"prewarmd"}


def test_every_command_run_from_the_prefix_is_a_script_the_wheel_installs() -> None:
    """Every /opt/prewarm/bin/<command> the manifests and units run is one of pyproject's
    [project.scripts] (so the image, which installs the wheel there, has it): prewarm-csi too."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    scripts = set(pyproject["project"]["scripts"])
    texts = [path.read_text() for path in [*MANIFESTS, *(REPO / "systemd").glob("*.service")]]
    commands = {name for text in texts for name in re.findall(r"/opt/prewarm/bin/([\w-]+)", text)}
    assert "prewarm-csi" in commands
    assert commands <= scripts, commands - scripts


# -- the example pod: its volumes, its tenant ------------------------------------------------


def test_the_csi_example_config_maps_team_a_to_a_tenant_socket_the_agent_accepts(
    tmp_path: Path,
) -> None:
    """As shipped, the ConfigMap maps no namespace (its [[csi.tenants]] example is commented
    out, as it must name a socket); switched on, the agent's loader accepts it and team-a's
    pods go to the team-a tenant's socket."""
    assert daemonset_settings(tmp_path).csi.tenants == []
    settings = csi_example_settings(tmp_path)
    (tenant,) = settings.csi.tenants
    assert (tenant.tenant, tenant.namespaces) == ("team-a", ["team-a"])
    assert [entry.name for entry in settings.access.sockets] == ["team-a"]


def kubelet_context(pod: dict[str, Any], attributes: dict[str, str]) -> dict[str, str]:
    """The volume context the kubelet sends with podInfoOnMount: the attributes and the pod."""
    return attributes | {
        POD_NAMESPACE: pod["metadata"]["namespace"],
        POD_NAME: pod["metadata"]["name"],
        POD_UID: "9a3e1f52-0000-4000-8000-000000000001",
        SERVICE_ACCOUNT: pod["spec"].get("serviceAccountName", "default"),
    }


def test_the_csi_pod_gets_a_model_its_tenant_may_read_and_the_tenants_socket(
    tmp_path: Path,
) -> None:
    """Each csi volume of csi-pod.yaml names the driver and is one the plugin accepts: the model
    is within the sources of the tenant its namespace maps to (with the ConfigMap's example
    on), and the socket volume, a tenant's (never the node's), is mounted where the pod's
    PREWARM_SOCKET_PATH points."""
    settings = csi_example_settings(tmp_path)
    _, tenants = access.tenants_from_settings(settings)
    pod = find(K8S / "csi-pod.yaml", "Pod")
    (main,) = pod["spec"]["containers"]
    mounts = {m["name"]: Path(m["mountPath"]) for m in main["volumeMounts"]}
    env = {item["name"]: item.get("value") for item in main["env"]}
    kinds = []
    for volume in (v for v in pod["spec"]["volumes"] if "csi" in v):
        assert volume["csi"]["driver"] == DRIVER
        context = kubelet_context(pod, volume["csi"]["volumeAttributes"])
        ask = volume_ask(context)
        tenant = tenant_for(pod_of(context), settings.csi.tenants)
        kinds.append(ask.kind)
        if ask.kind == "model":
            access.check_source(parse_uri(ask.uri), access.Requester(tenants[tenant]))
        else:
            assert tenant in tenants  # a tenant socket, not "node"
            assert mounts[volume["name"]] / "agent.sock" == Path(env["PREWARM_SOCKET_PATH"])
    assert sorted(kinds) == ["model", "socket"]


# -- the example pod: the restricted Pod Security standard -----------------------------------

# The restricted profile's rules (kubernetes.io/docs/concepts/security/pod-security-standards)
# that a Linux pod can break: volume types; host namespaces; privileged containers; privilege
# escalation; running as non-root (and never uid 0); a seccomp profile; capabilities; host
# ports. Each for every container, init container and ephemeral container.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SECCOMP_TYPES = {"RuntimeDefault", "Localhost"}
ADDABLE_CAPABILITIES = {"NET_BIND_SERVICE"}


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """What in a pod spec the restricted Pod Security standard forbids (empty: it passes)."""
    found = [
        f"volume {volume['name']}: {kind}"
        for volume in spec.get("volumes", [])
        for kind in sorted(set(volume) - {"name"} - RESTRICTED_VOLUMES)
    ]
    found += [f"pod: {field}" for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    pod = spec.get("securityContext", {})
    if pod.get("runAsUser") == 0:
        found.append("pod: runAsUser 0")
    pod_seccomp = pod.get("seccompProfile", {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_TYPES:
        found.append(f"pod: seccompProfile {pod_seccomp}")
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for each in spec.get(kind, []):
            found += container_violations(each, pod)
    return found


def container_violations(each: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    """What the restricted standard forbids in one container, given the pod's security
    context (which the container's own fields override)."""
    name, security = each["name"], each.get("securityContext", {})
    found = [
        f"{name}: hostPort {p['hostPort']}" for p in each.get("ports", []) if p.get("hostPort")
    ]
    if security.get("privileged"):
        found.append(f"{name}: privileged")
    if security.get("allowPrivilegeEscalation") is not False:
        found.append(f"{name}: allowPrivilegeEscalation not false")
    if security.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
        found.append(f"{name}: runAsNonRoot not true")
    if security.get("runAsUser") == 0:
        found.append(f"{name}: runAsUser 0")
    seccomp = security.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
    if seccomp not in SECCOMP_TYPES:
        found.append(f"{name}: seccompProfile {seccomp or 'unset'}")
    capabilities = security.get("capabilities", {})
    if "ALL" not in capabilities.get("drop", []):
        found.append(f"{name}: does not drop ALL")
    found += [
        f"{name}: adds {added}"
        for added in capabilities.get("add", [])
        if added not in ADDABLE_CAPABILITIES
    ]
    return found


def test_the_csi_pod_passes_the_restricted_pod_security_standard() -> None:
    """csi-pod.yaml's namespace enforces restricted, and its pod breaks none of the profile's
    rules: only csi and emptyDir volumes, non-root, no escalation, every capability dropped,
    the runtime's seccomp profile."""
    namespace = find(K8S / "csi-pod.yaml", "Namespace")
    pod = find(K8S / "csi-pod.yaml", "Pod")
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    assert pod["metadata"]["namespace"] == namespace["metadata"]["name"]
    assert restricted_violations(pod["spec"]) == []


@pytest.mark.parametrize("name", ["vllm-pod.yaml", "python-client-pod.yaml"])
def test_the_restricted_checker_refuses_the_hostpath_example_pods(name: str) -> None:
    """The checker is able to fail: it finds the hostPath volumes of the fallback example pods,
    which the restricted (and baseline) standard forbids."""
    violations = restricted_violations(find(K8S / name, "Pod")["spec"])
    assert "volume prewarm-socket: hostPath" in violations
    assert "volume prewarm-shm: hostPath" in violations


def _first(spec: dict[str, Any]) -> dict[str, Any]:
    security: dict[str, Any] = spec["containers"][0]["securityContext"]
    return security


MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], object], list[str]]] = {
    "hostPath volume": (
        lambda s: s["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
        ["volume root: hostPath"],
    ),
    "hostNetwork": (lambda s: s.update(hostNetwork=True), ["pod: hostNetwork"]),
    "hostPID": (lambda s: s.update(hostPID=True), ["pod: hostPID"]),
    "hostIPC": (lambda s: s.update(hostIPC=True), ["pod: hostIPC"]),
    "privileged": (lambda s: _first(s).update(privileged=True), ["vllm: privileged"]),
    "escalation": (
        lambda s: _first(s).pop("allowPrivilegeEscalation"),
        ["vllm: allowPrivilegeEscalation not false"],
    ),
    "root allowed": (
        lambda s: s["securityContext"].pop("runAsNonRoot"),
        ["vllm: runAsNonRoot not true"],
    ),
    "root uid": (lambda s: s["securityContext"].update(runAsUser=0), ["pod: runAsUser 0"]),
    "root uid in a container": (lambda s: _first(s).update(runAsUser=0), ["vllm: runAsUser 0"]),
    "no seccomp": (
        lambda s: s["securityContext"].pop("seccompProfile"),
        ["vllm: seccompProfile unset"],
    ),
    "unconfined": (
        lambda s: _first(s).update(seccompProfile={"type": "Unconfined"}),
        ["vllm: seccompProfile Unconfined"],
    ),
    "capability added": (
        lambda s: _first(s)["capabilities"].update(add=["SYS_ADMIN", "NET_BIND_SERVICE"]),
        ["vllm: adds SYS_ADMIN"],
    ),
    "not all dropped": (
        lambda s: _first(s)["capabilities"].update(drop=["NET_RAW"]),
        ["vllm: does not drop ALL"],
    ),
    "host port": (
        lambda s: s["containers"][0]["ports"][0].update(hostPort=8000),
        ["vllm: hostPort 8000"],
    ),
    "bare init container": (
        lambda s: s.update(initContainers=[{"name": "fetch", "image": "busybox"}]),
        ["fetch: allowPrivilegeEscalation not false", "fetch: does not drop ALL"],
    ),
}


@pytest.mark.parametrize(("change", "expected"), MUTATIONS.values(), ids=list(MUTATIONS))
def test_the_restricted_checker_catches_each_rule_broken_in_the_csi_pod(
    change: Callable[[dict[str, Any]], object], expected: list[str]
) -> None:
    """Each rule the checker knows, broken once in a copy of csi-pod.yaml's pod (a host
    volume, a host namespace, privilege, escalation, root, seccomp, capabilities, a host port,
    an init container without a security context), is found, and nothing else is."""
    spec = copy.deepcopy(find(K8S / "csi-pod.yaml", "Pod")["spec"])
    change(spec)
    assert restricted_violations(spec) == expected


# -- the IAM role's trust policies -------------------------------------------------------------

IAM = REPO / "packaging" / "iam"


def agent_service_account() -> tuple[str, str, str]:
    """The namespace and name of the service account the DaemonSet runs as (read from
    daemonset.yaml), and the AWS account of the role its annotation names."""
    daemonset = find(K8S / "daemonset.yaml", "DaemonSet", "prewarm")
    name = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    account = find(K8S / "daemonset.yaml", "ServiceAccount", name)
    namespace = account["metadata"]["namespace"]
    assert namespace == daemonset["metadata"]["namespace"]
    role = re.fullmatch(
        r"arn:aws:iam::(\d{12}):role/[\w+=,.@/-]+",
        account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"],
    )
    assert role, account["metadata"]["annotations"]
    return namespace, name, role[1]


def trust_statement(name: str) -> dict[str, Any]:
    """The one statement of a trust policy in packaging/iam, which must parse and allow."""
    policy = json.loads((IAM / name).read_text())
    assert policy["Version"] == "2012-10-17"
    statement: dict[str, Any]
    (statement,) = policy["Statement"]
    assert statement["Effect"] == "Allow"
    return statement


def test_the_irsa_trust_lets_only_the_daemonsets_service_account_assume_the_role() -> None:
    """prewarm-trust-irsa.json trusts the cluster's OIDC provider (in the role's own account)
    for AssumeRoleWithWebIdentity, only for a token whose subject is the DaemonSet's service
    account, exactly (no wildcard), and whose audience is STS."""
    namespace, name, account = agent_service_account()
    statement = trust_statement("prewarm-trust-irsa.json")
    (principal,) = statement["Principal"].items()
    provider = re.fullmatch(
        r"arn:aws:iam::(\d{12}):oidc-provider/(oidc\.eks\.[^/]+/id/\w+)", principal[1]
    )
    assert principal[0] == "Federated"
    assert provider, principal
    assert provider[1] == account
    assert statement["Action"] == "sts:AssumeRoleWithWebIdentity"
    assert statement["Condition"] == {
        "StringEquals": {
            f"{provider[2]}:sub": f"system:serviceaccount:{namespace}:{name}",
            f"{provider[2]}:aud": "sts.amazonaws.com",
        }
    }


def test_the_pod_identity_trust_lets_only_eks_assume_the_role_for_the_service_account() -> None:
    """prewarm-trust-pod-identity.json trusts the EKS Pod Identity service and no other
    principal, for AssumeRole and TagSession only, and only with the session tags of the
    DaemonSet's namespace and service account, on a cluster of the role's own account."""
    namespace, name, account = agent_service_account()
    statement = trust_statement("prewarm-trust-pod-identity.json")
    assert statement["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    assert sorted(statement["Action"]) == ["sts:AssumeRole", "sts:TagSession"]
    (conditions,) = statement["Condition"].items()
    assert conditions[0] == "StringEquals"
    tags = conditions[1]
    assert tags.pop("aws:RequestTag/kubernetes-namespace") == namespace
    assert tags.pop("aws:RequestTag/kubernetes-service-account") == name
    cluster = tags.pop("aws:RequestTag/eks-cluster-arn")
    assert re.fullmatch(rf"arn:aws:eks:[\w-]+:{account}:cluster/[\w-]+", cluster), cluster
    assert tags == {}


# -- the systemd route -------------------------------------------------------------------------

SYSTEMD = REPO / "systemd"
CSI_UNIT = SYSTEMD / "prewarm-csi.service"
# Settings that run a service in a mount namespace of its own (systemd.exec(5)): mounts the
# plugin made there would never reach the kubelet, or the pods.
OWN_MOUNT_NAMESPACE = {
    "PrivateMounts",
    "ProtectSystem",
    "ProtectHome",
    "PrivateTmp",
    "PrivateDevices",
    "PrivateNetwork",
    "PrivateIPC",
    "PrivateUsers",
    "PrivatePIDs",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectProc",
    "ProcSubset",
    "ReadWritePaths",
    "ReadOnlyPaths",
    "InaccessiblePaths",
    "ExecPaths",
    "NoExecPaths",
    "BindPaths",
    "BindReadOnlyPaths",
    "TemporaryFileSystem",
    "RootDirectory",
    "RootImage",
    "MountImages",
    "ExtensionImages",
    "ExtensionDirectories",
    "MountFlags",
    "NetworkNamespacePath",
    "IPCNamespacePath",
    "LogNamespace",
    "DynamicUser",
}


def unit_directives(path: Path) -> dict[str, list[str]]:
    """``Section.Key`` -> every value a unit file gives it, in order."""
    directives: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        directives.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return directives


def test_the_csi_unit_runs_the_plugin_as_root_after_the_agent_on_the_agents_config() -> None:
    """prewarm-csi.service requires and follows prewarmd.service, runs the prefix's
    prewarm-csi on the config file prewarmd's ExecStart reads, as root with CAP_SYS_ADMIN
    and the mount system calls, and keeps its records in [csi].state_dir."""
    csi, agent = unit_directives(CSI_UNIT), unit_directives(SYSTEMD / "prewarmd.service")
    assert csi["Unit.Wants"] == csi["Unit.After"] == ["prewarmd.service"]
    assert "Unit.Requires" not in csi  # a stopped agent must not stop unpublishing
    (agent_start,) = agent["Service.ExecStart"]
    config = agent_start.split("--config ", 1)[1]
    assert csi["Service.ExecStart"] == [f"/opt/prewarm/bin/prewarm-csi --config {config}"]
    assert csi.get("Service.User", ["root"]) == ["root"]
    assert "Service.Group" not in csi
    assert "CAP_SYS_ADMIN" in csi["Service.CapabilityBoundingSet"][-1].split()
    assert "@mount" in csi["Service.SystemCallFilter"][0].split()
    (state,) = csi["Service.StateDirectory"]
    assert Path("/var/lib") / state == CsiSettings().state_dir
    assert csi["Install.WantedBy"] == ["multi-user.target"]


def test_the_csi_unit_has_no_setting_that_would_hide_its_mounts_from_the_kubelet() -> None:
    """No setting gives prewarm-csi.service a mount namespace of its own (its mounts would
    stay there); prewarmd.service, which mounts nothing, has several, so the check reads them."""
    keys = {key.partition(".")[2] for key in unit_directives(CSI_UNIT)}
    assert keys & OWN_MOUNT_NAMESPACE == set()
    agent_keys = {key.partition(".")[2] for key in unit_directives(SYSTEMD / "prewarmd.service")}
    assert {"PrivateMounts", "ProtectSystem", "PrivateTmp"} <= agent_keys


def installed_units(prefix: Path, directory: Path) -> Path:
    """Both units as install.sh writes them for ``prefix`` (which gets stand-in commands, as
    systemd-analyze wants them to exist), in ``directory``; the CSI unit's path."""
    (prefix / "bin").mkdir(parents=True)
    for command in ("prewarmd", "prewarm-csi"):
        (prefix / "bin" / command).write_text("#!/bin/sh\nexit 0\n")
        (prefix / "bin" / command).chmod(0o755)
    for unit in (CSI_UNIT, SYSTEMD / "prewarmd.service"):
        (directory / unit.name).write_text(unit.read_text().replace("/opt/prewarm/", f"{prefix}/"))
    return directory / CSI_UNIT.name


def test_the_csi_unit_passes_systemd_analyze_verify_beside_the_agents(tmp_path: Path) -> None:
    """prewarm-csi.service, installed beside prewarmd.service, passes systemd-analyze verify
    without a warning (an unknown key or system call group, a missing unit, would print one)."""
    tool = systemd_tool("systemd-analyze")
    unit = installed_units(tmp_path / "opt", tmp_path)
    result = subprocess.run(
        [tool, "verify", str(unit)], capture_output=True, text=True, check=False, timeout=60
    )
    assert (result.returncode, result.stderr) == (0, "")


def test_the_csi_unit_sandbox_exposure_stays_below_five(tmp_path: Path) -> None:
    """systemd-analyze security rates prewarm-csi.service's exposure below 5.0, a root service
    that mounts being as confined as it can be without a mount namespace."""
    tool = systemd_tool("systemd-analyze")
    unit = installed_units(tmp_path / "opt", tmp_path)
    result = subprocess.run(
        [tool, "security", "--offline=true", "--threshold=50", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if "--offline" in result.stderr and "unrecognized" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline")
    assert result.returncode == 0, result.stdout[-2000:]


# A stand-in interpreter for install.sh: `-m venv` lays out a virtualenv with a prewarmd
# that prints a version, anything else succeeds doing nothing. What is checked is what the
# script does with the system files, not pip.
FAKE_PYTHON = """#!/bin/sh
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
    printf '#!/bin/sh\\necho prewarmd 0.0.0\\n' > "$3/bin/prewarmd"
    chmod +x "$3/bin/python" "$3/bin/prewarmd"
fi
[ "$1" = --version ] && echo "Python 3.11.0"
exit 0
"""


def run_install(tmp_path: Path, *options: str) -> Path:
    """packaging/install.sh with the stand-in interpreter, into a fresh root; the root."""
    python = tmp_path / "python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    root = tmp_path / "root"
    result = subprocess.run(
        [
            "bash",
            str(REPO / "packaging" / "install.sh"),
            f"--python={python}",
            f"--prefix={tmp_path / 'opt' / 'prewarm'}",
            f"--root={root}",
            "--bin-dir=",
            *options,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return root


@pytest.mark.parametrize("csi", [False, True])
def test_install_sh_installs_the_csi_unit_and_enables_it_only_with_csi(
    tmp_path: Path, csi: bool
) -> None:
    """install.sh writes prewarm-csi.service beside prewarmd.service, with ExecStart at its
    prefix, and enables it only when asked (--csi): a node that serves no csi volumes runs
    no root service that mounts."""
    if os.geteuid() != 0:
        pytest.skip("install.sh creates users and chowns under its --root")
    systemd_tool("systemctl")
    root = run_install(tmp_path, *(["--csi"] if csi else []))
    units = root / "etc" / "systemd" / "system"
    prefix = tmp_path / "opt" / "prewarm"
    assert (units / CSI_UNIT.name).read_text() == CSI_UNIT.read_text().replace(
        "/opt/prewarm/", f"{prefix}/"
    )
    assert f"ExecStart={prefix}/bin/prewarm-csi" in (units / CSI_UNIT.name).read_text()
    wanted = units / "multi-user.target.wants"
    assert (wanted / "prewarmd.service").is_symlink()
    assert (wanted / CSI_UNIT.name).is_symlink() is csi


def test_the_systemd_routes_registrar_is_the_daemonsets() -> None:
    """csi-registrar.yaml runs the DaemonSet's registrar container unchanged (same image,
    arguments, security) on the same host directories, in the same privileged namespace."""
    path = K8S / "csi-registrar.yaml"
    pod = find(path, "DaemonSet")["spec"]["template"]["spec"]
    (registrar,) = pod["containers"]
    assert registrar == container("node-driver-registrar")
    ours = {v["name"]: v for v in daemonset_pod()["spec"]["volumes"]}
    assert pod["volumes"] == [ours[m["name"]] for m in registrar["volumeMounts"]]
    labels = find(K8S / "daemonset.yaml", "Namespace")["metadata"]["labels"]
    assert find(path, "Namespace")["metadata"]["labels"] == labels
    assert pod["automountServiceAccountToken"] is False
