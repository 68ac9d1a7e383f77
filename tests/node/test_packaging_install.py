"""Installs for real: install.sh into a fresh prefix, the wheel, and the pods' client-only install.

The wheel is built once, by ``make wheel``'s own command, offline, from a copy of
the tree without git (so at the release version the docs name): it holds the
``agent`` package whole (``agent._proto`` and ``agent.testing`` included) and
nothing else, and the docs name its file and its size. install.sh installs that
wheel into a fresh prefix once per module, as docs/node-setup.md says to build an
image offline (``--wheel``, ``--no-index``, ``--find-links`` to a wheelhouse; here
one repacked from this venv's own copies of the wheel's declared dependencies, so
no package index is asked: the index's pages and downloads were most of a minute),
and writes the unit, users and cache roots under a temporary root (it needs root
for the users and the chowns). Running install.sh again from the source tree around
it, as Packer and Image Builder do, upgrades that prefix in place to this
checkout's version. The wheel is also installed without extras into another fresh
virtualenv, as a pod's image would: grpcio and protobuf only.
"""

from __future__ import annotations

import base64
import email
import hashlib
import importlib.metadata
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
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
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


def install_sh(installed: Installed, *options: str) -> list[str]:
    """The command running install.sh of ``installed``'s source tree into its prefix and root."""
    script = installed.source / "packaging" / "install.sh"
    prefix, root = f"--prefix={installed.prefix}", f"--root={installed.root}"
    return ["bash", str(script), prefix, root, *options]


def offline_env() -> dict[str, str]:
    """clean_env() without this machine's pip configuration (its indexes and find-links):
    what pip is given on the command line is all it has."""
    return clean_env() | {"PIP_CONFIG_FILE": os.devnull}


