"""The Kubernetes manifests in packaging/: valid for the API, and working as applied.

Every document is validated strictly against the Kubernetes API's own schemas
(kubernetes-validate ships them in the package, so nothing is fetched), for the
oldest and the newest Kubernetes version we claim. Then each manifest is held
to what docs/kubernetes.md promises: metrics a scraper can reach, ConfigMaps
mounted as directories, a config checksum that rolls the pods, memory that
accounts for the shm tier, the mounts and ports pods need, and an IAM policy
that grants what the config reads and nothing more.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from agent_helpers import AgentFactory

from agent._config import Settings, load_settings, parse_size_or_percent
from agent._uri import parse_uri
from agent.client import Client
from agent.prefetch.schema import read_manifest
from agent.service import access

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "packaging" / "k8s"
POLICY = REPO / "packaging" / "iam" / "prewarm-node-policy.json"
UNIT = REPO / "systemd" / "prewarmd.service"
HOST_DIRS = {"/run/prewarm", "/dev/shm/prewarm", "/var/lib/prewarm"}
# prewarm-csi's and its registrar's (tests/node/test_csi_manifests.py checks their use).
CSI_HOST_DIRS = {
    "/var/lib/kubelet",
    "/var/lib/kubelet/plugins/csi.prewarm.io",
    "/var/lib/kubelet/plugins_registry",
    "/var/lib/prewarm-csi",
}
GID = 2929  # systemd/prewarm.sysusers, packaging/Containerfile, the pod specs
MANIFESTS = sorted(K8S.glob("*.yaml"))
POD_EXAMPLES = ("vllm-pod.yaml", "python-client-pod.yaml")
# The oldest Kubernetes an EKS cluster may still run (extended support), and the newest
# whose schemas kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
# Custom resources: their schemas are the operator's, not the API's.
CUSTOM_KINDS = {"PodMonitor"}
# What the agent's headroom over the shm tier must cover: its own RSS and buffers.
AGENT_HEADROOM = 2 * 1024**3


def documents(path: Path) -> list[dict[str, Any]]:
    with path.open() as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc]


def find(path: Path, kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = (
        doc
        for doc in documents(path)
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    )
    return found


def daemonset_pod() -> dict[str, Any]:
    pod: dict[str, Any] = find(K8S / "daemonset.yaml", "DaemonSet", "prewarm")["spec"]["template"]
    return pod


def container(name: str) -> dict[str, Any]:
    """The DaemonSet's container (or init container) of that name."""
    pod = daemonset_pod()["spec"]
    found: dict[str, Any]
    (found,) = (c for c in pod["containers"] + pod["initContainers"] if c["name"] == name)
    return found


def agent_container() -> dict[str, Any]:
    return container("prewarmd")


def config_text() -> str:
    text: str = find(K8S / "daemonset.yaml", "ConfigMap", "prewarm-config")["data"]["agent.toml"]
    return text


def daemonset_settings(tmp_path: Path) -> Settings:
    config = tmp_path / "agent.toml"
    config.write_text(config_text())
    return load_settings(config)


def unit_value(key: str) -> str:
    (line,) = (line for line in UNIT.read_text().splitlines() if line.startswith(f"{key}="))
    return line.partition("=")[2]


# -- valid for the API ---------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_every_manifest_validates_strictly_against_the_kubernetes_schemas(
    path: Path, version: str
) -> None:
    """Each document of each manifest in packaging/k8s passes kubernetes-validate in strict
    mode (no unknown field); custom resources are the only ones without an API schema."""
    for doc in documents(path):
        if doc["kind"] in CUSTOM_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            continue
        kubernetes_validate.validate(doc, version, strict=True)


# -- the DaemonSet: metrics ------------------------------------------------------------------


def test_metrics_are_on_a_named_container_port_bound_to_the_pod_ip(tmp_path: Path) -> None:
    """The config's metrics port is the container's "metrics" port and the scrape annotation's,
    and the agent binds it on the pod's IP (not 127.0.0.1 in the pod's own namespace)."""
    port = daemonset_settings(tmp_path).metrics.port
    agent = agent_container()
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in agent["ports"]
    env = {item["name"]: item for item in agent["env"]}
    assert env["PREWARM_METRICS__ADDRESS"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    annotations = daemonset_pod()["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"]) == (
        "true",
        str(port),
    )


