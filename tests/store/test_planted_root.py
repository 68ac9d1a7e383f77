"""A tier root another user made first in a shared directory (issue 16, hole 9).

Anyone may create ``/dev/shm/prewarm`` before the agent does, and the agent used to refuse to
start on it (even after the DaemonSet's chown or systemd-tmpfiles ran). In a directory every
user may write but only owners may rename in (sticky, like /dev/shm), the agent now swaps
what is there for a fresh directory of its own in one atomic exchange, leaving the other
user's entry beside it under a ``.planted-`` name, never entered, followed or deleted.

The other user is uid 65534, really: a subprocess of the system's Python with that uid.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.client import Client, IntegrityError
from agent.testing import AgentProcess, S3Server, SampleModel

NOBODY = 65534
# The agent's user when `prewarmd --claim-roots --owner` prepares roots for it.
AGENT_USER = 65533
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")

# What the other user plants: the root, something in it, and a link out of it.
PLANT = r"""
import os, sys
root = sys.argv[1]
if sys.argv[2] == "symlink":
    os.symlink("/etc", root)
else:
    os.mkdir(root, 0o777)
    os.chmod(root, 0o777)
    os.mkdir(os.path.join(root, "snapshots"), 0o777)
    with open(os.path.join(root, "mine.txt"), "w") as handle:
        handle.write("planted")
    os.symlink("/etc", os.path.join(root, "trash"))
"""

pytestmark = pytest.mark.skipif(
    SYSTEM_PYTHON is None or os.geteuid() != 0, reason="needs root and /usr/bin/python3"
)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory like /dev/shm: root's, mode 1777, reachable by every user."""
    top = Path(tempfile.mkdtemp(prefix="pw-planted-", dir="/tmp"))
    top.chmod(0o755)
    shared = top / "devshm"
    shared.mkdir()
    shared.chmod(0o1777)
    try:
        yield shared
    finally:
        shutil.rmtree(top)


def _plant(root: Path, kind: str) -> None:
    assert SYSTEM_PYTHON is not None
    subprocess.run(
        [SYSTEM_PYTHON, "-I", "-c", PLANT, str(root), kind],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        check=True,
        timeout=60,
        cwd="/",
    )


def _tree(path: Path) -> dict[str, tuple[int, int, str]]:
    """Each entry under (and including, as ".") ``path``: owner, mode and a link's target; no
    link is followed."""
    found: dict[str, tuple[int, int, str]] = {}
    for entry in [path, *(path.rglob("*") if not path.is_symlink() else [])]:
        info = entry.lstat()
        target = str(entry.readlink()) if entry.is_symlink() else ""
        found[entry.relative_to(path).as_posix()] = (
            info.st_uid,
            stat.S_IMODE(info.st_mode),
            target,
        )
    return found


def _planted_beside(root: Path) -> Path:
    (moved,) = root.parent.glob(f"{root.name}.planted-*")
    return moved


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_a_root_another_user_made_first_is_moved_aside_and_the_agent_starts(
    s3_server: S3Server, shared: Path, small_model: SampleModel, kind: str
) -> None:
    """Another user's directory (with a file and a link to /etc in it) or link at the shm root:
    the agent starts, serves a pull from a root of its own, and the planted entry sits beside it
    with its contents untouched (a directory made root's, mode 000); after a restart the root is
    the agent's and its cache is kept."""
    root = shared / "prewarm"
    _plant(root, kind)
    planted = _tree(root)
    agent = AgentProcess(env=s3_server.env())
    agent.shm_root = root
    try:
        agent.start()
        with Client(agent.socket_path) as client:
            cold = client.ensure(small_model.uri, tier="shm")
        assert cold.path.is_relative_to(root)
        info = root.lstat()
        assert (stat.S_ISDIR(info.st_mode), info.st_uid, stat.S_IMODE(info.st_mode)) == (
            True,
            0,
            0o711,
        )
        moved = _planted_beside(root)
        if kind == "directory":  # closed off where it is: root's, mode 000, contents as made
            planted["."] = (0, 0o000, "")
        assert _tree(moved) == planted
        assert f"{moved}" in agent.log_text()
        agent.restart()
        with Client(agent.socket_path) as client:
            assert client.ensure(small_model.uri, tier="shm").hit
        assert len(list(shared.glob("prewarm.planted-*"))) == 1
    finally:
        agent.close()


def test_claim_roots_prepares_a_shared_root_for_an_agent_that_is_not_root(
    shared: Path, tmp_path: Path
) -> None:
    """`prewarmd --claim-roots --owner UID`, run as root before an unprivileged agent starts
    (the systemd unit's and the DaemonSet's first step): a planted shm root is moved aside and
    the root is a fresh private directory of that uid (the agent opens it to traversal when it
    starts) and the planted one is root's, mode 000; a disk root under a private parent is left
    for the agent to make. Exit 0, one line per root on stderr."""
    root = shared / "prewarm"
    _plant(root, "directory")
    disk = tmp_path / "disk"
    (tmp_path / "agent.toml").write_text("")
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREWARM_")} | {
        "PREWARM_TIERS__SHM_ROOT": str(root),
        "PREWARM_TIERS__DISK_ROOT": str(disk),
        "PREWARM_CONFIG": str(tmp_path / "agent.toml"),
    }
    result = subprocess.run(
        [sys.executable, "-m", "agent", "--claim-roots", "--owner", str(AGENT_USER)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    info = root.lstat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (AGENT_USER, 0o700)
    planted = _planted_beside(root).lstat()
    assert (planted.st_uid, stat.S_IMODE(planted.st_mode)) == (0, 0o000)  # closed off in place
    assert not disk.exists()
    assert f"moved {root}" in result.stderr


READ_AS_NOBODY = r"""
import sys
try:
    print(open(sys.argv[1]).read())
except PermissionError:
    print("refused")
"""


def test_a_view_of_the_planted_root_made_before_the_claim_shows_nothing_of_it(
    s3_server: S3Server, shared: Path
) -> None:
    """A pod that mounted the planted directory before the agent moved it aside keeps that very
    directory at the root's path; once the agent has claimed the root, a non-root reader of it
    (here the planter's own uid) gets nothing: the directory is root's with mode 000."""
    root = shared / "prewarm"
    _plant(root, "directory")
    agent = AgentProcess(env=s3_server.env())
    agent.shm_root = root
    try:
        agent.start()
        view = _planted_beside(root) / "mine.txt"  # the same inode a pod's mount shows
        assert SYSTEM_PYTHON is not None
        read = subprocess.run(
            [SYSTEM_PYTHON, "-I", "-c", READ_AS_NOBODY, str(view)],
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            cwd="/",
        )
    finally:
        agent.close()
    assert read.stdout.strip() == "refused"


def test_a_client_refuses_a_snapshot_path_the_agent_does_not_own(
    s3_server: S3Server, small_model: SampleModel
) -> None:
    """The handle names the agent's uid; a client that finds the snapshot directory owned by
    someone else at the handed path (a planted root mounted before the claim) raises
    IntegrityError naming the owner instead of handing back a path to load."""
    agent = AgentProcess(env=s3_server.env())
    try:
        agent.start()
        with Client(agent.socket_path) as client:
            handle = client.ensure(small_model.uri)
            os.chown(handle.path, NOBODY, NOBODY)
            with pytest.raises(
                IntegrityError, match=f"belongs to uid {NOBODY}, not to the prewarm agent"
            ):
                client.ensure(small_model.uri)
            os.chown(handle.path, 0, 0)
            assert client.ensure(small_model.uri).hit
    finally:
        agent.close()
