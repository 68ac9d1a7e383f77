"""A tier root on disk: where things live, who may see them, the manifest and usage files.

Layout of each tier root (modes with no traverse group; with one, 0711 is 0710)::

    ./                      0711  pods pass through, nobody lists
    snapshots/              0711  likewise
    snapshots/<name>/...    0555, files 0444: published model files (what clients map),
                                  <name> an unguessable capability (agent.store.snapshot_names)
    manifests/<key>.json    0700, files 0600: written last, atomically; a snapshot exists iff
                                  this does
    usage/<key>.json        0700: last use and hit count (best effort, rewritten on use)
    staging/<key>/          0700: pulls in progress or interrupted (see journal)
    trash/                  0700: evicted snapshots and dropped pulls on their way out
    journal.key             0600: the root's secret (agent.store.roots)

Only the agent may list anything or read what it keeps for itself; a pod
reaches exactly the snapshot directories the API handed it. A snapshot never
changes once its manifest exists, and nothing in it may be a link.

Everything here is blocking file I/O: the store runs it in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent._exceptions import IntegrityError, NoSpace, PrewarmError
from agent._fs import (
    fsync_dir,
    open_dir,
    read_bytes_nofollow,
    remove_tree,
    retire,
    write_json_atomic,
)
from agent._vocabulary import TierName
from agent.store.records import CachedFile, CachedModel, Usage
from agent.store.roots import RootLayout
from agent.store.snapshot_names import SnapshotNames

__all__ = [
    "LAYOUT",
    "MANIFEST_FORMAT",
    "manifest_path",
    "publish_files",
    "read_manifest",
    "read_usage",
    "return_to_staging",
    "snapshot_dir",
    "snapshots_dir",
    "staging_dir",
    "trash_dir",
    "unpublish",
    "usage_path",
    "write_usage",
]

MANIFEST_FORMAT = 1
# Test-only: the one crash point a test can ask for, to kill the agent between
# the rename of a snapshot into place and its manifest (reconcile must resume it).
CRASH_POINT_VARIABLE = "PREWARM_TEST_CRASH_AT"
_FILE_MODE, _DIRECTORY_MODE = 0o444, 0o555
_USAGE_LIMIT = 64 * 1024
# Who may pass through what; compile/ (agent.compile) keeps the modes its owner gives it.
LAYOUT = RootLayout(
    traversed=("snapshots",),
    private=("manifests", "usage", "staging", "trash"),
    own_rules=("compile",),
)


def snapshots_dir(root: Path) -> Path:
    """The directory published snapshots live in."""
    return root / "snapshots"


def snapshot_dir(root: Path, key: str, names: SnapshotNames) -> Path:
    """Where snapshot ``key`` is published: under its capability, not its key."""
    return snapshots_dir(root) / names.of(key)


def manifest_path(root: Path, key: str) -> Path:
    """Snapshot ``key``'s manifest: written last, it is what makes the snapshot exist."""
    return root / "manifests" / f"{key}.json"


def usage_path(root: Path, key: str) -> Path:
    """Snapshot ``key``'s use record (last use, hits, pin)."""
    return root / "usage" / f"{key}.json"


def staging_dir(root: Path, key: str) -> Path:
    """Where a pull of ``key`` stages its files and journal."""
    return root / "staging" / key


def trash_dir(root: Path) -> Path:
    """Where retired directories wait to be deleted (on the root's filesystem)."""
    return root / "trash"


def publish_files(staged_data: Path, root: Path, model: CachedModel) -> None:
    """Seal the staged files, rename them to ``model.path``, then write the manifest.

    Raises IntegrityError if staging holds anything but the snapshot's regular
    files (a symlink, a device, an extra file), and NoSpace when the disk is
    full at the manifest; either way nothing is left in ``snapshots/``.
    """
    final = model.path
    _seal(staged_data, {f.path for f in model.files}, model.key)
    if os.path.lexists(final):  # a leftover without a manifest; never served, safe to replace
        _withdraw(root, final)
    staged_data.rename(final)
    if os.environ.get(CRASH_POINT_VARIABLE) == "publish-renamed":
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        _chmod_dir(final, _DIRECTORY_MODE)
        fsync_dir(final.parent)
        write_json_atomic(manifest_path(root, model.key), _manifest_document(model), durable=True)
    except OSError as exc:
        with contextlib.suppress(OSError):
            manifest_path(root, model.key).unlink(missing_ok=True)
        _withdraw(root, final)
        raise _manifest_error(exc, root, model) from exc


def return_to_staging(final: Path, staged_data: Path) -> None:
    """Move a snapshot directory that never got its manifest back to ``staging/<key>/data``.

    Its files become writable again so the pull that resumes it can reopen them.
    """
    _chmod_dir(final, 0o755)
    final.rename(staged_data)
    for path, is_dir in _walk(staged_data):
        if is_dir:
            _chmod_dir(path, 0o755)
        else:
            _chmod_file(path, 0o644)  # a link is left alone: the resuming pull refuses it


def unpublish(root: Path, model: CachedModel) -> None:
    """Hide a snapshot (manifest first), then delete its files.

    Files are unlinked, never truncated, so a process that still maps them
    keeps valid pages until it unmaps.
    """
    manifest_path(root, model.key).unlink(missing_ok=True)
    usage_path(root, model.key).unlink(missing_ok=True)
    _withdraw(root, model.path)


