"""Attacks on the tier roots as a hostile local user would try them (issue 11, second pass).

The tests run as root, so another user is played by chowning what it would
have made to nobody (65534). Each case is something planted where the agent
walks or writes: an ancestor link, a hard link in staging, a published
snapshot another user can still write, a FIFO where a usage record belongs.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from store_helpers import key_of, open_store, publish, stage

from agent._exceptions import IntegrityError
from agent.store.journal import DATA_DIR
from agent.store.layout import publish_files, return_to_staging
from agent.store.roots import UnsafeTierRoot

NOBODY = 65534


def _secret(tmp_path: Path) -> Path:
    """A root-only file outside every root (think /etc/shadow): its mode must never change."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"root only\n")
    secret.chmod(0o600)
    return secret


async def test_a_root_reached_through_another_users_link_in_a_sticky_directory_is_refused(
    tmp_path: Path,
) -> None:
    """A link another user owns in a sticky shared directory (/dev/shm) can be swapped later,
    even when it points at a safe directory now: a root reached through it is refused."""
    shared = tmp_path / "devshm"
    shared.mkdir()
    shared.chmod(0o1777)
    safe = tmp_path / "safe"
    safe.mkdir()
    link = shared / "prewarm"
    link.symlink_to(safe)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(UnsafeTierRoot, match=f"{link}: it is a symlink owned by uid {NOBODY}"):
        await open_store(link)
    assert list(safe.iterdir()) == []


async def test_a_root_reached_through_the_agents_own_link_is_accepted(tmp_path: Path) -> None:
    """A link the agent's uid owns (an admin's `ln -s`) is not another user's to swap."""
    safe = tmp_path / "safe"
    safe.mkdir()
    link = tmp_path / "roots"
    link.symlink_to(safe)
    store = await open_store(link)
    assert (safe / "shm" / "snapshots").is_dir()
    assert store is not None


async def test_publish_never_changes_the_mode_of_a_hard_linked_file(tmp_path: Path) -> None:
    """A hard link in staging to a root-only file is refused before any chmod: the file stays
    0600 instead of being made 0444 (world-readable) and then refused."""
    store = await open_store(tmp_path)
    secret = _secret(tmp_path)
    staging, model = stage(store, 1)
    weights = staging / DATA_DIR / "weights.bin"
    weights.unlink()
    os.link(secret, weights)
    with pytest.raises(IntegrityError, match=r"weights\.bin"):
        publish_files(staging / DATA_DIR, tmp_path / "shm", model)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


async def test_returning_to_staging_never_changes_the_mode_of_a_hard_linked_file(
    tmp_path: Path,
) -> None:
    """A snapshot directory sent back to staging (renamed without a manifest) that holds a hard
    link to a root-only file leaves that file's mode alone."""
    await open_store(tmp_path)
    secret = _secret(tmp_path)
    root = tmp_path / "shm"
    snapshot = root / "snapshots" / key_of(7)
    snapshot.mkdir()
    os.link(secret, snapshot / "weights.bin")
    (root / "staging" / key_of(7)).mkdir()
    return_to_staging(snapshot, root / "staging" / key_of(7) / DATA_DIR)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


@pytest.mark.parametrize("planted", ["file-owner", "file-mode", "dir-owner", "dir-mode", "nlink"])
async def test_a_published_snapshot_another_user_could_rewrite_is_dropped_at_start(
    tmp_path: Path, planted: str
) -> None:
    """A snapshot whose directory or files another uid owns or may write (or a file with a
    second hard link) is not served after a restart: its weights could change under pods."""
    store = await open_store(tmp_path)
    model = await publish(store, 1)
    weights = model.path / "weights.bin"
    if planted == "file-owner":
        os.chown(weights, NOBODY, NOBODY)
    elif planted == "file-mode":
        weights.chmod(0o666)
    elif planted == "dir-owner":
        os.chown(model.path, NOBODY, NOBODY)
    elif planted == "dir-mode":
        model.path.chmod(0o777)
    else:
        os.link(weights, tmp_path / "second-link")
    reopened = await open_store(tmp_path)
    assert reopened.get(model.key) is None
    assert not model.path.exists()


async def test_an_intact_published_snapshot_survives_a_restart(tmp_path: Path) -> None:
    """The ownership checks at start-up keep the agent's own snapshots."""
    store = await open_store(tmp_path)
    model = await publish(store, 1)
    reopened = await open_store(tmp_path)
    assert reopened.get(model.key) is not None


@pytest.mark.timeout(20)
async def test_a_fifo_or_link_in_place_of_a_usage_record_does_not_hang_or_leak(
    tmp_path: Path,
) -> None:
    """A FIFO planted as `usage/<key>.json` would block the start-up scan forever if read; a
    link would be followed. Either is ignored: the snapshot is served as unused."""
    store = await open_store(tmp_path)
    first = await publish(store, 1)
    second = await publish(store, 2)
    usage = tmp_path / "shm" / "usage"
    (usage / f"{first.key}.json").unlink(missing_ok=True)
    os.mkfifo(usage / f"{first.key}.json")
    (usage / f"{second.key}.json").unlink(missing_ok=True)
    (tmp_path / "elsewhere.json").write_text('{"last_used": 1e18, "hit_count": 9, "pinned": true}')
    (usage / f"{second.key}.json").symlink_to(tmp_path / "elsewhere.json")
    reopened = await open_store(tmp_path)
    assert reopened.get(first.key) is not None
    usage_of_second = reopened.usage(second.key)
    assert usage_of_second is not None
    assert not usage_of_second.pinned  # the linked record's "pinned" was never read
