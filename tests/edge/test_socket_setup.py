"""Setting up a socket file never changes a file the agent did not bind (issue 16, hole 2).

After binding, the agent gives the socket its group and mode. Done by name, that follows a
link: whoever can write the socket's directory swaps the fresh socket for a symlink to a
root-owned file and gets that file re-moded 0660 to the socket's group. The agent now binds,
secures and removes its sockets through a descriptor of their directory, and sets mode and
group on the file it reached without following a link, after checking it is a socket of its
own; anything else stops it instead.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import socket
import stat
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from agent_helpers import when_logged

from agent._exceptions import Conflict
from agent.edge.unix_socket import SocketDirectory, owner_only_umask
from agent.testing import AgentProcess, S3Server

# A group that exists on any Debian-like system, standing in for socket_group.
GROUP, GROUP_ID = "users", 100
_IN_CREATE = 0x100
_EVENT = struct.Struct("iIII")


def _root_only_file(tmp_path: Path) -> Path:
    """A root-owned 0600 file outside the agent's reach (think /etc/shadow)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"root only\n")
    victim.chmod(0o600)
    return victim


def _owner_and_mode(path: Path) -> tuple[int, int, int]:
    info = path.stat()
    return info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)


def _swap_for_link(path: Path, target: Path) -> None:
    """What the attacker does: move the fresh socket away, put a symlink in its place."""
    path.rename(path.with_name(f"{path.name}.moved"))
    path.symlink_to(target)


def test_a_socket_swapped_for_a_symlink_after_bind_is_refused_and_the_target_untouched(
    tmp_path: Path,
) -> None:
    """The socket's name turned into a symlink between bind and securing: `secure` refuses with
    Conflict naming the path and what to do, and the link's target keeps its owner and mode."""
    victim = _root_only_file(tmp_path)
    before = _owner_and_mode(victim)
    sockets = tmp_path / "run"
    sockets.mkdir()
    sockets.chmod(0o777)  # a directory another user can write: a tenant's, say
    path = sockets / "agent.sock"
    directory = SocketDirectory(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with owner_only_umask():
            listener.bind(directory.bind_address)
        _swap_for_link(path, victim)
        with pytest.raises(Conflict, match=f"{path} is no longer the socket the agent bound"):
            directory.secure(0o660, GROUP_ID)
    finally:
        listener.close()
        directory.close()
    assert _owner_and_mode(victim) == before


def test_a_socket_is_secured_with_its_group_and_mode_and_removed_only_if_still_its_own(
    tmp_path: Path,
) -> None:
    """An untouched socket gets its group and mode through its descriptor; removal leaves a
    socket that replaced it (a newer daemon's) in place."""
    path = tmp_path / "agent.sock"
    directory = SocketDirectory(path)
    first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with owner_only_umask():
            first.bind(directory.bind_address)
        inode = directory.secure(0o660, GROUP_ID)
        assert _owner_and_mode(path) == (os.geteuid(), GROUP_ID, 0o660)
        path.unlink()
        second.bind(str(path))  # another daemon's socket now holds the name
        directory.remove_own(inode)
        assert stat.S_ISSOCK(path.lstat().st_mode)
    finally:
        first.close()
        second.close()
        directory.close()


class _Swapper(threading.Thread):
    """Watches a directory with inotify and swaps ``name`` for a link the moment it appears."""

    def __init__(self, directory: Path, name: str, target: Path) -> None:
        super().__init__(daemon=True)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_CLOEXEC)
        assert self._fd >= 0
        assert self._libc.inotify_add_watch(self._fd, bytes(directory), _IN_CREATE) >= 0
        self._path, self._target = directory / name, target
        self.swapped = False

    def run(self) -> None:
        try:
            while not self.swapped and select.select([self._fd], [], [], 60)[0]:
                events = os.read(self._fd, 65536)
                if self._path.name.encode() in _names(events):
                    _swap_for_link(self._path, self._target)
                    self.swapped = True
        finally:
            os.close(self._fd)


def _names(events: bytes) -> list[bytes]:
    names, offset = [], 0
    while offset < len(events):
        _, _, _, length = _EVENT.unpack_from(events, offset)
        start = offset + _EVENT.size
        names.append(events[start : start + length].rstrip(b"\0"))
        offset = start + length
    return names


def _start_and_settle(agent: AgentProcess) -> str:
    """Run the daemon until it logs that it serves or that it cannot start; its log then.

    Not ``agent.start()``: that waits for SERVING on the socket path, which a swap that lands
    after set-up leaves pointing at the link.
    """
    agent.config_path.write_text(f'socket_group = "{GROUP}"\n')
    with agent.log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent"], env=agent.env(), stdout=log, stderr=log
        )
    try:
        return when_logged(
            agent,
            lambda: (
                text
                if re.search(_SETTLED, text := agent.log_text()) or proc.poll() is not None
                else None
            ),
            "the daemon serving or refusing to start",
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)


_SETTLED = r"prewarmd \S+ serving|cannot start"


@pytest.mark.parametrize("which", ["agent.sock", "lease.sock"])
def test_the_daemon_never_remodes_a_file_swapped_in_for_its_socket(
    s3_server: S3Server, tmp_path: Path, which: str
) -> None:
    """The real daemon starting while another process swaps its fresh socket (API or lease) for
    a symlink to a root-only file: the file keeps its owner, group and mode whether the swap
    lands before the daemon secures the socket (it then refuses to start, saying why) or after.
    """
    victim = _root_only_file(tmp_path)
    before = _owner_and_mode(victim)
    agent = AgentProcess(env=s3_server.env())
    try:
        swapper = _Swapper(agent.root, which, victim)
        swapper.start()
        log = _start_and_settle(agent)
        swapper.join(timeout=60)
    finally:
        agent.close()
    assert swapper.swapped
    assert _owner_and_mode(victim) == before
    if "cannot start" in log:
        assert "is no longer the socket the agent bound" in log
