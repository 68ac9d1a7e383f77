"""The Unix-socket chores both of the agent's sockets share.

The API socket (gRPC) and the lease socket (asyncio) go through the same
steps, so the same situation gives the same error on either: a group that does
not exist is a ``ConfigError``; a live socket, or a path that is not a socket
at all, is a ``Conflict``.

A socket's directory may be writable by others (a tenant's directory, say),
and they can replace the socket's name with a symlink at any moment. So a
socket is bound, secured and removed through ``SocketDirectory``: a descriptor
of its directory opened once, the file reached from it without following a
link, and its group and mode set on that very file, never by name.
"""

from __future__ import annotations

import contextlib
import grp
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

from agent._config import ConfigError
from agent._exceptions import Conflict

__all__ = [
    "SocketDirectory",
    "clear_stale_socket",
    "owner_only_umask",
    "socket_group_id",
]

# How long a probe waits on a listener with a full backlog: alive all the same.
_PROBE_TIMEOUT_SECONDS = 1.0


def socket_group_id(group: str) -> int | None:
    """The gid of ``socket_group``; None for "", which keeps the daemon's own group."""
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"socket_group {group!r} does not exist; create it (groupadd {group}) or "
            "leave socket_group empty."
        ) from None


def clear_stale_socket(path: Path, serving: str) -> None:
    """Make the directory; remove a socket a dead daemon left; refuse anything else.

    ``serving`` says what the socket is for ("the API", "leases"), for the
    message when another process still listens on it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        # Includes a symlink: the agent never follows one to a socket elsewhere.
        raise Conflict(f"{path} exists and is not a socket; remove it or choose another path.")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(_PROBE_TIMEOUT_SECONDS)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)  # nobody listens: left behind by a daemon that died
        return
    except TimeoutError:
        pass
    finally:
        probe.close()
    raise Conflict(
        f"Another prewarmd is already serving {serving} on {path}. Stop it first "
        "(systemctl stop prewarmd) or choose another socket path."
    )


@contextlib.contextmanager
def owner_only_umask() -> Iterator[None]:
    """Bind inside this, so a new socket is never reachable by others, even briefly.

    The umask is process-wide: nothing inside may await, or other tasks would
    create files under it.
    """
    old_umask = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old_umask)


class SocketDirectory:
    """The directory of one socket path, held open from bind to removal.

    ``bind_address`` names the socket through this descriptor
    (``/proc/self/fd/N/name``), so the bind lands in the directory opened here
    even if a directory on the path is renamed meanwhile. Close it only after
    the server stopped: grpc unlinks its socket through that address on stop.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        # The directory itself is followed once (/var/run -> /run); its entries never are.
        self._fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    @property
    def bind_address(self) -> str:
        """The path to bind: the socket's name inside the directory held open."""
        return f"/proc/self/fd/{self._fd}/{self.path.name}"

    def secure(self, mode: int, gid: int | None) -> int:
        """Give the socket just bound its group (None: keep it) and mode; returns its inode.

        The file is reached with O_PATH | O_NOFOLLOW and changed through
        /proc/self/fd (Linux has no fchmod for such a descriptor), after
        checking it is a socket of the agent's with one link: a symlink, or any
        other file swapped in since the bind, is a Conflict and stays untouched.
        """
        fd = os.open(self.path.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._fd)
        try:
            info = os.fstat(fd)
            if not _is_own_socket(info):
                raise Conflict(
                    f"{self.path} is no longer the socket the agent bound (someone who can "
                    f"write {self.path.parent} replaced it); its mode and group were not set. "
                    "Keep socket directories writable only by root and the agent, then start "
                    "the agent again."
                )
            reached = Path(f"/proc/self/fd/{fd}")
            if gid is not None:
                os.chown(reached, -1, gid)
            reached.chmod(mode)
            return info.st_ino
        finally:
            os.close(fd)

    def remove_own(self, inode: int | None) -> None:
        """Unlink the socket only if it is still the one bound (``inode``; None: nothing).

        A newer daemon may have bound the path since.
        """
        if inode is None:
            return
        with contextlib.suppress(FileNotFoundError):
            info = os.stat(self.path.name, dir_fd=self._fd, follow_symlinks=False)
            if stat.S_ISSOCK(info.st_mode) and info.st_ino == inode:
                os.unlink(self.path.name, dir_fd=self._fd)

    def close(self) -> None:
        """Close the directory held open."""
        os.close(self._fd)


def _is_own_socket(info: os.stat_result) -> bool:
    return stat.S_ISSOCK(info.st_mode) and info.st_uid == os.geteuid() and info.st_nlink == 1
