"""A tier root on disk: where things live, and the manifest and usage files.

Layout of each tier root::

    snapshots/<key>/...     published model files (what clients map)
    manifests/<key>.json    written last, atomically; a snapshot exists iff this does
    usage/<key>.json        last use and hit count (best effort, rewritten on use)
    staging/<key>/          pulls in progress or interrupted (see journal); never visible
    trash/                  evicted snapshots and dropped pulls on their way out

Everything here is blocking file I/O: the store runs it in worker threads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agent._fs import fsync_dir, remove_tree, retire, write_json_atomic
from agent._vocabulary import TierName
from agent.store.records import CachedFile, CachedModel, Usage

__all__ = [
    "MANIFEST_FORMAT",
    "SUBDIRECTORIES",
    "manifest_path",
    "publish_files",
    "read_manifest",
    "read_usage",
    "snapshot_dir",
    "staging_dir",
    "trash_dir",
    "unpublish",
    "usage_path",
    "write_usage",
]

MANIFEST_FORMAT = 1
SUBDIRECTORIES = ("snapshots", "manifests", "usage", "staging", "trash")


def snapshot_dir(root: Path, key: str) -> Path:
    return root / "snapshots" / key


def manifest_path(root: Path, key: str) -> Path:
    return root / "manifests" / f"{key}.json"


def usage_path(root: Path, key: str) -> Path:
    return root / "usage" / f"{key}.json"


def staging_dir(root: Path, key: str) -> Path:
    return root / "staging" / key


def trash_dir(root: Path) -> Path:
    return root / "trash"


def publish_files(staged_data: Path, root: Path, model: CachedModel) -> None:
    """Rename the staged files into ``snapshots/``, then write the manifest that publishes them."""
    final = snapshot_dir(root, model.key)
    if final.exists():  # a leftover without a manifest; never served, safe to replace
        remove_tree(final)
    staged_data.rename(final)
    fsync_dir(final.parent)
    write_json_atomic(manifest_path(root, model.key), _manifest_document(model), durable=True)


def unpublish(root: Path, key: str) -> None:
    """Hide a snapshot (manifest first), then delete its files.

    Files are unlinked, never truncated, so a process that still maps them
    keeps valid pages until it unmaps.
    """
    manifest_path(root, key).unlink(missing_ok=True)
    usage_path(root, key).unlink(missing_ok=True)
    remove_tree(retire(snapshot_dir(root, key), trash_dir(root)))


def write_usage(root: Path, key: str, usage: Usage, *, durable: bool) -> None:
    document = {"last_used": usage.last_used, "hit_count": usage.hit_count, "pinned": usage.pinned}
    write_json_atomic(usage_path(root, key), document, durable=durable)


def read_usage(root: Path, key: str, created: float) -> Usage:
    """The recorded use of a snapshot; a missing or damaged record: unused since ``created``."""
    try:
        document = json.loads(usage_path(root, key).read_text())
        return Usage(
            last_used=float(document["last_used"]),
            hit_count=int(document["hit_count"]),
            pinned=bool(document.get("pinned", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return Usage(last_used=created)


def read_manifest(path: Path, *, tier: TierName, root: Path) -> CachedModel:
    """The snapshot a manifest describes; raises OSError, ValueError, KeyError or TypeError."""
    document = json.loads(path.read_text())
    if document.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"unknown manifest format {document.get('format')!r}")
    key = str(document["key"])
    if key != path.stem:
        raise ValueError(f"manifest names key {key}, file is {path.name}")
    return CachedModel(
        key=key,
        uri=str(document["uri"]),
        tier=tier,
        path=snapshot_dir(root, key),
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
