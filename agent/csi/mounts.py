"""The mounts a CSI volume is made of: a directory (a snapshot, or a tenant's socket directory)
bound read-only, ``nosuid,nodev,noexec``, at a pod's volume target.

mount(2) and umount2(2) straight from libc: the plugin makes a handful of bind
mounts per pod, and a ``mount`` binary would add a PATH lookup and text to parse
to each.

Why a staging mount: a bind mount takes its flags only from a second call
(``MS_REMOUNT | MS_BIND``), and that remount changes the one mount it names,
never the copies that mount propagation has already made of it: the kubelet's
directory is a shared mount, so a bind made there and remounted read-only would
stay writable in every other namespace, the container runtime's included, that
received it. So the read-only bind is made first in the plugin's own private
directory, and only then bound to the target: a bind copies its source's flags,
and every propagated copy is made from the finished, read-only mount.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from pathlib import Path

__all__ = ["bind_read_only", "is_mount_point", "make_private", "mount_options", "unmount"]

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8
_LOCKED_DOWN = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
# What a finished volume's mount shows in mountinfo.
LOCKED_DOWN_OPTIONS = frozenset({"ro", "nosuid", "nodev", "noexec"})
# A target is unmounted at most this many times over (stacked mounts), then it is an error.
_MAX_STACKED = 16
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: Path | str, *, flags: int) -> None:
    result = _libc.mount(source.encode(), os.fsencode(target), None, ctypes.c_ulong(flags), None)
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount at {target}: {os.strerror(error)}")


def make_private(directory: Path) -> None:
    """Make ``directory`` a mount of its own that propagates nothing (the staging area)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not is_mount_point(directory):
        _mount(str(directory), directory, flags=MS_BIND)
    _mount("none", directory, flags=MS_PRIVATE)


def bind_read_only(source: Path, target: Path, staging: Path) -> None:
    """Bind ``source`` at ``target``, read-only, nosuid, nodev, noexec, through ``staging``
    (an empty directory in a private mount, removed again).

    ``source`` is opened without following a link at its last step and bound from
    its descriptor, so what is mounted is the directory that was checked.
    """
    fd = os.open(source, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        staging.mkdir(mode=0o700)
        try:
            _mount(f"/proc/self/fd/{fd}", staging, flags=MS_BIND)
            try:
                _mount("none", staging, flags=MS_REMOUNT | MS_BIND | _LOCKED_DOWN)
                _mount(str(staging), target, flags=MS_BIND)
            finally:
                unmount(staging)
        finally:
            with contextlib.suppress(OSError):
                staging.rmdir()
    finally:
        os.close(fd)


def unmount(target: Path) -> None:
    """Take every mount at ``target`` away (lazily: it never fails for a busy file), never
    following a link there; a target that is not mounted is left as it is."""
    for _ in range(_MAX_STACKED):
        if not is_mount_point(target):
            return
        if _libc.umount2(os.fsencode(target), MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"unmount {target}: {os.strerror(error)}")
    raise OSError(f"unmount {target}: still mounted after {_MAX_STACKED} unmounts")


def is_mount_point(path: Path) -> bool:
    """Whether something is mounted at ``path`` (this process's mount table)."""
    return mount_options(path) is not None


def mount_options(path: Path) -> frozenset[str] | None:
    """The per-mount options (``ro``, ``nosuid``...) of the topmost mount at ``path``, or
    None when nothing is mounted there."""
    wanted = os.path.normpath(str(path))
    found: frozenset[str] | None = None
    with Path("/proc/self/mountinfo").open(encoding="utf-8", errors="surrogateescape") as table:
        for line in table:
            fields = line.split(" ", 6)
            if len(fields) > 5 and _unescape(fields[4]) == wanted:
                found = frozenset(fields[5].split(","))  # later lines are mounted on top
    return found


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
