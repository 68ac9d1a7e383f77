"""Tier roots are the agent's alone: planted roots, links and journals are refused, never used.

The tests run as root, so a hostile local user is played by chowning what it
would have created to nobody (65534) or by leaving it group/world-writable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from store_helpers import MiB, open_store

from agent._snapshot import Snapshot, SourceObject, snapshot_key
from agent._uri import parse_uri
from agent._vocabulary import TierName
from agent.check.hashes import ChunkHasher
from agent.client import Client
from agent.pull.staging import open_staging
from agent.store.catalog import Store
from agent.store.journal import DATA_DIR, Journal, JournalHeader
from agent.store.layout import trash_dir
from agent.store.roots import JOURNAL_KEY_NAME, TierRootInUse, UnsafeTierRoot, journal_key
from agent.testing import AgentProcess, AgentStartupError, S3Server, SampleModel

NOBODY = 65534


def _victim(tmp_path: Path) -> Path:
    """A directory outside every root holding a file root owns, which nothing may touch."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important.conf").write_bytes(b"keep me\n")
    return victim


def _snapshot(size: int = 2 * MiB) -> Snapshot:
    uri = parse_uri("s3://bucket/model/")
    objects = (SourceObject("model/config.json", "config.json", size, '"e1"'),)
    return Snapshot(uri, (), (), objects, snapshot_key(uri, (), (), objects))


@pytest.mark.parametrize("where", ["root", "snapshots", "staging", "compile"])
async def test_a_root_or_directory_owned_by_another_user_is_refused(
    tmp_path: Path, where: str
) -> None:
    """A root, or a directory at its top, that another uid owns stops the store from opening."""
    await open_store(tmp_path)
    shm = tmp_path / "shm"
    planted = shm if where == "root" else shm / where
    planted.mkdir(exist_ok=True)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafeTierRoot, match=f"{planted}: it is owned by uid {NOBODY}"):
        await open_store(tmp_path)


@pytest.mark.parametrize(("where", "mode"), [("root", 0o777), ("manifests", 0o775)])
async def test_a_group_or_world_writable_root_or_directory_is_refused(
    tmp_path: Path, where: str, mode: int
) -> None:
    """A root or a layout directory writable by group or others is refused, naming its mode."""
    await open_store(tmp_path)
    planted = tmp_path / "shm" if where == "root" else tmp_path / "shm" / where
    planted.chmod(mode)
    with pytest.raises(UnsafeTierRoot, match=f"writable by group or others \\(mode {mode:o}\\)"):
        await open_store(tmp_path)


async def test_a_root_under_a_directory_others_can_rename_it_in_is_refused(tmp_path: Path) -> None:
    """An ancestor that is world-writable without the sticky bit lets others swap the root."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeTierRoot, match="writable by others and not sticky"):
        await open_store(shared)
    assert list(shared.iterdir()) == []


async def test_the_agent_creates_its_roots_traverse_only_with_a_private_journal_key(
    tmp_path: Path,
) -> None:
    """Fresh roots and snapshots/ are 0711, the rest of the layout 0700, all the agent's; the
    journal key is 0600 (tests/store/test_disk_access.py tries them as another user)."""
    old_umask = os.umask(0)  # the modes must not depend on the caller's umask
    try:
        await open_store(tmp_path)
    finally:
        os.umask(old_umask)
    shm = tmp_path / "shm"
    for directory in (shm, *(p for p in shm.iterdir() if p.is_dir())):
        info = directory.lstat()
        mode = "0o711" if directory in (shm, shm / "snapshots") else "0o700"
        assert (oct(info.st_mode & 0o7777), info.st_uid) == (mode, os.geteuid()), directory
    key = (shm / JOURNAL_KEY_NAME).lstat()
    assert (oct(key.st_mode & 0o777), key.st_size) == ("0o600", 32)


@pytest.mark.parametrize("link", ["trash", "staging"])
async def test_a_symlinked_layout_directory_is_refused_and_the_target_untouched(
    tmp_path: Path, link: str
) -> None:
    """`trash -> /victim` (or staging) stops the store; the victim's files stay where they were."""
    await open_store(tmp_path)
    victim = _victim(tmp_path)
    (victim / "leftover.1234").mkdir()
    planted = tmp_path / "shm" / link
    planted.rmdir()
    planted.symlink_to(victim)
    with pytest.raises(UnsafeTierRoot, match=f"{planted}: it is a symlink"):
        await open_store(tmp_path)
    assert sorted(p.name for p in victim.iterdir()) == ["important.conf", "leftover.1234"]


async def test_a_planted_journal_is_not_resumed_even_when_its_digests_match(
    tmp_path: Path,
) -> None:
    """Planted data with a journal whose digests match it, not signed by the agent, is dropped."""
    store = await open_store(tmp_path)
    snapshot = _snapshot(MiB)
    staging = store.staging_path("shm", snapshot.key)
    (staging / DATA_DIR).mkdir(parents=True)
    planted = b"\x66" * MiB
    (staging / DATA_DIR / "config.json").write_bytes(planted)
    hasher = ChunkHasher()
    hasher.update(planted)
    header = JournalHeader.for_snapshot(snapshot, MiB)
    journal = Journal.create(staging, header, b"k" * 32)  # not the agent's key
    journal.record("config.json", 0, MiB, hasher.digest())
    journal.close()

    files = open_staging(staging, snapshot, MiB, "shm")
    try:
        assert files.digests == {}  # nothing counts as already downloaded
    finally:
        files.close()
    reopened = await open_store(tmp_path)
    assert reopened.leftover(snapshot.key) is not None  # the clean restart is the agent's own
    assert (staging / DATA_DIR / "config.json").read_bytes() != planted


