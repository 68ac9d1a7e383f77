"""The node cache: tiers, published snapshots, manifests, usage, eviction.

Layout of each tier root::

    snapshots/<key>/...     published model files (what clients map)
    manifests/<key>.json    written last, atomically; a snapshot exists iff this does
    usage/<key>.json        last use and hit count (best effort, rewritten on use)
    staging/<key>.<nonce>/  pulls in progress; never visible to clients
    trash/                  evicted snapshots on their way out

Only the event loop thread mutates the in-memory index; file work that can be
slow runs in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._exceptions import InvalidRequest, NotFound
from ._snapshot import KEY_LENGTH, TierName
from ._uri import parse_uri

__all__ = ["CachedFile", "CachedModel", "Store", "TierUsage", "Usage"]

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
_MIN_KEY_PREFIX = 8
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class CachedFile:
    path: str
    size: int
    etag: str


@dataclass(frozen=True, slots=True)
class CachedModel:
    """A published snapshot, as its manifest describes it."""

    key: str
    uri: str
    tier: TierName
    path: Path
    files: tuple[CachedFile, ...]
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    created: float

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(slots=True)
class Usage:
    last_used: float
    hit_count: int = 0


@dataclass(frozen=True, slots=True)
class TierUsage:
    tier: TierName
    root: Path
    capacity_bytes: int
    free_bytes: int
    used_bytes: int
    model_count: int


@dataclass(slots=True)
class _Entry:
    model: CachedModel
    usage: Usage = field(default_factory=lambda: Usage(last_used=time.time()))


class Store:
    """Published snapshots across tiers, indexed by key."""

    def __init__(self, roots: Mapping[TierName, Path]) -> None:
        self._roots: dict[TierName, Path] = {tier: Path(root) for tier, root in roots.items()}
        self._entries: dict[str, _Entry] = {}

    # -- start-up ------------------------------------------------------------------

    async def open(self) -> None:
        """Create the tier layout and rebuild the index from disk."""
        entries = await asyncio.to_thread(self._scan_all)
        self._entries = {entry.model.key: entry for entry in entries}
        log.info("store ready", extra={"models": len(self._entries)})

    def _scan_all(self) -> list[_Entry]:
        found: list[_Entry] = []
        for tier, root in self._roots.items():
            for sub in ("snapshots", "manifests", "usage", "staging", "trash"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            # A pull interrupted by a crash cannot be resumed yet: start it over.
            for leftover in (root / "staging").iterdir():
                _remove_tree(leftover)
            for leftover in (root / "trash").iterdir():
                _remove_tree(leftover)
            found.extend(self._scan_tier(tier, root))
        return found

    def _scan_tier(self, tier: TierName, root: Path) -> list[_Entry]:
        entries: list[_Entry] = []
        published: set[str] = set()
        for manifest_path in (root / "manifests").glob("*.json"):
            key = manifest_path.stem
            try:
                model = _read_manifest(manifest_path, tier=tier, root=root)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("dropping unreadable manifest %s: %s", manifest_path, exc)
                manifest_path.unlink(missing_ok=True)
                continue
            if not _files_present(model):
                log.warning("dropping snapshot %s: its files are missing or resized", key)
                manifest_path.unlink(missing_ok=True)
                continue
            published.add(key)
            entries.append(_Entry(model=model, usage=_read_usage(root, key, model.created)))
        for directory in (root / "snapshots").iterdir():
            if directory.name not in published:
                log.warning("removing %s: no manifest, so it was never published", directory)
                _remove_tree(directory)
        for usage_path in (root / "usage").glob("*.json"):
            if usage_path.stem not in published:
                usage_path.unlink(missing_ok=True)
        return entries

    # -- queries ---------------------------------------------------------------------

    def roots(self) -> dict[TierName, Path]:
        return dict(self._roots)

    def get(self, key: str) -> CachedModel | None:
        entry = self._entries.get(key)
        return entry.model if entry else None

    def usage(self, key: str) -> Usage | None:
        entry = self._entries.get(key)
        return Usage(entry.usage.last_used, entry.usage.hit_count) if entry else None

    def models(self) -> list[CachedModel]:
        return sorted((e.model for e in self._entries.values()), key=lambda m: (m.uri, m.created))

    def newest_for(
        self, uri: str, include: tuple[str, ...], exclude: tuple[str, ...]
    ) -> CachedModel | None:
        """The most recently published snapshot of a URI with the same filters."""
        candidates = [
            e.model
            for e in self._entries.values()
            if e.model.uri == uri and e.model.include == include and e.model.exclude == exclude
        ]
        return max(candidates, key=lambda m: m.created, default=None)

    def find(self, ref: str) -> list[CachedModel]:
        """Snapshots named by ``ref``: every snapshot of a URI, or one by key (prefix).

        Raises InvalidRequest for a malformed or ambiguous ref and NotFound when
        nothing matches.
        """
        if "://" in ref:
            uri = str(parse_uri(ref))
            matches = [e.model for e in self._entries.values() if e.model.uri == uri]
            if not matches:
                raise NotFound(
                    f"No cached snapshot of {uri}. See what is cached with `prewarm ls`."
                )
            return sorted(matches, key=lambda m: m.created)
        key = ref.lower()
        if not (_MIN_KEY_PREFIX <= len(key) <= KEY_LENGTH) or not set(key) <= _HEX:
            raise InvalidRequest(
                f"{ref!r} is neither an s3:// URI nor a snapshot key (8 to {KEY_LENGTH} hex "
                "digits). Copy a key from `prewarm ls`."
            )
        matches = [e.model for k, e in self._entries.items() if k.startswith(key)]
        if not matches:
            raise NotFound(f"No cached snapshot has a key starting with {key}. See `prewarm ls`.")
        if len(matches) > 1:
            raise InvalidRequest(
                f"Key prefix {key} matches {len(matches)} snapshots; give more digits."
            )
        return matches

    def tier_usage(self, tier: TierName) -> TierUsage:
        root = self._roots[tier]
        stats = os.statvfs(root)
        models = [e.model for e in self._entries.values() if e.model.tier == tier]
        return TierUsage(
            tier=tier,
            root=root,
            capacity_bytes=stats.f_blocks * stats.f_frsize,
            free_bytes=stats.f_bavail * stats.f_frsize,
            used_bytes=sum(m.total_bytes for m in models),
            model_count=len(models),
        )

    # -- changes -----------------------------------------------------------------------

    async def record_use(self, key: str, *, hit: bool) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.usage.last_used = time.time()
        if hit:
            entry.usage.hit_count += 1
        snapshot = {"last_used": entry.usage.last_used, "hit_count": entry.usage.hit_count}
        root = self._roots[entry.model.tier]
        try:
            await asyncio.to_thread(_write_json_atomic, root / "usage" / f"{key}.json", snapshot)
        except OSError as exc:  # usage is advisory; never fail a request over it
            log.warning("could not record use of %s: %s", key, exc)

    def create_staging(self, tier: TierName, key: str) -> Path:
        staging = self._roots[tier] / "staging" / f"{key}.{secrets.token_hex(4)}"
        staging.mkdir(parents=True)
        return staging

    def discard_staging(self, staging: Path) -> None:
        _remove_tree(staging)

    async def publish(self, staging: Path, model: CachedModel) -> CachedModel:
        """Move a complete staging directory into place, then write its manifest.

        The rename makes every file appear at once; the manifest, written last,
        is what makes the snapshot exist for clients and for reconcile.
        """
        existing = self.get(model.key)
        if existing is not None:
            await asyncio.to_thread(_remove_tree, staging)
            return existing
        root = self._roots[model.tier]
        final = root / "snapshots" / model.key
        published = CachedModel(
            key=model.key,
            uri=model.uri,
            tier=model.tier,
            path=final,
            files=model.files,
            include=model.include,
            exclude=model.exclude,
            created=time.time(),
        )
        await asyncio.to_thread(_publish_files, staging, final, root, published)
        self._entries[model.key] = _Entry(model=published, usage=Usage(published.created))
        await self.record_use(model.key, hit=False)
        return published

    async def evict(self, key: str) -> CachedModel:
        """Remove a snapshot: hide it (manifest first), then unlink its files.

        Files are unlinked, never truncated, so a process that still maps them
        keeps valid pages until it unmaps.
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            raise NotFound(f"Snapshot {key} is not cached. See `prewarm ls`.")
        root = self._roots[entry.model.tier]
        await asyncio.to_thread(_unpublish, root, key)
        return entry.model


