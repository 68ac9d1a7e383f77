"""Installs for real: install.sh into a fresh prefix, the wheel, and the pods' client-only install.

install.sh builds a new virtualenv with every dependency from the package
index and writes the unit, users and cache roots under a temporary root; it
runs once per module (it takes half a minute) and needs root for the users and
the chowns. The wheel is built once, by ``make wheel``'s own command, offline,
from a copy of the tree without git (so at the release version the docs name):
it holds the ``agent`` package whole (``agent._proto`` and ``agent.testing``
included) and nothing else, and the docs name its file and its size. It is then
installed without extras into another fresh virtualenv, as a pod's image would:
grpcio and protobuf only.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_csi_manifests import project_version

from agent import __version__
from agent.testing import AgentProcess, S3Server, SampleModel

REPO = Path(__file__).resolve().parents[2]
AGENT_TOML = REPO / "packaging" / "agent.toml"
HOST_DIRS = {"/run/prewarm", "/dev/shm/prewarm", "/var/lib/prewarm"}
GID = 2929  # systemd/prewarm.sysusers


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PREWARM_", "AWS_"))}


def build_env() -> dict[str, str]:
    """clean_env() for a build from a copy of the tree: the copy has no git, so
    setuptools-scm would give it fallback_version; this checkout's version instead."""
    return clean_env() | {"SETUPTOOLS_SCM_PRETEND_VERSION_FOR_PREWARM_AGENT": __version__}


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
        env=build_env(),
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
        mode = 0o755 if directory == "/run/prewarm" else 0o711  # tier roots: traverse-only
        assert (info.st_gid, info.st_mode & 0o777) == (GID, mode), directory
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
            env=build_env(),
            timeout=280,
            check=True,
        )
        assert config.read_text() == edited
        assert (config.parent / "agent.toml.default").read_text() == AGENT_TOML.read_text()
    finally:
        config.write_text(original)
        (config.parent / "agent.toml.default").unlink(missing_ok=True)


# -- the wheel ---------------------------------------------------------------------------

# Where people copy wheel names and the wheel's size from.
DOCS = sorted(
    [
        REPO / "README.md",
        REPO / "CONTRIBUTING.md",
        *(REPO / "docs").rglob("*.md"),
        *(path for path in (REPO / "packaging").rglob("*") if path.is_file()),
    ]
)
# A wheel file name as the docs write it; "<version>", "X.Y.Z" and "*" placeholders are no claim.
WHEEL_NAME = re.compile(r"prewarm_agent-[^\s'`\[\]/]+?\.whl")
PLACEHOLDER = re.compile(r"prewarm_agent-(<[^>]+>|X\.Y\.Z|\*)[-.]")
# docs/node-setup.md's "the wheel itself is about 490 KB" (KB: 1,000 bytes).
WHEEL_SIZE = re.compile(r"the wheel itself is about ([\d,]+) KB")