@pytest.fixture(scope="module")
def installed(
    tmp_path_factory: pytest.TempPathFactory, built_wheel: Path, wheelhouse: Path
) -> Installed:
    """packaging/install.sh run once, from a copy of the source tree, into a temp prefix: the
    wheel make wheel builds, its dependencies from a wheelhouse and no index (the offline
    image build docs/node-setup.md gives)."""
    if os.geteuid() != 0:
        pytest.skip("install.sh creates users and chowns under its --root")
    base = tmp_path_factory.mktemp("install")
    source = base / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("agent", "systemd", "packaging", "docs"):
        shutil.copytree(REPO / part, source / part, ignore=skip)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / part, source / part)
    done = Installed(source, base / "opt" / "prewarm", base / "root")
    command = install_sh(
        done,
        f"--wheel={built_wheel}",
        "--pip-arg=--no-index",
        f"--pip-arg=--find-links={wheelhouse}",
    )
    result = subprocess.run(
        command, capture_output=True, text=True, env=offline_env(), timeout=280, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return done


def installed_version(installed: Installed) -> str:
    """What the prefix's prewarmd --version prints."""
    version = subprocess.run(
        [installed.prefix / "bin" / "prewarmd", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    return version.stdout.strip()


@pytest.mark.slow
def test_install_script_gives_a_working_prewarmd_in_a_fresh_prefix(installed: Installed) -> None:
    """install.sh puts the wheel's prewarmd (the release's version) in the prefix, and its
    daemon extra's dependencies beside it, and links prewarm onto the PATH."""
    assert installed_version(installed) == f"prewarmd {project_version()}"
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
    """install.sh from the source tree around it, as Packer and Image Builder run it, over the
    wheel's install: the prefix runs this checkout's version, an edited agent.toml is kept and
    the new default is put beside it."""
    config = installed.root / "etc/prewarm/agent.toml"
    original = config.read_text()
    edited = original + '\n[s3]\nregion = "eu-west-1"\n'
    config.write_text(edited)
    try:
        subprocess.run(
            # The dependencies are there from the first run; the package is built from the
            # tree (its build backend from the index) and replaces the wheel's.
            install_sh(installed, "--pip-arg=--no-deps"),
            capture_output=True,
            env=build_env(),
            timeout=280,
            check=True,
        )
        assert installed_version(installed) == f"prewarmd {__version__}"
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


# Extras of the wheel the tests install: install.sh adds daemon (which names cli).
INSTALLED_EXTRAS = frozenset({"daemon"})


def declared_requirements(requires: list[str] | None, extras: frozenset[str]) -> list[Requirement]:
    """The requirements among ``requires`` (Requires-Dist lines) that apply here with
    ``extras`` asked for."""
    environments = [{"extra": extra} for extra in extras] or [{"extra": ""}]
    return [
        requirement
        for requirement in map(Requirement, requires or [])
        if requirement.marker is None
        or any(requirement.marker.evaluate(environment) for environment in environments)
    ]


def dependencies_of(wheel: Path, extras: frozenset[str]) -> list[importlib.metadata.Distribution]:
    """This venv's distributions of everything ``pip install 'WHEEL[EXTRAS]'`` needs: the
    wheel's declared requirements and theirs, all the way down."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = (name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        own = email.message_from_bytes(archive.read(metadata))
    own_name = canonicalize_name(own["Name"])
    found: dict[str, importlib.metadata.Distribution] = {}
    asked: set[tuple[str, frozenset[str]]] = set()
    todo = [(own_name, extras)]
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in asked:
            continue
        asked.add((name, wanted))
        if name == own_name:  # the wheel naming its own extras (daemon names cli)
            requires = own.get_all("Requires-Dist")
        else:
            found[name] = importlib.metadata.distribution(name)
            requires = found[name].requires
        for requirement in declared_requirements(requires, wanted):
            todo.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return list(found.values())


def repacked(distribution: importlib.metadata.Distribution, wheelhouse: Path) -> Path:
    """An installed distribution as a wheel again: its files, its dist-info and its tags, a
    new RECORD; the console scripts an installer writes are left to the next one."""
    tags = [
        line.split(":", 1)[1].strip().split("-")
        for line in (distribution.read_text("WHEEL") or "").splitlines()
        if line.startswith("Tag:")
    ]
    assert tags, f"{distribution.name} was not installed from a wheel"
    tag = "-".join(".".join(sorted({t[i] for t in tags})) for i in range(3))
    name = re.sub(r"[-_.]+", "_", distribution.metadata["Name"]).lower()
    wheel = wheelhouse / f"{name}-{distribution.version}-{tag}.whl"
    entry_points = {entry.name for entry in distribution.entry_points if "scripts" in entry.group}
    site = Path(str(distribution.locate_file("")))
    dist_info = next(f.parts[0] for f in distribution.files or [] if f.name == "METADATA")
    record: list[str] = []
    with zipfile.ZipFile(wheel, "w") as archive:
        for file in distribution.files or []:
            in_wheel = file.as_posix()
            if "__pycache__" in file.parts or (
                file.parent.name == dist_info and file.name in INSTALLER_FILES
            ):
                continue
            data = (site / file).read_bytes()
            if in_wheel.startswith("../"):  # bin/, written by the installer
                assert file.parent.name == "bin", in_wheel
                if file.name in entry_points:
                    continue  # a console script: the next installer writes its own
                # A script of the distribution's own: back where a wheel keeps it, with the
                # shebang an installer replaces with its interpreter.
                in_wheel = f"{dist_info.removesuffix('.dist-info')}.data/scripts/{file.name}"
                if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
                    data = b"#!python\n" + data.split(b"\n", 1)[1]
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{in_wheel},sha256={digest.decode()},{len(data)}")
            archive.writestr(in_wheel, data)
        record.append(f"{dist_info}/RECORD,,")
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return wheel


# What an installer writes into a dist-info (RECORD is made anew), not the wheel's own files.
INSTALLER_FILES = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory, built_wheel: Path) -> Path:
    """Wheels of every distribution the wheel with its daemon extra needs, repacked from this
    venv's installed copies (which pip put there by the same declared requirements): pip
    installs from them with no index, so a missing declared dependency still fails the
    install, and the daemon that runs from the prefix imports only what pip put there."""
    directory = tmp_path_factory.mktemp("wheelhouse")
    for distribution in dependencies_of(built_wheel, INSTALLED_EXTRAS):
        repacked(distribution, directory)
    return directory


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
# dependencies (grpcio's own typing-extensions) and what a fresh virtualenv may start with.
CLIENT_ONLY = {"prewarm-agent", "grpcio", "protobuf", "typing-extensions", "pip", "setuptools"}
DISTRIBUTIONS = (
    "import importlib.metadata as m, json; "
    "print(json.dumps(sorted({d.metadata['Name'].lower().replace('_', '-') "
    "for d in m.distributions()})))"
)


@pytest.fixture(scope="module")
def client_only(
    tmp_path_factory: pytest.TempPathFactory, built_wheel: Path, wheelhouse: Path
) -> Path:
    """A fresh virtualenv with the wheel ``make wheel`` builds installed without extras.

    This venv's pip installs into it (``--python``: no pip of its own to set up first), from
    the wheelhouse, which offers every dependency of the daemon extra: whatever the base
    install brought beyond the client's would be there to be brought."""
    venv = tmp_path_factory.mktemp("client-only") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install"]
    subprocess.run(
        [*pip, "--quiet", "--no-index", f"--find-links={wheelhouse}", built_wheel],
        capture_output=True,
        env=offline_env(),
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
