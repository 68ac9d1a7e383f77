"""packaging/install.sh, for real: a fresh prefix, then the installed daemon asked for its health.

The install builds a new virtualenv with every dependency from the package
index and writes the unit, users and cache roots under a temporary root; it
runs once per module (it takes half a minute) and needs root for the users and
the chowns.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent import __version__
from agent.testing import AgentProcess, S3Server

REPO = Path(__file__).resolve().parents[1]
AGENT_TOML = REPO / "packaging" / "agent.toml"
HOST_DIRS = {"/run/prewarm", "/dev/shm/prewarm", "/var/lib/prewarm"}
GID = 2929  # systemd/prewarm.sysusers


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PREWARM_", "AWS_"))}


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
    """install.sh puts this version's prewarmd in the prefix and links prewarm onto the PATH."""
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
    """The installed prewarmd, run on its installed config, answers the installed prewarm health."""
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
    """The unit runs the prefix's prewarmd, is enabled and passes systemd-analyze verify."""
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
    """install.sh creates the prewarm group, the host roots owned by it, the config and the docs."""
    groups = (installed.root / "etc/group").read_text().splitlines()
    assert any(line.startswith(f"prewarm:x:{GID}:") for line in groups), groups
    for directory in HOST_DIRS:
        info = (installed.root / directory.lstrip("/")).stat()
        assert (info.st_gid, info.st_mode & 0o777) == (GID, 0o755), directory
    assert (installed.root / "etc/prewarm/agent.toml").read_text() == AGENT_TOML.read_text()
    assert (installed.prefix / "share/doc/prewarm/node-setup.md").is_file()


@pytest.mark.slow
def test_reinstall_upgrades_in_place_and_keeps_an_edited_config(installed: Installed) -> None:
    """A second install keeps an edited agent.toml and puts the new default beside it."""
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
