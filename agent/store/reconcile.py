"""Rebuilding the store's index from the tier roots at start-up.

Journals and usage files are hints; a manifest and the files it names, at
their recorded sizes, are what make a snapshot exist. Whatever cannot be
trusted or resumed is removed here, before the agent serves anything.
Blocking: the store runs ``scan_tiers`` in a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agent._fs import remove_tree
from agent._vocabulary import TierName
from agent.store.journal import read_header
from agent.store.layout import SUBDIRECTORIES, read_manifest, read_usage, trash_dir
from agent.store.records import CachedModel, Leftover, Usage

__all__ = ["Found", "scan_tiers"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Found:
    """What the tier roots hold: published snapshots with their use, and resumable pulls."""

    published: list[tuple[CachedModel, Usage]]
    leftovers: list[Leftover]


def scan_tiers(roots: Mapping[TierName, Path]) -> Found:
    """Create each root's layout, empty its trash, and keep what is published or resumable."""
    found = Found(published=[], leftovers=[])
    for tier, root in roots.items():
        for sub in SUBDIRECTORIES:
            (root / sub).mkdir(parents=True, exist_ok=True)
        for doomed in trash_dir(root).iterdir():
            remove_tree(doomed)
        published = _scan_published(tier, root)
        keys = {model.key for model, _ in published}
        found.leftovers.extend(_scan_staging(tier, root, keys))
        found.published.extend(published)
    return found


def _scan_published(tier: TierName, root: Path) -> list[tuple[CachedModel, Usage]]:
    published: list[tuple[CachedModel, Usage]] = []
    for manifest in (root / "manifests").glob("*.json"):
        try:
            model = read_manifest(manifest, tier=tier, root=root)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("dropping unreadable manifest %s: %s", manifest, exc)
            manifest.unlink(missing_ok=True)
            continue
        if not _files_present(model):
            log.warning("dropping snapshot %s: its files are missing or resized", model.key)
            manifest.unlink(missing_ok=True)
            continue
        published.append((model, read_usage(root, model.key, model.created)))
    keys = {model.key for model, _ in published}
    for directory in (root / "snapshots").iterdir():
        if directory.name not in keys:
            log.warning("removing %s: no manifest, so it was never published", directory)
            remove_tree(directory)
    for usage in (root / "usage").glob("*.json"):
        if usage.stem not in keys:
            usage.unlink(missing_ok=True)
    return published


def _scan_staging(tier: TierName, root: Path, published: set[str]) -> list[Leftover]:
    """Keep staging directories a pull can resume; remove everything else."""
    leftovers: list[Leftover] = []
    for staging in (root / "staging").iterdir():
        header = read_header(staging) if staging.is_dir() else None
        if header is None or header.key != staging.name or staging.name in published:
            log.warning("removing %s: not a resumable pull", staging)
            remove_tree(staging)
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
