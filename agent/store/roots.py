"""Tier roots the agent can trust: made by it, owned by it, written only by it.

The agent runs as root and ``/dev/shm`` is writable by every local user, so a
root that someone else created (or a directory in it, or a symlink standing in
for one) could make the agent delete, overwrite or publish files of that
user's choosing. At start-up each root and every directory at its top level
is checked: it must be a real directory (not a symlink), owned by the agent's
uid and writable by nobody else. Its ancestors must not let another user swap
it (owned by root or the agent; a group/world-writable one only if sticky,
like ``/dev/shm`` and ``/tmp``). One thing is repaired, loudly: a root
another user made first in such a shared directory is swapped for a fresh one
of the agent's (``agent.store.claim``). Anything else stops the agent with
``UnsafeTierRoot`` saying what to fix.

Each root also holds ``journal.key``: 32 random bytes (mode 0600) with which
the agent signs its staging journals, so a pull resumes only bytes this agent
wrote (see ``agent.store.journal``), and from which the names of published
snapshots are derived (``agent.store.snapshot_names``).

Who may see what is set here too, at every start (so a root an older agent
left world-readable is closed before anything is served): the root and the
directories pods pass through are traverse-only (0711, or 0710 and the
traverse group's when one is set: then only that group may pass), every other
directory at the top is the agent's alone (0700) and so is every file (0600).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from agent._config import ConfigError
from agent._exceptions import PrewarmError
from agent._fs import open_dir
from agent.store.claim import claim_root

__all__ = [
    "JOURNAL_KEY_NAME",
    "RootLayout",
    "TierRootInUse",
    "UnsafeTierRoot",
    "journal_key",
    "prepare_root",
    "traverse_group_id",
]

log = logging.getLogger(__name__)

JOURNAL_KEY_NAME = "journal.key"
_KEY_BYTES = 32
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
# Path components (links expanded) walked before giving up, as the kernel gives up on a loop.
_MAX_COMPONENTS = 4096


# Pods pass through (no listing); with a traverse group, only its members do.
TRAVERSE_MODE, GROUP_TRAVERSE_MODE = 0o711, 0o710
PRIVATE_DIR_MODE, PRIVATE_FILE_MODE = 0o700, 0o600


class UnsafeTierRoot(PrewarmError):
    """A tier root, or a directory in it, could be written by someone other than the agent."""


class TierRootInUse(PrewarmError):
    """Another agent holds the tier root: two daemons on one cache would evict each other's
    snapshots and hand out paths the other removed."""


@dataclass(frozen=True, slots=True)
class RootLayout:
    """The directories at the top of a tier root, by who may pass through them.

    ``traversed``: on the pods' way to what they were handed, traverse-only as
    the root is; ``private``: the agent's alone; ``own_rules``: left with the
    modes another part gives them. Any other directory found at the top is
    made private.
    """

    traversed: tuple[str, ...]
    private: tuple[str, ...]
    own_rules: tuple[str, ...] = ()


def traverse_group_id(group: str) -> int | None:
    """The gid of ``tiers.group``; None for "" (no traverse group)."""
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"tiers.group {group!r} does not exist; create it (groupadd {group}) and give it "
            "to the pods that read the cache, or leave tiers.group empty."
        ) from None


def prepare_root(root: Path, layout: RootLayout, group: int | None = None) -> int:
    """Create ``root`` and its layout, check that the agent alone owns them, set who may see what.

    ``group`` (a gid; None for none) is the traverse group: the only group
    that may pass through the root. Raises UnsafeTierRoot naming the path and
    what to do when a root, one of its top-level directories or an ancestor is
    not safe, and TierRootInUse when another agent holds it.

    Returns a descriptor of the root holding its exclusive lock, taken before
    anything in it changes: the agent keeps it open while it serves, so a second
    daemon pointed at the same root stops here, before it sweeps a thing.
    """
    root = Path.cwd() / root  # an absolute root stays as it is
    _check_links_on_the_way(root.parent)
    _check_ancestors(root.parent)
    root.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    _claim(root)
    with contextlib.suppress(FileExistsError):  # a dangling link too: refused below
        root.mkdir(mode=PRIVATE_DIR_MODE)
    try:
        fd = open_dir(root)
    except OSError as exc:
        raise _refusal(root, "is a symlink or not a directory") from exc
    try:
        _check_owned(fd, root)
        _lock(fd, root)
        # Closed while its entries are set: a root an older agent left open stays shut
        # until nothing in it is readable by others.
        os.fchmod(fd, PRIVATE_DIR_MODE)
        for name in (*layout.traversed, *layout.private):
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=fd)
        with os.scandir(fd) as scan:
            entries = list(scan)
        for entry in entries:
            _prepare_entry(fd, root, entry, layout=layout, group=group)
        _open_for_traversal(fd, group)
        journal_key(root)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock(fd: int, root: Path) -> None:
    """Take the root's exclusive lock (released when the holder's descriptor closes or its
    process dies, so a crashed agent never leaves it held)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise TierRootInUse(
            f"Another prewarm agent is serving the tier root {root}: two agents on one cache "
            "would evict each other's snapshots. Stop the other agent (systemctl status "
            "prewarmd; a DaemonSet pod on the same host path), or give this one other tier "
            "roots."
        ) from None


