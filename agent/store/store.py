"""The node cache: tiers, published snapshots, manifests, usage, eviction.

Layout of each tier root::

    snapshots/<key>/...     published model files (what clients map)
    manifests/<key>.json    written last, atomically; a snapshot exists iff this does
    usage/<key>.json        last use and hit count (best effort, rewritten on use)
    staging/<key>/          pulls in progress or interrupted (see _journal); never visible
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
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from agent._exceptions import InvalidRequest, NotFound
from agent._snapshot import KEY_LENGTH, TierName
from agent._uri import parse_uri
from agent.store.budget import Candidate, TierLimits, measure_limits
from agent.store.journal import DATA_DIR, read_header

__all__ = [
    "CachedFile",
    "CachedModel",
    "ExtraUsage",
    "Leftover",
    "Store",
    "TierBudget",
    "TierUsage",
    "Usage",
]

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
_MIN_KEY_PREFIX = 8
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class CachedFile:
    path: str
    size: int
    etag: str
    # Content digest computed while writing (see _integrity); "" if unknown.
    digest: str = ""


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
    # Bytes per hashed chunk of each file's digest (0: files carry no digest).
    hash_chunk_size: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(slots=True)
class Usage:
    last_used: float
    hit_count: int = 0
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class Leftover:
    """A staging directory an interrupted pull left behind; a later pull may resume it."""

    key: str
    tier: TierName
    path: Path
    total_bytes: int


@dataclass(frozen=True, slots=True)
class TierUsage:
    tier: TierName
    root: Path
    capacity_bytes: int
    free_bytes: int
    used_bytes: int
    model_count: int
    budget_bytes: int
    reserve_bytes: int
    staging_bytes: int
    pinned_count: int


@dataclass(slots=True)
class _Entry:
    model: CachedModel
    usage: Usage = field(default_factory=lambda: Usage(last_used=time.time()))


class ExtraUsage(Protocol):
    """Bytes on a tier that are not snapshots (compile caches): counted in its budget,
    and evicted only when evicting every evictable snapshot would not be enough."""

    def extra_bytes(self) -> int: ...

    def extra_candidates(self) -> list[Candidate]: ...

    async def evict_extra(self, keys: Sequence[str], reason: str) -> int:
        """Evict these keys (skipping any in use by now); returns the bytes freed."""
        ...


@dataclass(frozen=True, slots=True)
class TierBudget:
    """A tier's budget and reserve as configured: sizes or percentages."""

    budget: str = "100%"
    reserve: str = "0"