def _withdraw(root: Path, final: Path) -> None:
    # Moving a directory rewrites its "..", so it must be writable (for a non-root agent).
    # A planted link fails here; retire then moves the link, never what it points to.
    with contextlib.suppress(OSError):
        _chmod_dir(final, 0o755)
    remove_tree(retire(final, trash_dir(root)))


def _seal(data: Path, expected: set[str], key: str) -> None:
    """Check every entry of a staged snapshot with lstat and make it read-only."""
    try:
        _chmod_dir(data, 0o755)
    except OSError as exc:
        raise IntegrityError(
            f"Staging of {key} is not a directory of the agent's; not publishing it.",
            check="file-type",
        ) from exc
    found: set[str] = set()
    for path, is_dir in _walk(data):
        relative = path.relative_to(data).as_posix()
        if is_dir:
            continue
        try:
            info = _chmod_file(path, _FILE_MODE)
        except OSError:  # ELOOP: a symlink
            info = None
        if info is None or info.st_nlink != 1 or relative not in expected:
            raise IntegrityError(
                f"Staging of {key} holds {relative!r}, which is not one of the snapshot's own "
                "regular files (a link, a device or an extra file); not publishing it.",
                path=relative,
                check="file-type",
            )
        found.add(relative)
    if found != expected:
        missing = sorted(expected - found)[:5]
        raise IntegrityError(
            f"Staging of {key} lacks {missing}; not publishing it.", check="complete"
        )
    for path, is_dir in reversed(list(_walk(data))):
        if is_dir and path != data:  # data itself after its rename, which needs it writable
            _chmod_dir(path, _DIRECTORY_MODE)


def _walk(top: Path) -> Iterator[tuple[Path, bool]]:
    """Every entry under ``top`` (``top`` first), parents before children, links not entered."""
    yield top, True
    with os.scandir(top) as entries:
        children = list(entries)
    for entry in children:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path))
        else:
            yield Path(entry.path), False


def _chmod_dir(path: Path, mode: int) -> None:
    fd = open_dir(path)  # a link in its place fails here instead of being followed
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _chmod_file(path: Path, mode: int) -> os.stat_result | None:
    """Change the mode of a file that is the agent's alone, without following a link.

    None (and the mode untouched) if it is not a regular file of the agent's
    uid with one link: a hard link to another file (``/etc/shadow``) must not
    be made readable before it is refused.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1 or info.st_uid != os.geteuid():
            return None
        os.fchmod(fd, mode)
        return info
    finally:
        os.close(fd)


def _manifest_error(exc: OSError, root: Path, model: CachedModel) -> PrewarmError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(
            f"The tier at {root} ran out of space while writing the manifest of {model.uri}; "
            "the snapshot was not published. Evict models (`prewarm ls`, `prewarm evict`) "
            "or request the other tier."
        )
    return PrewarmError(
        f"Could not write the manifest of {model.uri} under {root} ({exc.strerror}); "
        "the snapshot was not published. Check the tier's filesystem and the agent's log."
    )


def write_usage(root: Path, key: str, usage: Usage, *, durable: bool) -> None:
    """Save snapshot ``key``'s use record; ``durable`` syncs it to disk."""
    document = {"last_used": usage.last_used, "hit_count": usage.hit_count, "pinned": usage.pinned}
    write_json_atomic(usage_path(root, key), document, durable=durable)


def read_usage(root: Path, key: str, created: float) -> Usage:
    """The recorded use of a snapshot; a missing or damaged record: unused since ``created``."""
    try:
        # Never followed or read if it is a link or a FIFO: a hint must not hang the start-up scan.
        document = json.loads(read_bytes_nofollow(usage_path(root, key), limit=_USAGE_LIMIT))
        return Usage(
            last_used=float(document["last_used"]),
            hit_count=int(document["hit_count"]),
            pinned=bool(document.get("pinned", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return Usage(last_used=created)


def read_manifest(path: Path, *, tier: TierName, root: Path, names: SnapshotNames) -> CachedModel:
    """The snapshot a manifest describes; raises OSError, ValueError, KeyError or TypeError."""
    document = json.loads(read_bytes_nofollow(path))
    if document.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"unknown manifest format {document.get('format')!r}")
    key = str(document["key"])
    if key != path.stem:
        raise ValueError(f"manifest names key {key}, file is {path.name}")
    return CachedModel(
        key=key,
        uri=str(document["uri"]),
        tier=tier,
        path=snapshot_dir(root, key, names),
        files=tuple(
            CachedFile(
                path=_safe_manifest_path(str(f["path"])),
                size=int(f["size"]),
                etag=str(f["etag"]),
                digest=str(f.get("digest", "")),
            )
            for f in document["files"]
        ),
        include=tuple(document["include"]),
        exclude=tuple(document["exclude"]),
        created=float(document["created"]),
        hash_chunk_size=int(document.get("hash_chunk_size", 0)),
        verified_by=str(document.get("verified_by", ""))[:512],
    )


def _manifest_document(model: CachedModel) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "key": model.key,
        "uri": model.uri,
        "include": list(model.include),
        "exclude": list(model.exclude),
        "created": model.created,
        "hash_chunk_size": model.hash_chunk_size,
        "verified_by": model.verified_by,
        "files": [
            {"path": f.path, "size": f.size, "etag": f.etag, "digest": f.digest}
            for f in model.files
        ],
    }


def _safe_manifest_path(path: str) -> str:
    # A manifest is ours, but a tampered one must not make us stat or hash outside the dir.
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\x00" in path:
        raise ValueError(f"unsafe path {path!r} in manifest")
    return path