def test_the_podmonitor_selects_the_agents_pods_on_their_metrics_port() -> None:
    """The PodMonitor's selector matches the DaemonSet's pod labels, in its namespace, on the
    port named metrics."""
    monitor = find(K8S / "podmonitor.yaml", "PodMonitor")
    daemonset = find(K8S / "daemonset.yaml", "DaemonSet", "prewarm")
    assert monitor["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    labels = daemonset_pod()["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


# -- the DaemonSet: config ---------------------------------------------------------------------


def test_configmaps_are_mounted_as_directories_where_the_agent_reads_them(
    tmp_path: Path,
) -> None:
    """Both ConfigMaps are directory mounts (no subPath, so edits reach the pod): the config
    where --config points, the manifests at the agent's manifests.directory."""
    agent = agent_container()
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    assert not [m for m in agent["volumeMounts"] if "subPath" in m]
    volumes = {v["name"]: v for v in daemonset_pod()["spec"]["volumes"]}
    config_path = Path(agent["args"][agent["args"].index("--config") + 1])
    assert volumes["config"]["configMap"]["name"] == "prewarm-config"
    assert Path(mounts["config"]["mountPath"]) == config_path.parent
    assert config_path.name in find(K8S / "daemonset.yaml", "ConfigMap", "prewarm-config")["data"]
    assert volumes["models"]["configMap"]["name"] == "prewarm-models"
    assert Path(mounts["models"]["mountPath"]) == daemonset_settings(tmp_path).manifests.directory


def test_the_models_configmap_holds_valid_manifests(tmp_path: Path) -> None:
    """Each file of prewarm-models parses as a prefetch manifest (the example lists none)."""
    data = find(K8S / "daemonset.yaml", "ConfigMap", "prewarm-models")["data"]
    for name, text in data.items():
        assert name.endswith(".toml"), name
        (tmp_path / name).write_text(text)
        assert read_manifest(tmp_path / name) == ()


def test_the_pod_template_carries_the_configs_checksum() -> None:
    """prewarm.io/config-sha256 is the sha256 of prewarm-config's agent.toml, so a config edit
    that updates it (as the docs say) rolls the pods."""
    digest = hashlib.sha256(config_text().encode()).hexdigest()
    annotations = daemonset_pod()["metadata"]["annotations"]
    assert annotations["prewarm.io/config-sha256"] == digest, (
        f"set prewarm.io/config-sha256 to {digest} in packaging/k8s/daemonset.yaml"
    )


def test_the_daemonsets_config_starts_an_agent_that_serves(start_agent: AgentFactory) -> None:
    """The ConfigMap's agent.toml, as shipped (sources, compile cache, budgets), starts a real
    agent; only the machine's own parts differ here (a free metrics port, no prewarm group)."""
    config = config_text().replace('socket_group = "prewarm"', 'socket_group = ""')
    config = config.replace("port = 9464", "port = 0")
    agent = start_agent(config)
    with Client(agent.socket_path) as client:
        assert client.status().version


# -- the DaemonSet: resources, security ----------------------------------------------------------


def test_memory_request_and_limit_cover_the_shm_budget_and_the_agent(tmp_path: Path) -> None:
    """shm tier pages are charged to the agent's cgroup: the budget is an absolute size, and the
    memory request equals the limit and covers it plus the agent's headroom."""
    fraction, budget = parse_size_or_percent(daemonset_settings(tmp_path).tiers.shm_budget)
    assert (fraction, budget > 0) == (0.0, True)  # a % of the node's RAM, not of the limit
    resources = agent_container()["resources"]
    request = quantity_bytes(resources["requests"]["memory"])
    assert request == quantity_bytes(resources["limits"]["memory"])
    assert request >= budget + AGENT_HEADROOM


_BINARY_SUFFIXES = {"": 0, "Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4}


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity with a binary suffix (18Gi) in bytes."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", quantity)
    assert match, quantity
    return int(match[1]) << (10 * _BINARY_SUFFIXES[match[2] or ""])


def test_the_namespace_admits_the_hostpath_pods_it_needs() -> None:
    """hostPath volumes are forbidden by the baseline Pod Security standard: the namespace says
    privileged, and its own pods are the only ones using hostPath in it: the agent's
    directories, the host's /dev/shm, and the CSI plugin's and registrar's."""
    namespace = find(K8S / "daemonset.yaml", "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    host_paths = {
        v["hostPath"]["path"] for v in daemonset_pod()["spec"]["volumes"] if "hostPath" in v
    }
    # the host's /dev/shm: the init container's
    assert host_paths == HOST_DIRS | {"/dev/shm"} | CSI_HOST_DIRS


def test_the_daemonset_mounts_the_host_directories_the_unit_uses() -> None:
    """The DaemonSet mounts the unit's writable host directories at the same paths inside."""
    pod = daemonset_pod()["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounted = {m["mountPath"] for m in agent_container()["volumeMounts"] if m["name"] in host_paths}
    assert mounted == HOST_DIRS  # the same paths inside: the agent answers with host paths
    assert set(unit_value("ReadWritePaths").split()) == HOST_DIRS


def test_the_init_container_claims_the_shm_root_in_the_hosts_dev_shm() -> None:
    """Before the agent starts, the init container runs `prewarmd --claim-roots --owner 2929`
    with the daemon's config and the host's /dev/shm itself mounted (not the shm root's own
    mount, which would be the planted directory), as root with FOWNER for the sticky rename."""
    pod = daemonset_pod()["spec"]
    (init,) = pod["initContainers"]
    script = " ".join(init["command"])
    assert f"--config {agent_container()['args'][-1]} --claim-roots --owner {GID}" in script
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: host_paths.get(m["name"]) for m in init["volumeMounts"]}
    assert mounts["/dev/shm"] == "/dev/shm"
    assert "/dev/shm/prewarm" not in mounts
    assert {"CHOWN", "FOWNER"} <= set(init["securityContext"]["capabilities"]["add"])


def test_the_daemonset_probes_ask_the_grpc_health_service_over_the_socket() -> None:
    """Every DaemonSet probe runs prewarm health on the agent's socket."""
    agent = agent_container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = agent[probe]["exec"]["command"]
        assert command[:2] == ["/opt/prewarm/bin/prewarm", "health"], probe
        assert command[command.index("--socket") + 1] == "/run/prewarm/agent.sock"


def test_the_daemonset_stop_grace_matches_the_units() -> None:
    """The pod's termination grace equals the unit's TimeoutStopSec."""
    grace = daemonset_pod()["spec"]["terminationGracePeriodSeconds"]
    assert grace == int(unit_value("TimeoutStopSec").rstrip("s"))


def test_the_daemonset_runs_as_the_images_user_and_the_image_has_models_d() -> None:
    """The agent runs as the image's uid/gid, one image for all of prewarm's containers (the
    CSI registrar is the only other image), and the image makes the manifests directory the
    ConfigMap is mounted on."""
    containerfile = (REPO / "packaging" / "Containerfile").read_text()
    assert f"USER {GID}:{GID}" in containerfile
    assert "install -d -m 0755 /etc/prewarm/models.d" in containerfile
    security = agent_container()["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == (GID, GID)
    pod = daemonset_pod()["spec"]
    images = {c["name"]: c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert images.pop("node-driver-registrar").startswith(
        "registry.k8s.io/sig-storage/csi-node-driver-registrar:"
    )
    assert set(images) == {"own-host-dirs", "prewarmd", "prewarm-csi"}
    assert set(images.values()) == {agent_container()["image"]}


def test_the_agent_itself_has_no_kubernetes_api_access() -> None:
    """No role is bound to the agent's service account: only the opt-in node-readiness
    DaemonSet's may get and patch nodes."""
    bindings = [
        doc
        for path in MANIFESTS
        for doc in documents(path)
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding")
    ]
    subjects = {s["name"] for binding in bindings for s in binding["subjects"]}
    assert subjects == {"prewarm-node-ready"}
    role = find(K8S / "node-readiness.yaml", "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]


# -- the pods ------------------------------------------------------------------------------------


def example_pod(name: str) -> dict[str, Any]:
    return find(K8S / name, "Pod")


@pytest.mark.parametrize("name", POD_EXAMPLES)
def test_example_pods_mount_socket_and_cache_read_only_at_the_host_paths(name: str) -> None:
    """Each example pod mounts the socket directory and both tiers read-only at the host paths."""
    pod = example_pod(name)["spec"]
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    (main,) = pod["containers"]
    mounts = [m for m in main["volumeMounts"] if m["name"] in volumes]
    assert {(volumes[m["name"]], m["mountPath"], m["readOnly"]) for m in mounts} == {
        (path, path, True) for path in HOST_DIRS
    }


@pytest.mark.parametrize("name", POD_EXAMPLES)
def test_example_pods_ask_for_models_the_daemonsets_sources_allow(
    name: str, tmp_path: Path
) -> None:
    """The model each example pod names is within the DaemonSet's access.sources."""
    text = yaml.safe_dump(example_pod(name))
    uris = set(re.findall(r"s3://[a-z0-9.-]+/[^\s'\"]*", text))
    assert uris
    node, _ = access.tenants_from_settings(daemonset_settings(tmp_path))
    for uri in uris:
        access.check_source(parse_uri(uri), access.Requester(node))


def test_the_vllm_pod_launches_through_prewarm_exec_and_waits_for_the_agent() -> None:
    """The vLLM pod starts through prewarm exec with {model} in its argv and a bounded wait for
    an agent that is not serving yet."""
    (vllm,) = example_pod("vllm-pod.yaml")["spec"]["containers"]
    command = vllm["command"]
    assert command[:2] == ["prewarm", "exec"]
    engine = command[command.index("--") + 1 :]
    assert engine[:3] == ["vllm", "serve", "{model}"]
    env = {item["name"]: item.get("value") for item in vllm["env"]}
    assert float(env["PREWARM_WAIT_FOR_AGENT"]) > 0


def test_the_python_client_pod_waits_for_the_agent_in_an_init_container() -> None:
    """The client pod's init container waits for SERVING with prewarm health --wait-for-agent on
    the socket it mounts, and the pod joins the sockets' group."""
    pod = example_pod("python-client-pod.yaml")["spec"]
    (wait,) = pod["initContainers"]
    command = wait["command"]
    assert command[:3] == ["/opt/prewarm/bin/prewarm", "health", "--wait-for-agent"]
    assert command[command.index("--socket") + 1] == "/run/prewarm/agent.sock"
    assert {m["mountPath"] for m in wait["volumeMounts"]} == {"/run/prewarm"}
    assert GID in pod["securityContext"]["supplementalGroups"]


# -- node readiness ------------------------------------------------------------------------------


FAKE_KUBECTL = """#!/bin/sh
echo "$*" >> "$KUBECTL_LOG"
case "$1" in get) echo "$FAKE_TAINTS" ;; esac
"""


@pytest.mark.parametrize(
    ("taints", "removed"),
    [("nvidia.com/gpu prewarm.io/agent-not-ready", True), ("nvidia.com/gpu", False), ("", False)],
)
def test_marking_a_node_labels_it_and_removes_only_the_startup_taint(
    tmp_path: Path, taints: str, removed: bool
) -> None:
    """node-readiness.yaml's script labels the node, and removes the startup taint when the node
    has it (and only then: removing a missing taint would fail the init container forever)."""
    pod = find(K8S / "node-readiness.yaml", "DaemonSet")["spec"]["template"]["spec"]
    mark = next(c for c in pod["initContainers"] if c["name"] == "mark-node")
    kubectl = tmp_path / "bin" / "kubectl"
    kubectl.parent.mkdir()
    kubectl.write_text(FAKE_KUBECTL)
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "kubectl.log"
    env = {
        "PATH": f"{kubectl.parent}:{os.environ['PATH']}",
        "NODE_NAME": "ip-10-0-0-1",
        "KUBECTL_LOG": str(log),
        "FAKE_TAINTS": taints,
    }
    subprocess.run([*mark["command"], *mark["args"]], env=env, check=True, timeout=30)
    calls = log.read_text().splitlines()
    assert calls[0] == "label node ip-10-0-0-1 prewarm.io/agent=ready --overwrite"
    untaint = "taint node ip-10-0-0-1 prewarm.io/agent-not-ready:NoSchedule-"
    assert (untaint in calls) is removed


def test_the_readiness_wait_uses_the_agents_socket_and_health_service() -> None:
    """The readiness DaemonSet waits with prewarm health --wait-for-agent on the agent's socket,
    mounted read-only, before it marks the node."""
    pod = find(K8S / "node-readiness.yaml", "DaemonSet")["spec"]["template"]["spec"]
    wait, mark = pod["initContainers"]
    assert (wait["name"], mark["name"]) == ("wait-for-agent", "mark-node")
    assert wait["command"][1:3] == ["health", "--wait-for-agent"]
    assert wait["command"][wait["command"].index("--socket") + 1] == "/run/prewarm/agent.sock"
    assert pod["tolerations"] == [{"operator": "Exists"}]


# -- the IAM policy ------------------------------------------------------------------------------


def policy_statements() -> list[dict[str, Any]]:
    statements: list[dict[str, Any]] = json.loads(POLICY.read_text())["Statement"]
    return statements


def listed(value: str | list[str]) -> list[str]:
    """An IAM field that holds one string or a list of them, as a list."""
    return [value] if isinstance(value, str) else list(value)


def statements(action: str) -> list[dict[str, Any]]:
    return [s for s in policy_statements() if action in listed(s["Action"])]


def policy_actions() -> set[str]:
    return {action for s in policy_statements() for action in listed(s["Action"])}


def resources(statement: dict[str, Any]) -> list[str]:
    return listed(statement["Resource"])


def test_the_iam_policy_grants_only_reads_on_models_and_reads_writes_on_compile_caches(
    tmp_path: Path,
) -> None:
    """Every model source in the DaemonSet's config may be listed (by prefix) and read; the
    compile-cache prefix read and written; no other action, no wildcard action or resource."""
    assert policy_actions() == {
        "s3:ListBucket",
        "s3:GetObject",
        "s3:PutObject",
        "s3:AbortMultipartUpload",
    }
    assert all(statement["Effect"] == "Allow" for statement in policy_statements())
    settings = daemonset_settings(tmp_path)
    compile_uri = parse_uri(str(settings.compile_cache.uri))
    readable = {arn for s in statements("s3:GetObject") for arn in resources(s)}
    writable = {arn for s in statements("s3:PutObject") for arn in resources(s)}
    listable = {
        (arn, prefix)
        for s in statements("s3:ListBucket")
        for arn in resources(s)
        for prefix in s.get("Condition", {}).get("StringLike", {}).get("s3:prefix", ["*"])
    }
    for pattern in settings.access.sources:
        uri = parse_uri(pattern.removesuffix("*"))
        if uri == compile_uri:
            continue
        assert f"arn:aws:s3:::{uri.bucket}/{uri.prefix}*" in readable, pattern
        assert (f"arn:aws:s3:::{uri.bucket}", f"{uri.prefix}*") in listable, pattern
    compile_objects = f"arn:aws:s3:::{compile_uri.bucket}/{compile_uri.prefix}*"
    assert compile_objects in readable & writable
    # S3 answers a missing key 404 (not uploaded yet) only to a caller that may list the
    # bucket: the compile cache's first restore on a new key depends on it.
    assert (f"arn:aws:s3:::{compile_uri.bucket}", "*") in listable
    assert writable == {compile_objects}
    assert not [arn for arn in readable | writable if arn.endswith(":::*") or arn == "*"]


# S3 calls in agent/source and the IAM action each needs. A new call fails this test until it
# is added here and to packaging/iam/prewarm-node-policy.json (if the agent makes it).
S3_CALLS = {
    "list_objects_v2": "s3:ListBucket",
    "get_object": "s3:GetObject",
    "head_object": "s3:GetObject",
    "put_object": "s3:PutObject",
    "create_multipart_upload": "s3:PutObject",
    "upload_part": "s3:PutObject",
    "complete_multipart_upload": "s3:PutObject",
    "abort_multipart_upload": "s3:AbortMultipartUpload",
    # ObjectSource.delete_object: no caller in the agent (tests only), so not granted.
    "delete_object": "s3:DeleteObject",
}


def test_every_s3_call_the_source_makes_is_mapped_to_an_iam_action() -> None:
    """The S3 calls in agent/source are the ones the policy was written for."""
    source = "\n".join(path.read_text() for path in (REPO / "agent" / "source").glob("*.py"))
    calls = set(re.findall(r"\.(\w+)\(\s*Bucket=", source)) - {"paginate"}
    calls |= set(re.findall(r'get_paginator\("(\w+)"\)', source))
    assert calls == set(S3_CALLS)
    unused = {"delete_object"}
    assert {S3_CALLS[call] for call in set(S3_CALLS) - unused} == policy_actions()


# -- node-readiness: its own node only -------------------------------------------------------

READY_ACCOUNT = "system:serviceaccount:prewarm-system:prewarm-node-ready"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


def _node(labels: dict[str, str], taints: list[str], *, cordoned: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"taints": [{"key": k, "effect": "NoSchedule"} for k in taints]}
    if cordoned:
        spec["unschedulable"] = True
    return {"metadata": {"name": "ip-10-0-0-1", "labels": labels}, "spec": spec}


def _admission_denials(
    old: dict[str, Any], new: dict[str, Any], *, user: str = READY_ACCOUNT, node: str = ""
) -> list[str] | None:
    """The messages of node-readiness.yaml's policy's failed validations for an update of
    ``old`` to ``new`` by ``user`` whose token is bound to a pod on ``node`` (None: the policy
    does not match the request), evaluated with a CEL interpreter as the API server would."""
    import celpy  # the dev extra's; only these tests use it
    from celpy.adapter import json_to_cel

    policy = find(K8S / "node-readiness.yaml", "ValidatingAdmissionPolicy")["spec"]
    env = celpy.Environment()

    def run(expression: str, activation: dict[str, Any]) -> Any:
        return env.program(env.compile(expression)).evaluate(activation)

    extra = {NODE_NAME_EXTRA: [node]} if node else {}
    activation: dict[str, Any] = {
        "object": json_to_cel(new),
        "oldObject": json_to_cel(old),
        "request": json_to_cel({"userInfo": {"username": user, "extra": extra}}),
    }
    if not all(run(c["expression"], activation) for c in policy["matchConditions"]):
        return None
    variables = {v["name"]: run(v["expression"], activation) for v in policy["variables"]}
    activation["variables"] = celpy.celtypes.MapType(
        {celpy.celtypes.StringType(k): v for k, v in variables.items()}
    )
    return [v["message"] for v in policy["validations"] if not run(v["expression"], activation)]


def test_the_readiness_account_may_mark_only_its_own_node_and_only_its_label_and_taint() -> None:
    """The admission policy lets the readiness account add its label and drop its startup taint
    on the node its pod runs on, and denies the same on another node, any other label or taint,
    and a cordon; other users' updates are not its business."""
    old = _node({"zone": "a"}, ["prewarm.io/agent-not-ready", "nvidia.com/gpu"])
    marked = _node({"zone": "a", "prewarm.io/agent": "ready"}, ["nvidia.com/gpu"])
    assert _admission_denials(old, marked, node="ip-10-0-0-1") == []
    assert _admission_denials(old, marked, node="ip-10-0-0-2") == [
        "prewarm-node-ready may change only the node its own pod runs on"
    ]
    assert _admission_denials(old, marked) == [
        "prewarm-node-ready may change only the node its own pod runs on"
    ]
    relabelled = _node({"zone": "b"}, ["prewarm.io/agent-not-ready", "nvidia.com/gpu"])
    untainted = _node({"zone": "a"}, ["prewarm.io/agent-not-ready"])
    cordoned = _node({"zone": "a"}, ["prewarm.io/agent-not-ready", "nvidia.com/gpu"], cordoned=True)
    assert _admission_denials(old, relabelled, node="ip-10-0-0-1") == [
        "prewarm-node-ready may change only the prewarm.io/agent label"
    ]
    assert _admission_denials(old, untainted, node="ip-10-0-0-1") == [
        "prewarm-node-ready may remove only the prewarm.io/agent-not-ready taint"
    ]
    assert _admission_denials(old, cordoned, node="ip-10-0-0-1") == [
        "prewarm-node-ready may not cordon or uncordon a node"
    ]
    assert _admission_denials(old, cordoned, user="kubernetes-admin") is None
    binding = find(K8S / "node-readiness.yaml", "ValidatingAdmissionPolicyBinding")["spec"]
    assert (binding["policyName"], binding["validationActions"]) == ("prewarm-node-ready", ["Deny"])


def test_the_readiness_token_reaches_only_the_container_that_calls_the_api() -> None:
    """No token is automounted; a bound token is projected into mark-node alone, and the
    container that waits for the agent runs as nobody in the socket group, not as the agent."""
    pod = find(K8S / "node-readiness.yaml", "DaemonSet")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    token = next(v for v in pod["volumes"] if v["name"] == "api-token")
    assert {"serviceAccountToken"} <= {k for s in token["projected"]["sources"] for k in s}
    containers = pod["initContainers"] + pod["containers"]
    holders = [
        c["name"] for c in containers for m in c.get("volumeMounts", []) if m["name"] == "api-token"
    ]
    assert holders == ["mark-node"]
    wait = next(c for c in containers if c["name"] == "wait-for-agent")
    assert (wait["securityContext"]["runAsUser"], wait["securityContext"]["runAsGroup"]) == (
        65534,
        GID,
    )
