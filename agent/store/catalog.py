"""The node cache: published snapshots across tiers, indexed by key in memory.

``Store`` is the facade the rest of the agent uses: queries, use and pins,
the bytes each tier holds (published, staging, extras), staging bookkeeping,
publish and evict. The on-disk layout is ``agent.store.layout``; rebuilding
the index at start-up is ``agent.store.reconcile``.

Only the event loop thread mutates the in-memory index; file work that can be
slow runs in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent._exceptions import InvalidRequest, NotFound
from agent._fs import remove_tree, retire
from agent._snapshot import KEY_LENGTH, key_prefix
from agent._uri import parse_uri
from agent._vocabulary import TierName
from agent.store.budget import Candidate, TierLimits, measure_limits
from agent.store.journal import DATA_DIR, read_header
from agent.store.layout import (
    publish_files,
    snapshot_dir,
    staging_dir,
    trash_dir,
    unpublish,
    write_usage,
)
from agent.store.reconcile import Found, scan_tiers
from agent.store.records import (
    CachedModel,
    ExtraUsage,
    Leftover,
    TierBudget,
    TierUsage,
    Usage,
)
from agent.store.roots import journal_key
from agent.store.snapshot_names import SnapshotNames

__all__ = ["Store"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    model: CachedModel
    usage: Usage = field(default_factory=lambda: Usage(last_used=time.time()))


class Store:
    """Published snapshots across tiers, indexed by key."""

    def __init__(
        self,
        roots: Mapping[TierName, Path],
        budgets: Mapping[TierName, TierBudget] | None = None,
        *,
        traverse_group: int | None = None,
    ) -> None:
        """``traverse_group`` (a gid; None for none): the only group that may pass through the
        roots to the snapshots it was handed (see ``agent.store.roots``)."""
        self._roots: dict[TierName, Path] = {tier: Path(root) for tier, root in roots.items()}
        self._traverse_group = traverse_group
        self._names: dict[TierName, SnapshotNames] = {}
        self._budgets = {tier: (budgets or {}).get(tier, TierBudget()) for tier in self._roots}
        self._entries: dict[str, _Entry] = {}
        self._leftovers: dict[str, Leftover] = {}
        # Bytes reserved by pulls in progress, by key (their staging directories).
        self._in_flight: dict[str, tuple[TierName, int]] = {}
        self._extra: dict[TierName, ExtraUsage] = {}
        # Descriptors holding each root's exclusive lock while the store is open.
        self._locks: Found | None = None

    # -- start-up ------------------------------------------------------------------

    async def open(self) -> None:
        """Create the tier layout and rebuild the index from disk."""
        found = await asyncio.to_thread(scan_tiers, self._roots, self._traverse_group)
        self._locks = found
        self._names = found.names
        self._entries = {model.key: _Entry(model, usage) for model, usage in found.published}
        self._leftovers = {leftover.key: leftover for leftover in found.leftovers}
        log.info(
            "store ready",
            extra={"models": len(self._entries), "resumable_pulls": len(self._leftovers)},
        )

    def close(self) -> None:
        """Let go of the tier roots (their locks): another agent may open them now."""
        if self._locks is not None:
            self._locks.release()
            self._locks = None

    def __del__(self) -> None:
        # A store dropped without close() (a caller that never serves: tests, tools)
        # must not keep its roots locked, nor a tmpfs it used busy, for the process's life.
        self.close()

    # -- queries ---------------------------------------------------------------------

    def roots(self) -> dict[TierName, Path]:
        """Each tier's root directory."""
        return dict(self._roots)

    def get(self, key: str) -> CachedModel | None:
        """The published snapshot ``key``, or None."""
        entry = self._entries.get(key)
        return entry.model if entry else None

    def usage(self, key: str) -> Usage | None:
        """A copy of snapshot ``key``'s use (last use, hits, pin), or None if it is not cached."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        return Usage(entry.usage.last_used, entry.usage.hit_count, entry.usage.pinned)

    def models(self) -> list[CachedModel]:
        """Every published snapshot, by URI then age."""
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
        key = key_prefix(ref)
        if key is None:
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
        """The tier's budget, reserve and filesystem figures, measured now."""
        budget = self._budgets[tier]
        return measure_limits(tier, self._roots[tier], budget.budget, budget.reserve)

    def attach_extra(self, tier: TierName, extra: ExtraUsage) -> None:
        """Count ``extra``'s bytes on ``tier`` too (see ExtraUsage)."""
        self._extra[tier] = extra

    def extra(self, tier: TierName) -> ExtraUsage | None:
        """What was attached to ``tier`` with ``attach_extra``, if anything."""
        return self._extra.get(tier)

    def used_bytes(self, tier: TierName) -> int:
        """Published bytes, bytes of pulls in progress and resumable leftovers, and extras."""
        extra = self._extra.get(tier)
        extra_bytes = extra.extra_bytes() if extra is not None else 0
        return self.published_bytes(tier) + self.staging_bytes(tier) + extra_bytes

    def published_bytes(self, tier: TierName) -> int:
        """Bytes of the tier's published snapshots."""
        return sum(e.model.total_bytes for e in self._entries.values() if e.model.tier == tier)

    def staging_bytes(self, tier: TierName) -> int:
        """Bytes reserved by pulls in progress and held by resumable leftovers on the tier."""
        in_flight = sum(size for t, size in self._in_flight.values() if t == tier)
        waiting = sum(lo.total_bytes for lo in self.resumable(tier))
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
        """The tier's figures for status and metrics."""
        limits = self.limits(tier)
        entries = [e for e in self._entries.values() if e.model.tier == tier]
        resumable = self.resumable(tier)
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
            resumable_count=len(resumable),
            resumable_bytes=sum(lo.kept_bytes for lo in resumable),
        )

    def resumable(self, tier: TierName) -> list[Leftover]:
        """The tier's staging directories that stopped pulls left to be resumed (none running)."""
        return [
            lo
            for lo in self._leftovers.values()
            if lo.tier == tier and lo.key not in self._in_flight
        ]

    # -- changes -----------------------------------------------------------------------

    async def record_use(self, key: str, *, hit: bool) -> None:
        """Note a use of ``key`` (``hit``: served from the cache); a failed save is only logged."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.usage.last_used = time.time()
        if hit:
            entry.usage.hit_count += 1
        await self._save_usage(entry)

    async def set_pinned(self, key: str, pinned: bool) -> CachedModel:
        """Pin or unpin snapshot ``key`` (saved durably); NotFound if it is not cached."""
        entry = self._entries.get(key)
        if entry is None:
            raise NotFound(f"Snapshot {key} is not cached. See `prewarm ls`.")
        entry.usage.pinned = pinned
        await self._save_usage(entry, strict=True)
        return entry.model

    async def _save_usage(self, entry: _Entry, *, strict: bool = False) -> None:
        root = self._roots[entry.model.tier]
        try:
            await asyncio.to_thread(write_usage, root, entry.model.key, entry.usage, durable=strict)
        except OSError as exc:
            if strict:  # a pin must stick; say so if it cannot be saved
                raise
            log.warning("could not record use of %s: %s", entry.model.key, exc)

    def leftover(self, key: str) -> Leftover | None:
        """A resumable staging directory for this snapshot, if a pull left one."""
        return self._leftovers.get(key)

    def staging_path(self, tier: TierName, key: str) -> Path:
        """Where a pull of ``key`` on ``tier`` stages its files."""
        return staging_dir(self._roots[tier], key)

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

    def end_staging(self, key: str, *, keep: bool, kept_bytes: int | None = None) -> list[Path]:
        """A pull ended. ``keep`` leaves its directory for a later pull to resume, holding
        ``kept_bytes`` complete (None: the pull never opened it; what it held before stays).

        Otherwise the directory is moved into ``trash/`` at once (it stops
        counting and cannot be resumed) and returned for ``purge``, so the
        event loop never waits on deleting a large tree.
        """
        in_flight = self._in_flight.pop(key, None)
        doomed: dict[Path, TierName] = {}
        if in_flight is not None:
            tier, total = in_flight
            staging = self.staging_path(tier, key)
            if keep and staging.exists():
                earlier = self._leftovers.get(key)
                if kept_bytes is None:
                    kept_bytes = earlier.kept_bytes if earlier is not None else 0
                self._leftovers[key] = Leftover(key, tier, staging, total, kept_bytes)
                return []
            doomed[staging] = tier
        leftover = self._leftovers.pop(key, None)
        if leftover is not None:
            doomed[leftover.path] = leftover.tier
        return [self._retire(tier, path) for path, tier in doomed.items()]

    def discard_leftover(self, key: str) -> list[Path]:
        """Forget a resumable pull; returns what to ``purge``."""
        leftover = self._leftovers.pop(key, None)
        in_flight = self._in_flight.get(key)
        if leftover is not None and (in_flight is None or in_flight[0] != leftover.tier):
            return [self._retire(leftover.tier, leftover.path)]
        return []

    def _retire(self, tier: TierName, path: Path) -> Path:
        # staging/ and trash/ share a filesystem: the rename is O(1) whatever the size.
        return retire(path, trash_dir(self._roots[tier]))

    async def purge(self, paths: Iterable[Path]) -> None:
        """Delete retired directories in a worker thread (start-up empties trash/ too)."""
        for path in paths:
            await asyncio.to_thread(remove_tree, path)

    def discard_leftovers_of(self, uri: str, keep: str) -> list[Path]:
        """Drop resumable pulls of other snapshots of a URI: they can never resume now."""
        doomed: list[Path] = []
        for leftover in list(self._leftovers.values()):
            header = read_header(leftover.path, journal_key(self._roots[leftover.tier]))
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
        path = snapshot_dir(root, model.key, self._names[model.tier])
        published = replace(model, path=path, created=time.time())
        await asyncio.to_thread(publish_files, staging / DATA_DIR, root, published)
        self._entries[model.key] = _Entry(model=published, usage=Usage(published.created))
        await self.record_use(model.key, hit=False)
        return published

    async def evict(self, key: str) -> CachedModel:
        """Remove a snapshot: hide it (manifest first), then unlink its files.

        Files are unlinked, never truncated (see ``layout.unpublish``), so a
        process that still maps them keeps valid pages until it unmaps.
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            raise NotFound(f"Snapshot {key} is not cached. See `prewarm ls`.")
        root = self._roots[entry.model.tier]
        await asyncio.to_thread(unpublish, root, entry.model)
        return entry.model
