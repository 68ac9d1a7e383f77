"""Packaging: the packaged config, the health probe, the image and the pod's view.

The Image Builder component is read as YAML and held to what docs/node-setup.md
promises about it; the Kubernetes manifests are tested in test_k8s_manifests.py
and the install script in test_packaging_install.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent._config import Settings, load_settings
from agent.testing import AgentProcess, InProcessAgent, S3Server, SampleModel

REPO = Path(__file__).resolve().parents[2]
PACKAGING = REPO / "packaging"
AGENT_TOML = PACKAGING / "agent.toml"
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


# -- the packaged config -------------------------------------------------------------------


def test_packaged_config_lists_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """packaging/agent.toml names every setting the daemon has, no more and no fewer."""
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
    """The packaged config gives the sockets to the prewarm group."""
    monkeypatch.delenv("PREWARM_SOCKET_GROUP", raising=False)
    assert load_settings(AGENT_TOML).socket_group == "prewarm"


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
    """prewarm health exits 0 and prints SERVING for the overall and the API service."""
    socket = str(agent_daemon.socket_path)
    results = [prewarm_health("--socket", socket, "--service", name) for name in ("", SERVICE)]
    assert [(r.returncode, r.stdout) for r in results] == [(0, "SERVING\n")] * 2


def test_health_exits_1_for_a_service_the_agent_does_not_serve(
    agent_daemon: AgentProcess,
) -> None:
    """prewarm health exits 1 for an unknown service and says SERVICE_UNKNOWN in JSON."""
    result = prewarm_health(
        "--socket", str(agent_daemon.socket_path), "--service", "nope", "--json"
    )
    assert result.returncode == 1
    assert json.loads(result.stdout)["status"] == "SERVICE_UNKNOWN"


def test_health_exits_3_when_nothing_answers(tmp_path: Path) -> None:
    """prewarm health exits 3 with a plain error when no agent listens on the socket."""
    result = prewarm_health("--socket", str(tmp_path / "agent.sock"))
    assert result.returncode == 3
    assert result.stderr.startswith(
        f"error: cannot reach the prewarm agent at {tmp_path / 'agent.sock'}: "
    )


def test_health_with_wait_for_agent_waits_for_an_agent_that_starts_later(
    s3_server: S3Server,
) -> None:
    """`prewarm health --wait-for-agent` (an init container's wait) started before the agent
    exits 0 once the agent serves, and 3 with a sentence when none comes in time."""
    agent = InProcessAgent(env=s3_server.env())
    try:
        health = [sys.executable, "-m", "agent.cli", "health", "--wait-for-agent", "60"]
        waiting = subprocess.Popen(
            [*health, "--socket", str(agent.socket_path)],
            env=clean_env() | {"PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert waiting.stderr is not None
        said = waiting.stderr.readline()
        assert said.startswith("prewarm: the agent is not serving yet"), said
        agent.start()
        stdout, stderr = waiting.communicate(timeout=60)
        assert (waiting.returncode, stdout) == (0, "SERVING\n"), stderr
    finally:
        agent.close()
    gone = prewarm_health("--wait-for-agent", "0.5", "--socket", str(agent.socket_path))
    assert gone.returncode == 3
    assert f"no prewarm agent answered on {agent.socket_path} within 0.5 s" in gone.stderr


# -- the image -----------------------------------------------------------------------------


def test_containerfile_installs_with_the_install_script() -> None:
    """The Containerfile installs with install.sh and makes the prewarm user with the fixed gid."""
    text = (PACKAGING / "Containerfile").read_text()
    assert "packaging/install.sh --prefix /opt/prewarm --no-system" in text
    assert 'ENTRYPOINT ["prewarmd"]' in text
    assert f"--gid {GID}" in text
    assert f"--uid {GID}" in text


def test_image_builder_component_installs_validates_and_tests() -> None:
    """The Image Builder component installs with install.sh, verifies the unit and probes health."""
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
    assert "pip show --quiet prewarm-agent" in commands("validate")
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