def _claim(root: Path) -> None:
    """Swap a root another user made first in a shared directory for one of the agent's."""
    try:
        claim = claim_root(root, os.geteuid())
    except OSError as exc:
        raise _refusal(
            root,
            f"could not be moved aside ({exc.strerror}). Run `prewarmd --claim-roots --owner "
            "<the agent's user>` as root before the agent starts (the systemd unit and the "
            "DaemonSet do), or remove it by hand",
        ) from exc
    if claim.moved is not None:
        log.warning("%s", claim, extra={"root": str(root), "planted_by": claim.planted_by})


def _prepare_entry(
    fd: int, root: Path, entry: os.DirEntry[str], *, layout: RootLayout, group: int | None
) -> None:
    if entry.is_symlink():
        raise _refusal(root / entry.name, "is a symlink")
    if entry.is_dir(follow_symlinks=False):
        child = open_dir(entry.name, dir_fd=fd)
        try:
            _check_owned(child, root / entry.name)
            if entry.name in layout.traversed:
                _open_for_traversal(child, group)
            elif entry.name not in layout.own_rules:
                os.fchmod(child, PRIVATE_DIR_MODE)
        finally:
            os.close(child)
    elif entry.is_file(follow_symlinks=False):
        _make_private(fd, entry.name)


def _open_for_traversal(fd: int, group: int | None) -> None:
    if group is None:
        os.fchmod(fd, TRAVERSE_MODE)
        return
    os.fchown(fd, -1, group)
    os.fchmod(fd, GROUP_TRAVERSE_MODE)


def _make_private(dir_fd: int, name: str) -> None:
    """0600 for a file of the agent's with one link; anything else is left as it is."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and info.st_nlink == 1:
            os.fchmod(fd, PRIVATE_FILE_MODE)
    finally:
        os.close(fd)


def journal_key(root: Path) -> bytes:
    """The root's journal signing key, created (0600, random) on first use.

    A key file that is a link, not the agent's, readable by others or of the
    wrong size is replaced: journals signed with it are then not resumed,
    which costs a download, never a wrong byte.
    """
    path = root / JOURNAL_KEY_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return _create_key(path)
    except OSError as exc:
        log.warning("replacing %s: %s", path, exc)
        path.unlink(missing_ok=True)
        return _create_key(path)
    try:
        info = os.fstat(fd)
        key = os.read(fd, _KEY_BYTES + 1)
    finally:
        os.close(fd)
    trusted = (
        stat.S_ISREG(info.st_mode)
        and info.st_uid == os.geteuid()
        and not info.st_mode & 0o077
        and len(key) == _KEY_BYTES
    )
    if trusted:
        return key
    log.warning("replacing %s: not a private %d-byte file of the agent", path, _KEY_BYTES)
    path.unlink(missing_ok=True)
    return _create_key(path)


def _create_key(path: Path) -> bytes:
    # Written aside and linked into place: a reader never sees half a key, and
    # of two agents racing, both end up with the one that was linked first.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        os.write(fd, secrets.token_bytes(_KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return journal_key(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()


def _check_owned(fd: int, path: Path) -> None:
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise _refusal(path, f"is owned by uid {info.st_uid}, not the agent's uid {os.geteuid()}")
    if info.st_mode & _WRITABLE_BY_OTHERS:
        mode = stat.S_IMODE(info.st_mode)
        raise _refusal(path, f"is writable by group or others (mode {mode:o})")


def _check_links_on_the_way(path: Path) -> None:
    """Every link the path to the root goes through must be root's or the agent's.

    ``realpath`` shows where a link points now; another user who owns a link
    (even in a sticky directory such as ``/dev/shm``) can point it elsewhere
    after the check, so the link itself is checked, and so is every link its
    target goes through.
    """
    pending = list(path.parts[1:])
    current = Path(path.anchor)
    for _ in range(_MAX_COMPONENTS):
        if not pending:
            return
        candidate = current / pending.pop(0)
        try:
            info = candidate.lstat()
        except FileNotFoundError:
            return  # created by the agent below, so its own
        if not stat.S_ISLNK(info.st_mode):
            current = candidate
            continue
        if info.st_uid not in (0, os.geteuid()):
            raise _refusal(
                candidate,
                f"is a symlink owned by uid {info.st_uid}, who can point it elsewhere at any "
                "time, and a tier root is reached through it",
            )
        target = candidate.readlink()
        pending[:0] = target.parts[1:] if target.is_absolute() else target.parts
        current = Path(target.anchor) if target.is_absolute() else current
    raise _refusal(path, "is reached through too many symlinks")


def _check_ancestors(parent: Path) -> None:
    """No one but root and the agent may rename or replace what leads to the root."""
    existing = Path(os.path.realpath(parent))
    while not existing.exists():
        existing = existing.parent
    for ancestor in (existing, *existing.parents):
        info = ancestor.stat()
        if info.st_uid not in (0, os.geteuid()):
            raise _refusal(ancestor, f"is above a tier root and owned by uid {info.st_uid}")
        if info.st_mode & _WRITABLE_BY_OTHERS and not info.st_mode & stat.S_ISVTX:
            raise _refusal(ancestor, "is above a tier root, writable by others and not sticky")


def _refusal(path: Path, problem: str) -> UnsafeTierRoot:
    return UnsafeTierRoot(
        f"Refusing to use {path}: it {problem}. The agent must create its tier roots and "
        "everything in them itself; another user may have planted this. Inspect it, remove "
        "it (or fix its owner and mode: chown to the agent's user, chmod go-w), then start "
        "the agent again.",
    )
