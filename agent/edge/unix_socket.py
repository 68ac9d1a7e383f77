"""The Unix-socket chores both of the agent's sockets share.

The API socket (gRPC) and the lease socket (asyncio) go through the same
steps, so the same situation gives the same error on either: a group that does
not exist is a ``ConfigError``; a live socket, or a path that is not a socket
at all, is a ``Conflict``.
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
    "clear_stale_socket",
    "owner_only_umask",
    "remove_own_socket",
    "secure_socket",
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


def secure_socket(path: Path, mode: int, gid: int | None) -> None:
    """Give the bound socket its group (None: keep the daemon's) and mode."""
    if gid is not None:
        os.chown(path, -1, gid)
    path.chmod(mode)


def remove_own_socket(path: Path, inode: int | None) -> None:
    """Unlink the socket file only if it is still ours: a newer daemon may have bound the path.

    ``inode`` is the file's st_ino read right after binding; None (never bound) removes nothing.
    """
    with contextlib.suppress(FileNotFoundError):
        if inode is not None and path.stat().st_ino == inode:
            path.unlink()
