"""Filesystem steps the store, the compile cache and the manifests share.

Blocking: call them from worker threads (``asyncio.to_thread``), never on the
event loop, except for the O(1) ``retire`` rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "remove_tree", "retire", "write_json_atomic"]


def remove_tree(path: Path) -> None:
    """Delete a directory tree or a file; a symlink is unlinked, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, document: Mapping[str, Any], *, durable: bool = False) -> None:
    """Replace ``path`` with ``document`` so a reader sees the old or the new file, never half.

    ``durable`` also fsyncs the file and its directory (for what must survive a
    power cut, such as a snapshot manifest).
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with tmp.open("w") as fh:
            json.dump(document, fh, separators=(",", ":"))
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)
