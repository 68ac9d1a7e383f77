"""Publishing a snapshot: what it seals, what it refuses, and what a failure or a kill leaves."""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import small_tmpfs
from store_helpers import MiB, open_store, publish, stage

from agent import IntegrityError, NoSpace, PrewarmError
from agent._vocabulary import TierName
from agent.client import Client
from agent.store.journal import DATA_DIR, Journal, JournalHeader
from agent.store.layout import CRASH_POINT_VARIABLE
from agent.store.roots import journal_key
from agent.testing import AgentProcess, S3Server
from agent.testing._process import purge_tree


def _modes(directory: Path) -> set[tuple[str, str]]:
    return {
        ("dir" if p.is_dir() else "file", oct(stat.S_IMODE(p.lstat().st_mode)))
        for p in (directory, *directory.rglob("*"))
    }


async def test_published_files_are_0444_and_directories_0555_and_eviction_still_works(
    tmp_path: Path,
) -> None:
    """A published snapshot is read-only throughout; evicting it still removes every file."""
    store = await open_store(tmp_path)
    staging, model = stage(store, 1)
    nested = staging / DATA_DIR / "sub" / "deeper"
    nested.mkdir(parents=True)
    (nested / "extra.bin").write_bytes(b"x")
    files = (*model.files, type(model.files[0])(path="sub/deeper/extra.bin", size=1, etag='"x"'))
    published = await store.publish(staging, dataclasses.replace(model, files=files))
    assert _modes(published.path) == {("dir", "0o555"), ("file", "0o444")}
    await store.evict(published.key)
    assert list((tmp_path / "shm" / "snapshots").iterdir()) == []
    assert list((tmp_path / "shm" / "trash").iterdir()) == []


@pytest.mark.parametrize("planted", ["symlink", "extra-file", "fifo"])
async def test_publish_refuses_anything_but_the_snapshots_own_regular_files(
    tmp_path: Path, planted: str
) -> None:
    """A link, an extra file or a FIFO in staging is DATA_LOSS, and nothing reaches snapshots/."""
    store = await open_store(tmp_path)
    victim = tmp_path / "victim.conf"
    victim.write_bytes(b"keep me\n")
    staging, model = stage(store, 1)
    weights = staging / DATA_DIR / "weights.bin"
    if planted == "symlink":
        weights.unlink()
        weights.symlink_to(victim)
    elif planted == "extra-file":
        (staging / DATA_DIR / "planted.py").write_bytes(b"import os\n")
    else:
        os.mkfifo(staging / DATA_DIR / "pipe")
    with pytest.raises(IntegrityError, match="not one of the snapshot's own regular files"):
        await store.publish(staging, model)
    assert list((tmp_path / "shm" / "snapshots").iterdir()) == []
    assert store.get(model.key) is None
    assert (victim.read_bytes(), oct(victim.stat().st_mode & 0o777)) == (b"keep me\n", "0o644")


async def test_a_manifest_that_cannot_be_written_leaves_nothing_behind(tmp_path: Path) -> None:
    """Any OSError at the manifest: a clear error, no snapshot dir, nothing indexed or counted."""
    store = await open_store(tmp_path)
    manifests = tmp_path / "shm" / "manifests"
    manifests.rmdir()
    manifests.write_bytes(b"")  # a file where the directory should be: ENOTDIR
    staging, model = stage(store, 1)
    with pytest.raises(PrewarmError, match="Could not write the manifest") as raised:
        await store.publish(staging, model)
    assert raised.value.status == "INTERNAL"
    _assert_nothing_published(tmp_path / "shm", store.published_bytes("shm"))
    assert store.get(model.key) is None


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (0755, so the agent accepts it as a root); skips where mount is refused."""
    with small_tmpfs(tmp_path / "tiny", "1m") as mount_point:
        yield mount_point


async def test_enospc_at_the_manifest_is_no_space_and_leaves_nothing_behind(
    full_tmpfs: Path, tmp_path: Path
) -> None:
    """A tier that fills up exactly at the manifest answers RESOURCE_EXHAUSTED and keeps no dir."""
    from agent.store.catalog import Store
    from agent.store.records import TierBudget

    roots: dict[TierName, Path] = {"shm": full_tmpfs, "disk": tmp_path / "disk"}
    store = Store(roots, {tier: TierBudget(reserve="0") for tier in roots})
    await store.open()
    staging, model = stage(store, 1, 0.25)
    _fill(full_tmpfs / "filler")
    with pytest.raises(NoSpace, match="ran out of space while writing the manifest"):
        await store.publish(staging, model)
    _assert_nothing_published(full_tmpfs, store.published_bytes("shm"))
    assert store.get(model.key) is None


def _fill(path: Path) -> None:
    """Write ``path`` until the filesystem says ENOSPC."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="No space left"):
            _write_forever(fd)
    finally:
        os.close(fd)


