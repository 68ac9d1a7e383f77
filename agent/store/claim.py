"""Taking a tier root back from whoever made it first in a shared directory.

``/dev/shm`` is writable by every local user and sticky (only an entry's owner
may rename or remove it), so anyone can create ``/dev/shm/prewarm`` before the
agent: a directory of theirs (with links and files in it), a symlink, a file.
Refusing to start on it hands every local user a way to stop the cache; using
it hands them the cache. Neither: the agent makes a fresh private directory
beside it and swaps the two names in one ``renameat2(RENAME_EXCHANGE)``, so the
configured name is never free for an instant and nothing of the other user's
is entered, followed or deleted. Their entry stays beside the root under
``<root>.planted-<random>`` for the admin to inspect, and the log says so; it is
made root's with mode 000, so a pod that mounted it before the swap (a hostPath
made early) reads nothing of it.

Swapping another user's entry in a sticky directory takes root (or
CAP_FOWNER). An agent without it refuses to start, naming the step that can
do it: ``prewarmd --claim-roots --owner USER``, run as root first (the systemd
unit's ``ExecStartPre=+`` and the DaemonSet's init container do).

Only the last component is claimed, and only in a directory others may write
and that is sticky; anything else wrong on the way stays a refusal
(``agent.store.roots``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Claim", "claim_root"]

_RENAME_EXCHANGE = 2
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True, slots=True)
class Claim:
    """What ``claim_root`` did: nothing, made the root, or moved another user's entry aside."""

    root: Path
    made: bool = False
    # Where the other user's entry went, and whose it is.
    moved: Path | None = None
    planted_by: int | None = None

    def __str__(self) -> str:
        """The one line ``prewarmd --claim-roots`` prints for this root."""
        if self.moved is not None:
            return (
                f"moved {self.root} (made by uid {self.planted_by}, not by the agent) aside to "
                f"{self.moved}, untouched; {self.root} is now a fresh directory of the agent's. "
                f"Inspect {self.moved} and remove it."
            )
        if self.made:
            return f"made {self.root}"
        return f"{self.root}: nothing to claim"


def claim_root(root: Path, owner: int) -> Claim:
    """Make sure ``root``, if it is in a shared sticky directory, is one ``owner`` may trust.

    A root that is root's or ``owner``'s, writable by no one else and holding
    nothing of anyone else's at its top, is kept (one of root's is given to
    ``owner``: kubelet or tmpfiles made it). Anything else is swapped for a
    fresh directory (0700, ``owner``'s). Outside a shared sticky directory
    nothing is done. Raises PermissionError, naming who made the entry, when
    the swap needs privileges the caller lacks; OSError when the filesystem
    cannot exchange names.
    """
    try:
        parent = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return Claim(root)  # made by agent.store.roots, with the root, under the agent's rules
    try:
        if not _shared(os.fstat(parent)):
            return Claim(root)
        try:
            _make_private(parent, root.name, owner)
        except FileExistsError:
            pass
        else:
            return Claim(root, made=True)
        stranger = _stranger(parent, root.name, owner)
        if stranger is None:
            return Claim(root)
        try:
            aside = _swap_in_fresh(parent, root.name, owner)
        except PermissionError as exc:
            raise PermissionError(
                exc.errno,
                f"{root} was made by uid {stranger}, and only root may move it aside in "
                f"{root.parent}",
            ) from exc
        _close_off(parent, aside, stranger)
        return Claim(root, moved=root.parent / aside, planted_by=stranger)
    finally:
        os.close(parent)


def _shared(parent: os.stat_result) -> bool:
    """Anyone may create entries here, and only their owner may rename them (/dev/shm, /tmp)."""
    return bool(parent.st_mode & stat.S_IWOTH and parent.st_mode & stat.S_ISVTX)


def _make_private(parent: int, name: str, owner: int) -> None:
    os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)
    try:
        _give(fd, owner)
    finally:
        os.close(fd)


def _give(fd: int, owner: int) -> None:
    if os.fstat(fd).st_uid != owner:
        os.fchown(fd, owner, -1)


def _stranger(parent: int, name: str, owner: int) -> int | None:
    """The uid that makes ``name`` untrustworthy, or None if the agent may use it."""
    trusted = {0, owner}
    info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if info.st_uid not in trusted:
        return info.st_uid
    if not stat.S_ISDIR(info.st_mode):
        return None  # root's or the agent's own link or file: agent.store.roots refuses it
    if info.st_mode & _WRITABLE_BY_OTHERS:
        return info.st_uid  # root's, but opened to others: who knows what they put in since
    fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                uid = entry.stat(follow_symlinks=False).st_uid
                if uid not in trusted:
                    return uid  # chowned after another user made it, like a DaemonSet's init
        _give(fd, owner)
    finally:
        os.close(fd)
    return None


def _swap_in_fresh(parent: int, name: str, owner: int) -> str:
    """Exchange ``name`` with a fresh private directory; the name the old entry has now."""
    aside = f"{name}.planted-{secrets.token_hex(4)}"
    _make_private(parent, aside, owner)
    try:
        _renameat2_exchange(parent, aside, name)
    except BaseException:
        os.rmdir(aside, dir_fd=parent)  # still the fresh, empty directory
        raise
    return aside


def _close_off(parent: int, name: str, planter: int) -> None:
    """Make the planted entry, now at ``name``, unusable where it is: root's, mode 000.

    A pod whose mount of the root was made before the swap still sees this very
    directory at the path the agent hands out; closed off, it can read nothing
    the planter put there. Only the planter's own directory or single-link file is
    touched (opened without following a link, checked after opening): whatever
    else was renamed into its place meanwhile is left alone. Its contents are
    never entered.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=parent)
    except OSError:
        return  # a link (ELOOP), or gone: nothing here a mount could still show
    try:
        info = os.fstat(fd)
        ours_to_close = stat.S_ISDIR(info.st_mode) or (
            stat.S_ISREG(info.st_mode) and info.st_nlink == 1
        )
        if info.st_uid == planter and ours_to_close:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0)
    finally:
        os.close(fd)


def _renameat2_exchange(parent: int, first: str, second: str) -> None:
    try:
        renameat2 = _LIBC.renameat2
    except AttributeError:
        raise OSError(errno.ENOSYS, "renameat2 is not in this C library", second) from None
    if renameat2(parent, first.encode(), parent, second.encode(), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), second)
