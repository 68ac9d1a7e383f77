"""Filesystem steps the store, the compile cache and the manifests share.

The agent runs as root over directories other users can see, so a name inside
a tier root is opened without following symlinks: ``open_beneath`` walks a
relative path one component at a time through directory descriptors with
``O_NOFOLLOW``, and ``remove_tree`` unlinks a link instead of entering it.

Blocking: call them from worker threads (``asyncio.to_thread``), never on the
event loop, except for the O(1) ``retire`` rename.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "blocking_ancestor",
    "fsync_dir",
    "open_beneath",
    "open_dir",
    "read_bytes_nofollow",
    "remove_tree",
    "retire",
    "write_json_atomic",
]

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A descriptor of a directory; OSError (ELOOP or ENOTDIR) if ``path`` is a symlink."""
    return os.open(path, _DIRECTORY_FLAGS, dir_fd=dir_fd)


def open_beneath(
    dir_fd: int, relative: str, flags: int, mode: int = 0o644, *, make_parents: bool = False
) -> int:
    """Open ``relative`` under the directory ``dir_fd`` without following any symlink.

    Every component is opened from its parent's descriptor with ``O_NOFOLLOW``,
    so a link anywhere on the path fails with ELOOP or ENOTDIR instead of
    leading outside. ``make_parents`` creates missing directories (0755).
    """
    *parents, leaf = relative.split("/")
    current = os.dup(dir_fd)
    try:
        for name in parents:
            if make_parents:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=current)
            child = open_dir(name, dir_fd=current)
            os.close(current)
            current = child
        return os.open(leaf, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=current)
    finally:
        os.close(current)


def read_bytes_nofollow(path: Path, *, limit: int = 1 << 20) -> bytes:
    """A small regular file's bytes; OSError if it is a link, not regular, or over ``limit``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        chunks: list[bytes] = []
        while chunk := os.read(fd, limit + 1):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Delete a directory tree or a file; a symlink is unlinked, never followed.

    Directories the store made read-only (0555) are made writable first, so
    this works for an agent that does not run as root too.
    """
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        path.unlink(missing_ok=True)
        return
    with contextlib.suppress(OSError):
        for _, _, _, fd in os.fwalk(path, follow_symlinks=False):
            os.fchmod(fd, 0o700)
    # rmtree works through directory descriptors and never enters a link.
    shutil.rmtree(path, ignore_errors=True)


def retire(path: Path, trash: Path) -> Path:
    """Move ``path`` into ``trash`` under a fresh name and return where it went.

    ``trash`` must be on the same filesystem, so the rename is O(1) whatever the
    size: the tree stops being visible at once and ``remove_tree`` can delete
    it later, off the event loop. A path that is already gone is not an error.
    """
    doomed = trash / f"{path.name}.{secrets.token_hex(4)}"
    with contextlib.suppress(FileNotFoundError):
        path.rename(doomed)
    return doomed


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = open_dir(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(
    path: Path, document: Mapping[str, Any], *, durable: bool = False, mode: int = 0o600
) -> None:
    """Replace ``path`` with ``document`` so a reader sees the old or the new file, never half.

    ``durable`` also fsyncs the file and its directory (for what must survive a
    power cut, such as a snapshot manifest); ``mode`` is the new file's. By
    default the file is the agent's alone (0600): what it records about the cache
    (URIs, keys, pins, leases) is no one else's to read.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(tmp, flags, mode), "w") as fh:
            json.dump(document, fh, separators=(",", ":"))
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        tmp.replace(path)
    finally:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            tmp.unlink()
    if durable:
        fsync_dir(path.parent)


def blocking_ancestor(path: Path) -> Path | None:
    """The nearest existing directory above ``path`` in which this process may not create it.

    None when it may (or ``path`` is the root). Checked with the effective ids before
    anything is made, so a start that cannot create one of its paths creates none of
    them: a root made by a non-root start would otherwise stay behind and be refused,
    as another user's, by the next start as root.
    """
    ancestor = Path.cwd() / path  # an absolute path stays as it is
    while ancestor != ancestor.parent:
        ancestor = ancestor.parent
        if ancestor.exists():
            writable = os.access(ancestor, os.W_OK | os.X_OK, effective_ids=True)
            return None if writable and ancestor.is_dir() else ancestor
    return None
