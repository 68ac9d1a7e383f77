"""Packaging: the install script in a fresh prefix, the packaged config, the manifests.

The install test is the real thing: a new virtualenv with every dependency from
the package index, the unit, users and cache roots written under a temporary
root, and the installed daemon started and asked for its health. The manifests
are read as YAML and held to what docs/node-setup.md promises about them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import __version__
from agent._config import Settings, load_settings
from agent._uri import parse_uri
from agent.testing import AgentProcess, S3Server, SampleModel

REPO = Path(__file__).resolve().parents[1]
PACKAGING = REPO / "packaging"
AGENT_TOML = PACKAGING / "agent.toml"
UNIT = REPO / "systemd" / "prewarmd.service"
HOST_DIRS = {"/run/prewarm", "/dev/shm/prewarm", "/var/lib/prewarm"}
GID = 2929  # systemd/prewarm.sysusers, packaging/Containerfile, the pod specs
SERVICE = "prewarm.v1.Prewarm"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="creates users and chowns under a temporary root"
)


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PREWARM_", "AWS_"))}


def uncommented(text: str) -> str:
    """agent.toml with its commented-out settings ("#key = value") switched on."""
    return re.sub(r"(?m)^#(?=\w+ = )", "", text)


def flat_keys(document: dict[str, Any], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for name, value in document.items():
        if isinstance(value, dict):
            keys |= flat_keys(value, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def load_yaml(name: str) -> list[dict[str, Any]]:
    with (PACKAGING / name).open() as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc]


def of_kind(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = (doc for doc in documents if doc["kind"] == kind)
    return found


def unit_value(key: str) -> str:
    (line,) = (line for line in UNIT.read_text().splitlines() if line.startswith(f"{key}="))
    return line.partition("=")[2]


# -- install.sh ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Installed:
    source: Path
    prefix: Path
    root: Path


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """packaging/install.sh run once, from a copy of the source tree, into a temp prefix."""
    if os.geteuid() != 0:
        pytest.skip("install.sh creates users and chowns under its --root")
    base = tmp_path_factory.mktemp("install")
    source = base / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("agent", "systemd", "packaging", "docs"):
        shutil.copytree(REPO / part, source / part, ignore=skip)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / part, source / part)
    prefix, root = base / "opt" / "prewarm", base / "root"
    result = subprocess.run(
        ["bash", str(source / "packaging" / "install.sh"), f"--prefix={prefix}", f"--root={root}"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return Installed(source, prefix, root)


@pytest.mark.slow
def test_install_script_gives_a_working_prewarmd_in_a_fresh_prefix(installed: Installed) -> None:
    version = subprocess.run(
        [installed.prefix / "bin" / "prewarmd", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert version.stdout.strip() == f"prewarmd {__version__}"
    assert (installed.root / "usr/local/bin/prewarm").resolve() == installed.prefix / "bin/prewarm"


@pytest.mark.slow
def test_installed_daemon_serves_and_answers_its_health_probe(
    installed: Installed, s3_server: S3Server
) -> None:
    config = installed.root / "etc/prewarm/agent.toml"
    agent = AgentProcess(
        # The installed package, not the checkout (AgentProcess puts it on PYTHONPATH), and
        # no socket group: the prewarm group exists only under the temporary root.
        env=s3_server.env() | {"PYTHONPATH": "", "PREWARM_SOCKET_GROUP": ""},
        argv=[str(installed.prefix / "bin" / "prewarmd"), "--config", str(config)],
    )
    with agent:
        health = subprocess.run(
            [installed.prefix / "bin" / "prewarm", "health", "--socket", str(agent.socket_path)],
            capture_output=True,
            text=True,
            check=False,
        )
    assert (health.returncode, health.stdout) == (0, "SERVING\n")


@pytest.mark.slow
def test_installed_unit_runs_the_prefix_and_passes_systemd_analyze_verify(
    installed: Installed,
) -> None:
    unit = installed.root / "etc/systemd/system/prewarmd.service"
    assert f"ExecStart={installed.prefix}/bin/prewarmd --config /etc/prewarm/agent.toml" in (
        unit.read_text().splitlines()
    )
    assert (
        installed.root / "etc/systemd/system/multi-user.target.wants/prewarmd.service"
    ).is_symlink()
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing; .ci/run should have installed it")
        pytest.skip("systemd-analyze is not installed")
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.slow
def test_install_creates_the_prewarm_group_and_cache_roots(installed: Installed) -> None:
    groups = (installed.root / "etc/group").read_text().splitlines()
    assert any(line.startswith(f"prewarm:x:{GID}:") for line in groups), groups
    for directory in HOST_DIRS:
        info = (installed.root / directory.lstrip("/")).stat()
        assert (info.st_gid, info.st_mode & 0o777) == (GID, 0o755), directory
    assert (installed.root / "etc/prewarm/agent.toml").read_text() == AGENT_TOML.read_text()
    assert (installed.prefix / "share/doc/prewarm/node-setup.md").is_file()


@pytest.mark.slow
def test_reinstall_upgrades_in_place_and_keeps_an_edited_config(installed: Installed) -> None:
    config = installed.root / "etc/prewarm/agent.toml"
    original = config.read_text()
    edited = original + '\n[s3]\nregion = "eu-west-1"\n'
    config.write_text(edited)
    try:
        subprocess.run(
            [
                "bash",
                str(installed.source / "packaging" / "install.sh"),
                f"--prefix={installed.prefix}",
                f"--root={installed.root}",
                # The dependencies are there from the first run; the package is replaced.
                "--pip-arg=--no-deps",
            ],
            capture_output=True,
            env=clean_env(),
            timeout=280,
            check=True,
        )
        assert config.read_text() == edited
        assert (config.parent / "agent.toml.default").read_text() == AGENT_TOML.read_text()
    finally:
        config.write_text(original)
        (config.parent / "agent.toml.default").unlink(missing_ok=True)


# -- the packaged config -------------------------------------------------------------------


def test_packaged_config_lists_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PREWARM_"):
            monkeypatch.delenv(name)
    listed = flat_keys(tomllib.loads(uncommented(AGENT_TOML.read_text())))
    assert listed == flat_keys(Settings().model_dump())


def test_packaged_config_defaults_match_print_config(tmp_path: Path) -> None:
    """Uncommenting any line changes nothing: each shows the value prewarmd would use."""
    every_line_on = tmp_path / "every-line-on.toml"
    every_line_on.write_text(uncommented(AGENT_TOML.read_text()))
    empty = tmp_path / "empty.toml"
    empty.write_text("")

    def print_config(path: Path, *env: str) -> dict[str, Any]:
        result = subprocess.run(
            [sys.executable, "-m", "agent", "--config", str(path), "--print-config"],
            capture_output=True,
            text=True,
            env=clean_env() | dict(item.split("=", 1) for item in env),
            check=True,
        )
        return tomllib.loads(result.stdout)

    assert print_config(every_line_on) == print_config(empty, "PREWARM_SOCKET_GROUP=prewarm")


def test_packaged_config_hands_the_sockets_to_the_prewarm_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PREWARM_SOCKET_GROUP", raising=False)
    assert load_settings(AGENT_TOML).socket_group == "prewarm"


# -- Kubernetes ----------------------------------------------------------------------------


def daemonset_pod() -> dict[str, Any]:
    daemonset = of_kind(load_yaml("k8s/daemonset.yaml"), "DaemonSet")
    pod: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return pod


def test_daemonset_mounts_the_host_directories_the_unit_uses() -> None:
    pod = daemonset_pod()
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert set(host_paths.values()) == HOST_DIRS
    (agent,) = pod["containers"]
    mounted = {m["mountPath"] for m in agent["volumeMounts"] if m["name"] in host_paths}
    assert mounted == HOST_DIRS  # the same paths inside: the agent answers with host paths
    assert set(unit_value("ReadWritePaths").split()) == HOST_DIRS


def test_daemonset_probes_ask_the_grpc_health_service_over_the_socket() -> None:
    (agent,) = daemonset_pod()["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = agent[probe]["exec"]["command"]
        assert command[:2] == ["/opt/prewarm/bin/prewarm", "health"], probe
        assert command[command.index("--socket") + 1] == "/run/prewarm/agent.sock"


def test_daemonset_requests_resources_but_sets_no_memory_limit() -> None:
    (agent,) = daemonset_pod()["containers"]
    assert {"cpu", "memory"} <= set(agent["resources"]["requests"])
    # tmpfs pages the agent writes are charged to its cgroup: a limit would OOM-kill pulls.
    assert "memory" not in agent["resources"].get("limits", {})


def test_daemonset_stop_grace_matches_the_units() -> None:
    pod = daemonset_pod()
    assert pod["terminationGracePeriodSeconds"] == int(unit_value("TimeoutStopSec").rstrip("s"))


def test_daemonset_runs_as_the_images_user_with_a_valid_config(tmp_path: Path) -> None:
    pod = daemonset_pod()
    (agent,) = pod["containers"]
    containerfile = (PACKAGING / "Containerfile").read_text()
    assert f"USER {GID}:{GID}" in containerfile
    assert (agent["securityContext"]["runAsUser"], agent["securityContext"]["runAsGroup"]) == (
        GID,
        GID,
    )
    assert {c["image"] for c in pod["containers"] + pod["initContainers"]} == {agent["image"]}
    config = tmp_path / "agent.toml"
    config.write_text(of_kind(load_yaml("k8s/daemonset.yaml"), "ConfigMap")["data"]["agent.toml"])
    assert load_settings(config).socket_group == "prewarm"


def test_vllm_pod_mounts_socket_and_cache_read_only_at_the_host_paths() -> None:
    (pod,) = load_yaml("k8s/vllm-pod.yaml")
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v}
    (vllm,) = pod["spec"]["containers"]
    mounts = [m for m in vllm["volumeMounts"] if m["name"] in volumes]
    assert {(volumes[m["name"]], m["mountPath"], m["readOnly"]) for m in mounts} == {
        (path, path, True) for path in HOST_DIRS
    }


def test_vllm_pod_launches_through_prewarm_exec() -> None:
    (pod,) = load_yaml("k8s/vllm-pod.yaml")
    (vllm,) = pod["spec"]["containers"]
    command = vllm["command"]
    assert command[:2] == ["prewarm", "exec"]
    parse_uri(command[2])  # a valid s3:// URI
    engine = command[command.index("--") + 1 :]
    assert engine[:3] == ["vllm", "serve", "{model}"]


# -- the probe command --------------------------------------------------------------------


def prewarm_health(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "health", *args],
        capture_output=True,
        text=True,
        env=clean_env() | {"PYTHONPATH": str(REPO)},
        timeout=60,
        check=False,
    )


def test_health_exits_0_when_the_agent_and_its_api_are_serving(
    agent_daemon: AgentProcess,
) -> None:
    socket = str(agent_daemon.socket_path)
    results = [prewarm_health("--socket", socket, "--service", name) for name in ("", SERVICE)]
    assert [(r.returncode, r.stdout) for r in results] == [(0, "SERVING\n")] * 2


def test_health_exits_1_for_a_service_the_agent_does_not_serve(
    agent_daemon: AgentProcess,
) -> None:
    result = prewarm_health(
        "--socket", str(agent_daemon.socket_path), "--service", "nope", "--json"
    )
    assert result.returncode == 1
    assert json.loads(result.stdout)["status"] == "SERVICE_UNKNOWN"


def test_health_exits_3_when_nothing_answers(tmp_path: Path) -> None:
    result = prewarm_health("--socket", str(tmp_path / "agent.sock"))
    assert result.returncode == 3
    assert result.stderr.startswith(
        f"error: no prewarm agent answered on {tmp_path / 'agent.sock'}"
    )


# -- the image -----------------------------------------------------------------------------


def test_containerfile_installs_with_the_install_script() -> None:
    text = (PACKAGING / "Containerfile").read_text()
    assert "packaging/install.sh --prefix /opt/prewarm --no-system" in text
    assert 'ENTRYPOINT ["prewarmd"]' in text
    assert f"--gid {GID}" in text
    assert f"--uid {GID}" in text


def test_image_builder_component_installs_validates_and_tests() -> None:
    (component,) = load_yaml("imagebuilder/prewarm-component.yaml")
    assert component["schemaVersion"] == 1.0
    phases = {phase["name"]: phase["steps"] for phase in component["phases"]}
    assert set(phases) == {"build", "validate", "test"}

    def commands(phase: str) -> str:
        return "\n".join(
            command
            for step in phases[phase]
            if step["action"] == "ExecuteBash"
            for command in step["inputs"]["commands"]
        )

    assert "packaging/install.sh" in commands("build")
    assert "prewarmd --version" in commands("validate")
    assert "systemd-analyze verify /etc/systemd/system/prewarmd.service" in commands("validate")
    assert "prewarm health" in commands("test")


# -- the pod's side ------------------------------------------------------------------------


POD_SCRIPT = """
import json, os, sys
from agent.client import Client, load_safetensors
with Client(sys.argv[1]) as agent, agent.leased(sys.argv[2], client_name="ns/pod") as handle:
    tensors = load_safetensors(handle)
    try:
        (handle.path / "scribble").write_text("x")
        writable = True
    except OSError:
        writable = False
    print(json.dumps({"hit": handle.hit, "tensors": sorted(tensors), "writable": writable}))
"""


@needs_root
def test_a_pod_with_read_only_mounts_can_ensure_lease_and_map_a_model(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """What vllm-pod.yaml does: socket directory and tiers mounted read-only, same paths."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare is not installed")
    root = agent_daemon.root
    view = f'mount --bind {root} {root} && mount -o remount,bind,ro {root} && exec "$@"'
    result = subprocess.run(
        [
            *(unshare, "--mount", "--propagation", "private", "sh", "-c", view, "pod"),
            *(sys.executable, "-c", POD_SCRIPT, str(agent_daemon.socket_path), small_model.uri),
        ],
        capture_output=True,
        text=True,
        env=clean_env() | {"PYTHONPATH": str(REPO)},
        timeout=120,
        check=False,
    )
    if (
        result.returncode != 0
        and "mount" in result.stderr
        and "permission" in result.stderr.lower()
    ):
        pytest.skip(f"cannot make a mount namespace here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "hit": False,
        "tensors": sorted(small_model.tensors),
        "writable": False,
    }
