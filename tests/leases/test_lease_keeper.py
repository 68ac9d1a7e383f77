"""Held leases on disk and back: who may take one back, which files are trusted, when one ends.

In-process against the real lease table, real files and real child processes
(the holders); the end-to-end restarts are in test_lease_restarts.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import AccessDenied
from agent.leases.held_file import HELD_LEASES_NAME, load_held_leases, save_held_leases
from agent.leases.holders import boot_id, process_start_time
from agent.leases.keeper import LeaseKeeper
from agent.leases.table import LeaseRecord, LeaseTable, PeerCredentials, restored_id

KEY = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A live process to hold leases: it waits on its stdin until the test closes it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    yield proc
    if proc.stdin is not None:
        proc.stdin.close()
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    return int(done.stdout)


def _creds(pid: int) -> PeerCredentials:
    return PeerCredentials(
        pid=pid, uid=os.getuid(), gid=os.getgid(), start_time=process_start_time(pid)
    )


def _held(table: LeaseTable, creds: PeerCredentials, key: str = KEY) -> LeaseRecord:
    return table.hold(table.grant(key, "ns/pod").id, creds)


def test_a_restored_lease_goes_back_only_to_the_same_process() -> None:
    """Same pid and uid but another start time (a reused pid) is refused; the holder is not."""
    me = _creds(os.getpid())
    before = LeaseTable(60, 600)
    lease = _held(before, me)
    after = LeaseTable(60, 600)
    orphan = LeaseRecord(
        id=restored_id(lease.id),
        key=KEY,
        client_name="ns/pod",
        acquired=lease.acquired,
        expires=None,
        holder=me,
        held=True,
        orphaned=True,
    )
    after.adopt(orphan)
    assert after.protected_keys() == {KEY}
    assert me.start_time is not None
    reused = PeerCredentials(me.pid, me.uid, me.gid, start_time=me.start_time + 1)
    with pytest.raises(AccessDenied):
        after.hold(lease.id, reused)
    with pytest.raises(AccessDenied):
        after.hold(lease.id, PeerCredentials(me.pid, me.uid + 1, me.gid, me.start_time))
    taken = after.hold(lease.id, me)
    assert (taken.id, taken.held, taken.orphaned, after.count()) == (lease.id, True, False, 1)


def test_the_file_keeps_hashes_of_held_leases_with_known_holders_only(tmp_path: Path) -> None:
    """Saved: held leases whose holder's start time is known, by hash; not timed ones, not ids."""
    table = LeaseTable(60, 600)
    held = _held(table, _creds(os.getpid()))
    _held(table, PeerCredentials(pid=4242, uid=0, gid=0))  # start time unknown: not kept
    table.grant(KEY, "timed")
    path = tmp_path / HELD_LEASES_NAME
    assert save_held_leases(path, table.active(), boot_id()) == 1
    text = path.read_text()
    assert held.id not in text
    assert restored_id(held.id) in text
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    [loaded] = load_held_leases(path, boot_id())
    assert (loaded.id, loaded.key, loaded.holder) == (restored_id(held.id), KEY, held.holder)


@pytest.mark.parametrize(
    "spoil",
    ["world-readable", "another-boot", "symlink", "not-json", "bad-entry"],
)
def test_a_held_leases_file_that_is_not_trustworthy_restores_nothing(
    tmp_path: Path, spoil: str
) -> None:
    """A file readable by others, from another boot, a link, garbage, or a bad entry: ignored."""
    table = LeaseTable(60, 600)
    _held(table, _creds(os.getpid()))
    path = tmp_path / HELD_LEASES_NAME
    save_held_leases(path, table.active(), boot_id())
    document = json.loads(path.read_text())
    if spoil == "world-readable":
        path.chmod(0o644)
    elif spoil == "another-boot":
        path.write_text(json.dumps(document | {"boot_id": "another"}))
        path.chmod(0o600)
    elif spoil == "symlink":
        target = tmp_path / "elsewhere.json"
        path.rename(target)
        path.symlink_to(target)
    elif spoil == "not-json":
        path.write_text("{" * 100_000)
    else:
        document["leases"][0]["key"] = "../../etc"
        path.write_text(json.dumps(document))
    assert load_held_leases(path, boot_id()) == []


async def test_the_keeper_restores_a_live_holder_and_ends_its_lease_when_it_exits(
    tmp_path: Path, child: subprocess.Popen[bytes], dead_pid: int
) -> None:
    """Restored: the live child's lease, not a dead holder's nor one on a gone snapshot; the
    child's exit (seen through its pidfd, no polling) ends its lease and the file follows.
    """
    path = tmp_path / HELD_LEASES_NAME
    before = LeaseTable(60, 600)
    _held(before, _creds(child.pid))
    _held(before, PeerCredentials(dead_pid, os.getuid(), os.getgid(), start_time=1))
    _held(before, _creds(child.pid), key="f" * 32)  # its snapshot is gone
    save_held_leases(path, before.active(), boot_id())

    table = LeaseTable(60, 600)
    async with LeaseKeeper(table, path, lambda key: key == KEY) as keeper, keeper.saving():
        assert [(r.key, r.holder and r.holder.pid, r.orphaned) for r in table.active()] == [
            (KEY, child.pid, True)
        ]
        changed = table.changes()
        assert child.stdin is not None
        child.stdin.close()
        await asyncio.wait_for(changed.wait(), timeout=30)
        assert table.active() == []
    assert load_held_leases(path, boot_id()) == []