class Store:
    """Published snapshots across tiers, indexed by key."""

    def __init__(
        self,
        roots: Mapping[TierName, Path],
        budgets: Mapping[TierName, TierBudget] | None = None,
    ) -> None:
        self._roots: dict[TierName, Path] = {tier: Path(root) for tier, root in roots.items()}
        self._budgets = {tier: (budgets or {}).get(tier, TierBudget()) for tier in self._roots}
        self._entries: dict[str, _Entry] = {}
        self._leftovers: dict[str, Leftover] = {}
        # Bytes reserved by pulls in progress, by key (their staging directories).
        self._in_flight: dict[str, tuple[TierName, int]] = {}
        self._extra: dict[TierName, ExtraUsage] = {}

    # -- start-up ------------------------------------------------------------------

    async def open(self) -> None:
        """Create the tier layout and rebuild the index from disk."""
        entries, leftovers = await asyncio.to_thread(self._scan_all)
        self._entries = {entry.model.key: entry for entry in entries}
        self._leftovers = {leftover.key: leftover for leftover in leftovers}
        log.info(
            "store ready",
            extra={"models": len(self._entries), "resumable_pulls": len(self._leftovers)},
        )

    def _scan_all(self) -> tuple[list[_Entry], list[Leftover]]:
        found: list[_Entry] = []
        leftovers: list[Leftover] = []
        for tier, root in self._roots.items():
            for sub in ("snapshots", "manifests", "usage", "staging", "trash"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            for leftover in (root / "trash").iterdir():
                _remove_tree(leftover)
            entries = self._scan_tier(tier, root)
            published = {entry.model.key for entry in entries}
            leftovers.extend(_scan_staging(tier, root, published))
            found.extend(entries)
        return found, leftovers

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
        if entry is None:
            return None
        return Usage(entry.usage.last_used, entry.usage.hit_count, entry.usage.pinned)

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

    def limits(self, tier: TierName) -> TierLimits:
        budget = self._budgets[tier]
        return measure_limits(tier, self._roots[tier], budget.budget, budget.reserve)

    def attach_extra(self, tier: TierName, extra: ExtraUsage) -> None:
        """Count ``extra``'s bytes on ``tier`` too (see ExtraUsage)."""
        self._extra[tier] = extra

    def extra(self, tier: TierName) -> ExtraUsage | None:
        return self._extra.get(tier)

    def used_bytes(self, tier: TierName) -> int:
        """Published bytes, bytes of pulls in progress and resumable leftovers, and extras."""
        extra = self._extra.get(tier)
        extra_bytes = extra.extra_bytes() if extra is not None else 0
        return self.published_bytes(tier) + self.staging_bytes(tier) + extra_bytes

    def published_bytes(self, tier: TierName) -> int:
        return sum(e.model.total_bytes for e in self._entries.values() if e.model.tier == tier)

    def staging_bytes(self, tier: TierName) -> int:
        in_flight = sum(size for t, size in self._in_flight.values() if t == tier)
        waiting = sum(
            lo.total_bytes
            for lo in self._leftovers.values()
            if lo.tier == tier and lo.key not in self._in_flight
        )
        return in_flight + waiting

    def candidates(self, tier: TierName, protected: Set[str]) -> list[Candidate]:
        """Every snapshot of a tier as an eviction candidate, protection marked."""
        return [
            Candidate(
                key=key,
                size=entry.model.total_bytes,
                last_used=entry.usage.last_used,
                protected=entry.usage.pinned or key in protected,
            )
            for key, entry in self._entries.items()
            if entry.model.tier == tier
        ]

    def tier_usage(self, tier: TierName) -> TierUsage:
        limits = self.limits(tier)
        entries = [e for e in self._entries.values() if e.model.tier == tier]
        return TierUsage(
            tier=tier,
            root=self._roots[tier],
            capacity_bytes=limits.fs_total_bytes,
            free_bytes=limits.fs_free_bytes,
            used_bytes=sum(e.model.total_bytes for e in entries),
            model_count=len(entries),
            budget_bytes=limits.budget_bytes,
            reserve_bytes=limits.reserve_bytes,
            staging_bytes=self.staging_bytes(tier),
            pinned_count=sum(1 for e in entries if e.usage.pinned),
        )

    # -- changes -----------------------------------------------------------------------

    async def record_use(self, key: str, *, hit: bool) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.usage.last_used = time.time()
        if hit:
            entry.usage.hit_count += 1
        await self._save_usage(entry)

    async def set_pinned(self, key: str, pinned: bool) -> CachedModel:
        entry = self._entries.get(key)
        if entry is None:
            raise NotFound(f"Snapshot {key} is not cached. See `prewarm ls`.")
        entry.usage.pinned = pinned
        await self._save_usage(entry, strict=True)
        return entry.model

    async def _save_usage(self, entry: _Entry, *, strict: bool = False) -> None:
        document = {
            "last_used": entry.usage.last_used,
            "hit_count": entry.usage.hit_count,
            "pinned": entry.usage.pinned,
        }
        path = self._roots[entry.model.tier] / "usage" / f"{entry.model.key}.json"
        try:
            await asyncio.to_thread(_write_json_atomic, path, document, durable=strict)
        except OSError as exc:
            if strict:  # a pin must stick; say so if it cannot be saved
                raise
            log.warning("could not record use of %s: %s", entry.model.key, exc)

    def leftover(self, key: str) -> Leftover | None:
        """A resumable staging directory for this snapshot, if a pull left one."""
        return self._leftovers.get(key)

    def staging_path(self, tier: TierName, key: str) -> Path:
        return self._roots[tier] / "staging" / key

    def begin_staging(self, tier: TierName, key: str, total_bytes: int) -> list[Path]:
        """A pull of ``key`` starts on ``tier``: count its bytes until it ends.

        Returns what to ``purge``: a leftover of the same snapshot on the other
        tier, which this pull will not resume.
        """
        self._in_flight[key] = (tier, total_bytes)
        leftover = self._leftovers.get(key)
        if leftover is not None and leftover.tier != tier:
            return self.discard_leftover(key)
        return []

    def end_staging(self, key: str, *, keep: bool) -> list[Path]:
        """A pull ended. ``keep`` leaves its directory for a later pull to resume.

        Otherwise the directory is moved into ``trash/`` at once (it stops
        counting and cannot be resumed) and returned for ``purge``, so the
        event loop never waits on deleting a large tree.
        """
        tier, total = self._in_flight.pop(key, (None, 0))
        staging = self._roots[tier] / "staging" / key if tier else None
        if keep and tier is not None and staging is not None and staging.exists():
            self._leftovers[key] = Leftover(key, tier, staging, total)
            return []
        leftover = self._leftovers.pop(key, None)
        paths = {staging, leftover.path if leftover else None} - {None}
        return [self._retire(path) for path in paths if path is not None]

    def discard_leftover(self, key: str) -> list[Path]:
        """Forget a resumable pull; returns what to ``purge``."""
        leftover = self._leftovers.pop(key, None)
        in_flight = self._in_flight.get(key)
        if leftover is not None and (in_flight is None or in_flight[0] != leftover.tier):
            return [self._retire(leftover.path)]
        return []

    def _retire(self, path: Path) -> Path:
        # staging/ and trash/ share a filesystem: the rename is O(1) whatever the size.
        doomed = path.parent.parent / "trash" / f"{path.name}.{secrets.token_hex(4)}"
        with contextlib.suppress(FileNotFoundError):
            path.rename(doomed)
        return doomed

    async def purge(self, paths: Iterable[Path]) -> None:
        """Delete retired directories in a worker thread (start-up empties trash/ too)."""
        for path in paths:
            await asyncio.to_thread(_remove_tree, path)

    def discard_leftovers_of(self, uri: str, keep: str) -> list[Path]:
        """Drop resumable pulls of other snapshots of a URI: they can never resume now."""
        doomed: list[Path] = []
        for leftover in list(self._leftovers.values()):
            header = read_header(leftover.path)
            if leftover.key != keep and (header is None or header.uri == uri):
                doomed += self.discard_leftover(leftover.key)
        return doomed

    async def publish(self, staging: Path, model: CachedModel) -> CachedModel:
        """Move a complete staging data directory into place, then write its manifest.

        The rename makes every file appear at once; the manifest, written last,
        is what makes the snapshot exist for clients and for reconcile.
        """
        existing = self.get(model.key)
        if existing is not None:
            return existing
        root = self._roots[model.tier]
        final = root / "snapshots" / model.key
        published = replace(model, path=final, created=time.time())
        await asyncio.to_thread(_publish_files, staging / DATA_DIR, final, root, published)
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
        "hash_chunk_size": model.hash_chunk_size,
        "files": [
            {"path": f.path, "size": f.size, "etag": f.etag, "digest": f.digest}
            for f in model.files
        ],
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


def _safe_manifest_path(path: str) -> str:
    # A manifest is ours, but a tampered one must not make us stat or hash outside the dir.
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\x00" in path:
        raise ValueError(f"unsafe path {path!r} in manifest")
    return path


def _scan_staging(tier: TierName, root: Path, published: set[str]) -> list[Leftover]:
    """Keep staging directories a pull can resume; remove everything else."""
    leftovers: list[Leftover] = []
    for staging in (root / "staging").iterdir():
        header = read_header(staging) if staging.is_dir() else None
        if header is None or header.key != staging.name or staging.name in published:
            log.warning("removing %s: not a resumable pull", staging)
            _remove_tree(staging)
            continue
        leftovers.append(Leftover(header.key, tier, staging, header.total_bytes))
    return leftovers


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
        return Usage(
            last_used=float(document["last_used"]),
            hit_count=int(document["hit_count"]),
            pinned=bool(document.get("pinned", False)),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return Usage(last_used=created)