# -- file helpers (run in worker threads) -------------------------------------------------


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, document: Mapping[str, Any], *, durable: bool = False) -> None:
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
        _fsync_dir(path.parent)


def _publish_files(staging: Path, final: Path, root: Path, model: CachedModel) -> None:
    if final.exists():  # a leftover without a manifest; never served, safe to replace
        _remove_tree(final)
    staging.rename(final)
    _fsync_dir(final.parent)
    _write_json_atomic(
        root / "manifests" / f"{model.key}.json", _manifest_document(model), durable=True
    )


def _unpublish(root: Path, key: str) -> None:
    (root / "manifests" / f"{key}.json").unlink(missing_ok=True)
    (root / "usage" / f"{key}.json").unlink(missing_ok=True)
    doomed = root / "trash" / f"{key}.{secrets.token_hex(4)}"
    with contextlib.suppress(FileNotFoundError):
        (root / "snapshots" / key).rename(doomed)
    _remove_tree(doomed)


def _manifest_document(model: CachedModel) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "key": model.key,
        "uri": model.uri,
        "include": list(model.include),
        "exclude": list(model.exclude),
        "created": model.created,
        "files": [{"path": f.path, "size": f.size, "etag": f.etag} for f in model.files],
    }


def _read_manifest(path: Path, *, tier: TierName, root: Path) -> CachedModel:
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
        path=root / "snapshots" / key,
        files=tuple(
            CachedFile(path=str(f["path"]), size=int(f["size"]), etag=str(f["etag"]))
            for f in document["files"]
        ),
        include=tuple(document["include"]),
        exclude=tuple(document["exclude"]),
        created=float(document["created"]),
    )


def _files_present(model: CachedModel) -> bool:
    for cached in model.files:
        try:
            if (model.path / cached.path).stat().st_size != cached.size:
                return False
        except OSError:
            return False
    return True


def _read_usage(root: Path, key: str, created: float) -> Usage:
    try:
        document = json.loads((root / "usage" / f"{key}.json").read_text())
        return Usage(last_used=float(document["last_used"]), hit_count=int(document["hit_count"]))
    except (OSError, ValueError, KeyError, TypeError):
        return Usage(last_used=created)