def tracked_tree(destination: Path) -> Path:
    """A copy of what a clone of this checkout holds (tracked and new, unignored files), no git."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        path = REPO / name
        if path.is_file() and not path.is_symlink():  # deleted, or a link (.venv in a worktree)
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination / name)
    return destination


def make_wheel_command(source: Path, wheel_dir: Path) -> list[str]:
    """``make wheel``'s command as the Makefile has it, building ``source`` into ``wheel_dir``."""
    recipe = re.search(r"^wheel:[^\n]*\n\t([^\n]*)\n", (REPO / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile has no wheel target"
    program, *args, tree = shlex.split(recipe[1])
    assert (program, tree) == ("$(PY)", "."), recipe[1]
    return [
        sys.executable,
        *(str(wheel_dir) if arg == "dist" else arg for arg in args),
        str(source),
    ]


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel ``make wheel`` builds, by its own command, from a copy of the tree without git.

    Offline (no index: the build backend is this venv's, --no-build-isolation), and with no
    version pretended, so the copy builds pyproject's fallback_version: the release's name.
    """
    base = tmp_path_factory.mktemp("wheel")
    source = tracked_tree(base / "src")
    env = {k: v for k, v in clean_env().items() if not k.startswith("SETUPTOOLS_SCM_")}
    built = subprocess.run(
        make_wheel_command(source, base / "dist"),
        capture_output=True,
        text=True,
        env=env | {"PIP_NO_INDEX": "1"},
        timeout=280,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (base / "dist").glob("*.whl")
    return wheel


@pytest.mark.slow
def test_the_wheel_holds_the_agent_package_whole_and_nothing_else(built_wheel: Path) -> None:
    """The wheel has every module and type stub of agent/ (agent._proto's generated code and
    agent.testing's test doubles included), py.typed and the three commands; no tests/,
    bench/ or scripts/, nothing beside agent/ but its metadata."""
    names = set(zipfile.ZipFile(built_wheel).namelist())
    dist_info = f"prewarm_agent-{project_version()}.dist-info"
    assert {name.split("/")[0] for name in names} == {"agent", dist_info}
    package = {
        path.relative_to(REPO).as_posix()
        for path in (REPO / "agent").rglob("*")
        if path.suffix in {".py", ".pyi"} and "__pycache__" not in path.parts
    }
    assert package - names == set(), "left out of the wheel"
    assert names - package - {"agent/py.typed"} == {
        f"{dist_info}/{name}"
        for name in ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt", "RECORD")
    }
    for must in (
        "agent/_proto/prewarm/v1/prewarm_pb2.py",
        "agent/_proto/prewarm/v1/prewarm_pb2.pyi",
        "agent/testing/__init__.py",
        "agent/client/__init__.py",
    ):
        assert must in names
    scripts = zipfile.ZipFile(built_wheel).read(f"{dist_info}/entry_points.txt").decode()
    for command in ("prewarmd", "prewarm", "prewarm-csi"):
        assert re.search(rf"^{command} = agent\._scripts:", scripts, re.M), scripts


@pytest.mark.slow
def test_the_docs_name_the_wheel_make_wheel_builds_and_its_size(built_wheel: Path) -> None:
    """Every wheel file name in the README, docs/ and packaging/ is the one make wheel builds
    for the release (py3-none-any included), the README's make wheel line names it, and the
    size docs/node-setup.md gives is the wheel's own, within a fifth."""
    named = {
        f"{path.relative_to(REPO)}: {name}"
        for path in DOCS
        for name in WHEEL_NAME.findall(path.read_text(errors="replace"))
        if not PLACEHOLDER.match(name) and name != built_wheel.name
    }
    assert not named, f"not {built_wheel.name}:\n" + "\n".join(sorted(named))
    make_wheel_line = rf"^\$ make wheel +# -> dist/{re.escape(built_wheel.name)}$"
    assert re.search(make_wheel_line, (REPO / "README.md").read_text(), re.M)
    claims = WHEEL_SIZE.findall((REPO / "docs" / "node-setup.md").read_text())
    assert len(claims) == 1, claims
    claimed = int(claims[0].replace(",", "")) * 1000
    actual = built_wheel.stat().st_size
    assert 0.8 * claimed <= actual <= 1.2 * claimed, f"the wheel is {actual / 1000:.0f} KB"


# -- the wheel, client only ---------------------------------------------------------------

# What `pip install prewarm_agent-*.whl` may bring, and nothing else: the client's two
# dependencies (grpcio's own typing-extensions) and what a fresh virtualenv starts with.
CLIENT_ONLY = {"prewarm-agent", "grpcio", "protobuf", "typing-extensions", "pip", "setuptools"}
DISTRIBUTIONS = (
    "import importlib.metadata as m, json; "
    "print(json.dumps(sorted({d.metadata['Name'].lower().replace('_', '-') "
    "for d in m.distributions()})))"
)


@pytest.fixture(scope="module")
def client_only(tmp_path_factory: pytest.TempPathFactory, built_wheel: Path) -> Path:
    """A fresh virtualenv with the wheel ``make wheel`` builds installed without extras."""
    venv = tmp_path_factory.mktemp("client-only") / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "--quiet", built_wheel],
        capture_output=True,
        env=clean_env(),
        check=True,
        timeout=280,
    )
    return venv


def in_client_only(venv: Path, *argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, env=clean_env(), cwd=venv, timeout=120, check=False
    )


@pytest.mark.slow
def test_the_wheel_without_extras_installs_only_grpcio_and_protobuf(client_only: Path) -> None:
    """pip install of the wheel alone brings the client's two dependencies and nothing else."""
    done = in_client_only(client_only, client_only / "bin" / "python", "-c", DISTRIBUTIONS)
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)) <= CLIENT_ONLY
    assert {"prewarm-agent", "grpcio", "protobuf"} <= set(json.loads(done.stdout))


@pytest.mark.slow
def test_a_client_only_install_ensures_a_model_from_the_agent(
    client_only: Path, agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """In the client-only install, agent.client imports and asks the real agent for a model."""
    code = (
        "import sys\n"
        "from agent.client import ensure, wait_for_agent\n"
        "wait_for_agent(sys.argv[1], 10)\n"
        "print(ensure(sys.argv[2], socket_path=sys.argv[1]).path)\n"
    )
    done = in_client_only(
        client_only,
        client_only / "bin" / "python",
        "-c",
        code,
        agent_daemon.socket_path,
        small_model.uri,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(agent_daemon.shm_root)


@pytest.mark.slow
@pytest.mark.parametrize(("script", "extra"), [("prewarmd", "daemon"), ("prewarm", "cli")])
def test_a_client_only_install_names_the_extra_a_command_needs(
    client_only: Path, script: str, extra: str
) -> None:
    """prewarmd and prewarm in a client-only install exit 2 naming the extra to install, not an
    ImportError traceback."""
    done = in_client_only(client_only, client_only / "bin" / script, "--version")
    assert done.returncode == 2
    assert f"pip install 'prewarm-agent[{extra}]'" in done.stderr
    assert "Traceback" not in done.stderr
