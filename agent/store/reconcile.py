"""Rebuilding the store's index from the tier roots at start-up.

Journals and usage files are hints; a manifest and the files it names, at
their recorded sizes, regular files reached without following a link, are
what make a snapshot exist. A journal counts only with this agent's signature.
Whatever cannot be trusted or resumed is removed here, before the agent serves
anything; a root the agent does not own alone stops it (``agent.store.roots``).

A snapshot renamed into place whose manifest was never written (the agent
died in between) goes back to its staging directory when the signed journal
is still there, so the next pull re-hashes it and publishes without fetching.

A snapshot an older agent published under its key (``snapshots/<key>``, a name
anyone could work out, in a directory anyone could list) is moved under its
capability name (``agent.store.snapshot_names``) by one rename, and the root's
modes are set before anything is served (``agent.store.roots``).
Blocking: the store runs ``scan_tiers`` in a worker thread.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from agent._fs import open_beneath, open_dir, remove_tree
from agent._vocabulary import TierName
from agent.store.journal import DATA_DIR, journaled_bytes, read_header
from agent.store.layout import (
    LAYOUT,
    read_manifest,
    read_usage,
    return_to_staging,
    snapshots_dir,
    staging_dir,
    trash_dir,
)
from agent.store.records import CachedModel, Leftover, Usage
from agent.store.roots import journal_key, prepare_root
from agent.store.snapshot_names import SnapshotNames

__all__ = ["Found", "scan_tiers"]

log = logging.getLogger(__name__)

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


@dataclass(frozen=True, slots=True)
class Found:
    """What the tier roots hold: published snapshots with their use, resumable pulls, and
    how each root names its snapshots."""

    published: list[tuple[CachedModel, Usage]]
    leftovers: list[Leftover]
    names: dict[TierName, SnapshotNames]
    # A descriptor per root holding its exclusive lock, open while the agent serves.
    locks: list[int]

    def release(self) -> None:
        """Close the roots' descriptors, which lets another agent take them."""
        while self.locks:
            os.close(self.locks.pop())


def scan_tiers(roots: Mapping[TierName, Path], group: int | None = None) -> Found:
    """Create and check each root's layout, empty its trash, keep what is published or resumable.

    ``group`` is the traverse group (see ``prepare_root``). Raises
    UnsafeTierRoot when a root is not the agent's alone.
    """
    found = Found(published=[], leftovers=[], names={}, locks=[])
    try:
        for root in roots.values():
            # Every root, locked, before anything in one is touched.
            found.locks.append(prepare_root(root, LAYOUT, group))
        _scan(roots, found)
    except BaseException:
        found.release()
        raise
    return found


def _scan(roots: Mapping[TierName, Path], found: Found) -> None:
    for tier, root in roots.items():
        for doomed in trash_dir(root).iterdir():
            remove_tree(doomed)  # a link is unlinked, never followed
        secret = journal_key(root)
        names = SnapshotNames(secret)
        published = _scan_published(tier, root, secret, names)
        keys = {model.key for model, _ in published}
        found.leftovers.extend(_scan_staging(tier, root, keys, secret))
        found.published.extend(published)
        found.names[tier] = names


def _scan_published(
    tier: TierName, root: Path, secret: bytes, names: SnapshotNames
) -> list[tuple[CachedModel, Usage]]:
    published: list[tuple[CachedModel, Usage]] = []
    for manifest in (root / "manifests").glob("*.json"):
        try:
            model = read_manifest(manifest, tier=tier, root=root, names=names)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("dropping unreadable manifest %s: %s", manifest, exc)
            manifest.unlink(missing_ok=True)
            continue
        _rehome(model)
        if not _files_present(model):
            log.warning(
                "dropping snapshot %s: its files are missing, resized, or not the agent's alone",
                model.key,
            )
            manifest.unlink(missing_ok=True)
            continue
        published.append((model, read_usage(root, model.key, model.created)))
    keys = {model.key for model, _ in published}
    _sweep_unpublished(root, {model.path.name for model, _ in published}, secret, names)
    for usage in (root / "usage").glob("*.json"):
        if usage.stem not in keys:
            usage.unlink(missing_ok=True)
    return published


