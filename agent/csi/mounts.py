"""The mounts a CSI volume is made of: a snapshot bound read-only, or a socket in a tmpfs.

mount(2) and umount2(2) straight from libc: the plugin makes a handful of bind
mounts per pod, and a ``mount`` binary would add a PATH lookup and text to parse
to each. Every mount is ``nosuid,nodev,noexec`` and read-only: a pod reads
weights and connects to a socket, nothing more.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

__all__ = ["SOCKET_NAME", "bind_read_only", "is_mount_point", "mount_socket", "unmount"]

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8
_LOCKED_DOWN = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
# The file a socket volume holds: the tenant's API socket, bound onto it.
SOCKET_NAME = "agent.sock"
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(
    source: str, target: Path, *, flags: int, fstype: str | None = None, data: str | None = None
) -> None:
    result = _libc.mount(
        source.encode(),
        os.fsencode(target),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount at {target}: {os.strerror(error)}")


def bind_read_only(source: Path, target: Path) -> None:
    """Bind ``source`` (a directory) at ``target``, read-only, nosuid, nodev, noexec.

    A bind mount takes the flags of its first mount call only as far as
    MS_BIND goes; read-only and the rest need a remount of the bind itself.
    """
    _mount(str(source), target, flags=MS_BIND)
    try:
        _mount("none", target, flags=MS_REMOUNT | MS_BIND | _LOCKED_DOWN)
    except OSError:
        unmount(target)
        raise


def mount_socket(socket_path: Path, target: Path) -> None:
    """Put ``socket_path`` at ``target``/agent.sock and nothing else: a tiny tmpfs at
    ``target`` (read-only once made) holding one file the socket is bound onto, so the
    pod never sees the socket's own directory and the other sockets in it."""
    _mount(
        "prewarm-csi",
        target,
        flags=MS_NOSUID | MS_NODEV | MS_NOEXEC,
        fstype="tmpfs",
        data="size=16k,mode=0755",
    )
    try:
        placeholder = target / SOCKET_NAME
        os.close(os.open(placeholder, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
        _mount(str(socket_path), placeholder, flags=MS_BIND)
        _mount("none", target, flags=MS_REMOUNT | _LOCKED_DOWN)
    except OSError:
        unmount(target)
        raise


def unmount(target: Path) -> None:
    """Take every mount at ``target`` away (lazily: it never fails for a busy file), never
    following a link there; a target that is not mounted is left as it is."""
    while is_mount_point(target):
        if _libc.umount2(os.fsencode(target), MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"unmount {target}: {os.strerror(error)}")


def is_mount_point(path: Path) -> bool:
    """Whether something is mounted at ``path`` (this process's mount table)."""
    wanted = os.path.normpath(str(path))
    with Path("/proc/self/mountinfo").open(encoding="utf-8", errors="surrogateescape") as table:
        for line in table:
            fields = line.split(" ", 5)
            if len(fields) > 4 and _unescape(fields[4]) == wanted:
                return True
    return False


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040...)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)