def _write_forever(fd: int) -> None:
    while True:
        os.write(fd, b"\0" * 4096)


def _assert_nothing_published(root: Path, published_bytes: int) -> None:
    assert published_bytes == 0
    for sub in ("snapshots", "trash"):
        assert list((root / sub).iterdir()) == [], sub
    if (root / "manifests").is_dir():
        assert list((root / "manifests").iterdir()) == []


async def test_reconcile_returns_a_snapshot_renamed_without_its_manifest_to_staging(
    tmp_path: Path,
) -> None:
    """snapshots/<key> with no manifest but the agent's journal goes back to staging to resume."""
    store = await open_store(tmp_path)
    staging, model = stage(store, 3)
    header = JournalHeader(model.key, model.uri, MiB, (("weights.bin", MiB, '"etag-3"'),))
    Journal.create(staging, header, journal_key(tmp_path / "shm")).close()
    snapshot = tmp_path / "shm" / "snapshots" / model.key
    (staging / DATA_DIR).rename(snapshot)  # where a kill between rename and manifest leaves it
    (snapshot / "weights.bin").chmod(0o444)

    reopened = await open_store(tmp_path)
    assert not snapshot.exists()
    assert reopened.leftover(model.key) is not None
    weights = staging / DATA_DIR / "weights.bin"
    assert (weights.read_bytes()[:4], oct(weights.stat().st_mode & 0o777)) == (b"\3" * 4, "0o644")


async def test_reconcile_removes_a_manifestless_snapshot_without_the_agents_journal(
    tmp_path: Path,
) -> None:
    """Without a signed journal for it, a snapshot dir that has no manifest is deleted."""
    store = await open_store(tmp_path)
    model = await publish(store, 4)
    (tmp_path / "shm" / "manifests" / f"{model.key}.json").unlink()
    await open_store(tmp_path)
    assert list((tmp_path / "shm" / "snapshots").iterdir()) == []
    assert list((tmp_path / "shm" / "staging").iterdir()) == []


@pytest.mark.slow
def test_a_kill_between_rename_and_manifest_resumes_without_downloading_again(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """The daemon SIGKILLed right after the publish rename: the restart resumes every byte."""
    s3_server.client().put_object(Bucket=bucket, Key="m/weights.bin", Body=os.urandom(6 * MiB))
    s3_server.client().put_object(Bucket=bucket, Key="m/config.json", Body=b'{"a": 1}')
    uri = f"s3://{bucket}/m/"
    home = tmp_path / "home"
    home.mkdir()
    for tier in ("shm", "disk"):
        crashing = AgentProcess(
            env={**s3_server.env(), CRASH_POINT_VARIABLE: "publish-renamed"}, root=home
        ).start()
        with Client(crashing.socket_path) as client, pytest.raises(PrewarmError):
            client.ensure(uri, tier=tier)
        assert crashing.kill() == -9  # it killed itself at the crash point

        restarted = AgentProcess(env=s3_server.env(), root=home).start()
        try:
            s3_server.clear_requests()
            with Client(restarted.socket_path) as client:
                handle = client.ensure(uri, tier=tier)
            fetched = [r for r in s3_server.requests(bucket=bucket) if r.method == "GET"]
            print(f"\n{tier}: resumed {handle.resumed_bytes} of {6 * MiB + 8} B")
            assert handle.resumed_bytes == 6 * MiB + 8
            assert [r for r in fetched if "weights.bin" in (r.key or "")] == []
            assert (handle.path / "config.json").read_bytes() == b'{"a": 1}'
            client_evicts = Client(restarted.socket_path)
            client_evicts.evict(uri)
            client_evicts.close()
        finally:
            restarted.stop()
    purge_tree(home)