def _rehome(model: CachedModel) -> None:
    """Move a snapshot an older agent published under its key to its capability name.

    One rename, no byte copied. A directory that is not the agent's is left
    where it is: the snapshot is then missing, and dropped.
    """
    legacy = model.path.with_name(model.key)
    if os.path.lexists(model.path) or not _is_real_dir(legacy):
        return
    fd = open_dir(legacy)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return
        # The rename rewrites the directory's "..": it must be writable for a non-root agent.
        os.fchmod(fd, 0o755)
        legacy.rename(model.path)
        os.fchmod(fd, 0o555)
    finally:
        os.close(fd)
    log.info("moved snapshot %s from under its key to its unguessable name", model.key)


def _sweep_unpublished(
    root: Path, published: set[str], secret: bytes, names: SnapshotNames
) -> None:
    """Send a directory that never got its manifest back to staging, or remove it."""
    # Directory names are capabilities (or keys, from an older agent): map both to keys.
    staged = {p.name for p in (root / "staging").iterdir()}
    owners = {names.of(key): key for key in staged} | {key: key for key in staged}
    for directory in snapshots_dir(root).iterdir():
        if directory.name in published:
            continue
        key = owners.get(directory.name)
        if key is not None and _resumable(root, directory, key, secret):
            log.info("%s was renamed into place but never got its manifest: resuming it", directory)
            return_to_staging(directory, staging_dir(root, key) / DATA_DIR)
        else:
            log.warning("removing %s: no manifest, so it was never published", directory)
            remove_tree(directory)


def _resumable(root: Path, directory: Path, key: str, secret: bytes) -> bool:
    """A snapshot directory the agent's own journal for ``key`` is still waiting to publish."""
    staging = staging_dir(root, key)
    if directory.is_symlink() or not directory.is_dir() or not _is_real_dir(staging):
        return False
    header = read_header(staging, secret)
    return header is not None and header.key == key and not os.path.lexists(staging / DATA_DIR)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def _scan_staging(tier: TierName, root: Path, published: set[str], secret: bytes) -> list[Leftover]:
    """Keep staging directories a pull can resume; remove everything else."""
    leftovers: list[Leftover] = []
    for staging in (root / "staging").iterdir():
        header = read_header(staging, secret) if _is_real_dir(staging) else None
        if header is None or header.key != staging.name or staging.name in published:
            log.warning("removing %s: not a resumable pull", staging)
            remove_tree(staging)
            continue
        kept = journaled_bytes(staging, secret)
        leftovers.append(Leftover(header.key, tier, staging, header.total_bytes, kept))
    return leftovers


def _agents_alone(directory: int) -> bool:
    """Whether everything under ``directory`` is the agent's and writable by nobody else.

    A published snapshot that another uid owns or may write (or a file with a
    second hard link, writable wherever that link lives) could change under
    the pods that map it, so it is not served.
    """
    euid = os.geteuid()
    for _, _, files, fd in os.fwalk(".", dir_fd=directory, follow_symlinks=False):
        entries = [os.fstat(fd)]
        entries += [os.stat(name, dir_fd=fd, follow_symlinks=False) for name in files]
        for info in entries:
            if info.st_uid != euid or info.st_mode & _WRITABLE_BY_OTHERS:
                return False
            if not stat.S_ISDIR(info.st_mode) and info.st_nlink != 1:
                return False
    return True


def _files_present(model: CachedModel) -> bool:
    """Every file at its size, a regular file reached without following a link, the agent's
    alone (see ``_agents_alone``)."""
    try:
        directory = open_dir(model.path)
    except OSError:
        return False
    try:
        if not _agents_alone(directory):
            return False
        for cached in model.files:
            fd = open_beneath(directory, cached.path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                info = os.fstat(fd)
            finally:
                os.close(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != cached.size:
                return False
    except OSError:
        return False
    finally:
        os.close(directory)
    return True