async def test_reconcile_removes_a_journal_it_did_not_sign(tmp_path: Path) -> None:
    """At start-up a staging directory whose journal fails the signature check is removed."""
    await open_store(tmp_path)
    snapshot = _snapshot()
    staging = tmp_path / "shm" / "staging" / snapshot.key
    staging.mkdir()
    Journal.create(staging, JournalHeader.for_snapshot(snapshot, MiB), b"x" * 32).close()
    store = await open_store(tmp_path)
    assert store.leftover(snapshot.key) is None
    assert not staging.exists()


async def test_a_symlinked_data_file_in_resumable_staging_is_never_written_through(
    tmp_path: Path,
) -> None:
    """A link planted over a file of a signed staging directory: the pull starts clean beside it."""
    store = await open_store(tmp_path)
    victim = _victim(tmp_path)
    snapshot = _snapshot()
    staging = store.staging_path("shm", snapshot.key)
    open_staging(staging, snapshot, MiB, "shm").close()  # the agent's own journal
    data_file = staging / DATA_DIR / "config.json"
    data_file.unlink()
    data_file.symlink_to(victim / "important.conf")

    files = open_staging(staging, snapshot, MiB, "shm")
    try:
        files.write_at("config.json", [b"S3 bytes"], 0, ChunkHasher())
    finally:
        files.close()
    assert (victim / "important.conf").read_bytes() == b"keep me\n"
    assert not data_file.is_symlink()
    assert data_file.read_bytes()[:8] == b"S3 bytes"


async def test_a_replaced_journal_key_makes_old_journals_start_clean(tmp_path: Path) -> None:
    """A key file that is not the agent's private one is replaced; its journals are not resumed."""
    store = await open_store(tmp_path)
    snapshot = _snapshot()
    staging = store.staging_path("shm", snapshot.key)
    open_staging(staging, snapshot, MiB, "shm").close()
    key_file = tmp_path / "shm" / JOURNAL_KEY_NAME
    old_key = key_file.read_bytes()
    key_file.chmod(0o644)  # readable by everyone: whoever read it could sign journals
    assert journal_key(tmp_path / "shm") != old_key
    store = await open_store(tmp_path)
    assert store.leftover(snapshot.key) is None


def test_the_daemon_refuses_a_planted_root_with_exit_1_and_the_reason_in_its_log(
    s3_server: S3Server,
) -> None:
    """prewarmd exits 1 at start when its shm root belongs to another user, and logs why."""
    agent = AgentProcess(env=s3_server.env())
    try:
        agent.shm_root.mkdir()
        os.chown(agent.shm_root, NOBODY, NOBODY)
        with pytest.raises(AgentStartupError, match="exited with code 1"):
            agent.start()
        assert f"Refusing to use {agent.shm_root}: it is owned by uid {NOBODY}" in agent.log_text()
    finally:
        agent.close()


async def test_a_second_store_on_the_same_roots_is_refused_before_it_touches_them(
    tmp_path: Path,
) -> None:
    """While one store holds the roots, another opening them stops with TierRootInUse naming
    the root, and empties nothing (the first's trash keeps its entry); once the first lets
    go, the roots open."""
    first = await open_store(tmp_path)
    kept = trash_dir(tmp_path / "shm") / "being-removed"
    kept.write_bytes(b"the first agent's")
    roots: dict[TierName, Path] = {"shm": tmp_path / "shm", "disk": tmp_path / "disk"}
    with pytest.raises(TierRootInUse, match=f"serving the tier root {tmp_path / 'shm'}"):
        await Store(roots).open()
    assert kept.read_bytes() == b"the first agent's"
    first.close()
    second = Store(roots)
    await second.open()
    second.close()
    assert not kept.exists()


def test_a_second_daemon_on_the_same_roots_exits_1_and_the_first_keeps_serving(
    s3_server: S3Server, small_model: SampleModel
) -> None:
    """prewarmd started on a serving agent's tier roots with a socket of its own exits 1 saying
    another agent serves them; the first agent's snapshot stays and is still a hit."""
    agent = AgentProcess(env=s3_server.env()).start()
    try:
        with Client(agent.socket_path) as client:
            handle = client.ensure(small_model.uri)
        other = agent.root / "other.sock"
        second = subprocess.run(
            [sys.executable, "-m", "agent", "--socket", str(other)],
            env=agent.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        with Client(agent.socket_path) as client:
            again = client.ensure(small_model.uri)
    finally:
        agent.close()
    assert second.returncode == 1, second.stderr
    assert f"Another prewarm agent is serving the tier root {agent.shm_root}" in second.stderr
    assert again.path == handle.path
    assert again.hit
