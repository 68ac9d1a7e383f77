"""Rebuilding the store's index from the tier roots at start-up.

Journals and usage files are hints; a manifest and the files it names, at
their recorded sizes, regular files reached without following a link, are
what make a snapshot exist. A journal counts only with this agent's signature.
Whatever cannot be trusted or resumed is removed here, before the agent serves
anything; a root the agent does not own alone stops it (``agent.store.roots``).

A snapshot renamed into place whose manifest was never written (the agent
died in between) goes back to its staging directory when the signed journal
is still there, so the next pull re-hashes it and publishes without fetching.
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
from agent.store.journal import DATA_DIR, read_header
from agent.store.layout import (
    SUBDIRECTORIES,
    read_manifest,
    read_usage,
    return_to_staging,
    staging_dir,
    trash_dir,
)
from agent.store.records import CachedModel, Leftover, Usage
from agent.store.roots import journal_key, prepare_root

__all__ = ["Found", "scan_tiers"]

log = logging.getLogger(__name__)

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


@dataclass(frozen=True, slots=True)
class Found:
    """What the tier roots hold: published snapshots with their use, and resumable pulls."""

    published: list[tuple[CachedModel, Usage]]
    leftovers: list[Leftover]


def scan_tiers(roots: Mapping[TierName, Path]) -> Found:
    """Create and check each root's layout, empty its trash, keep what is published or resumable.

    Raises UnsafeTierRoot when a root is not the agent's alone.
    """
    found = Found(published=[], leftovers=[])
    for root in roots.values():
        prepare_root(root, SUBDIRECTORIES)  # every root, before anything in one is touched
    for tier, root in roots.items():
        for doomed in trash_dir(root).iterdir():
            remove_tree(doomed)  # a link is unlinked, never followed
        secret = journal_key(root)
        published = _scan_published(tier, root, secret)
        keys = {model.key for model, _ in published}
        found.leftovers.extend(_scan_staging(tier, root, keys, secret))
        found.published.extend(published)
    return found


def _scan_published(tier: TierName, root: Path, secret: bytes) -> list[tuple[CachedModel, Usage]]:
    published: list[tuple[CachedModel, Usage]] = []
    for manifest in (root / "manifests").glob("*.json"):
        try:
            model = read_manifest(manifest, tier=tier, root=root)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("dropping unreadable manifest %s: %s", manifest, exc)
            manifest.unlink(missing_ok=True)
            continue
        if not _files_present(model):
            log.warning(
                "dropping snapshot %s: its files are missing, resized, or not the agent's alone",
                model.key,
            )
            manifest.unlink(missing_ok=True)
            continue
        published.append((model, read_usage(root, model.key, model.created)))
    keys = {model.key for model, _ in published}
    for directory in (root / "snapshots").iterdir():
        if directory.name in keys:
            continue
        if _resumable(root, directory, secret):
            log.info("%s was renamed into place but never got its manifest: resuming it", directory)
            return_to_staging(root, directory.name, staging_dir(root, directory.name) / DATA_DIR)
        else:
            log.warning("removing %s: no manifest, so it was never published", directory)
            remove_tree(directory)
    for usage in (root / "usage").glob("*.json"):
        if usage.stem not in keys:
            usage.unlink(missing_ok=True)
    return published


def _resumable(root: Path, directory: Path, secret: bytes) -> bool:
    """A snapshot directory the agent's own journal is still waiting to publish."""
    staging = staging_dir(root, directory.name)
    if directory.is_symlink() or not directory.is_dir() or not _is_real_dir(staging):
        return False
    header = read_header(staging, secret)
    return (
        header is not None
        and header.key == directory.name
        and not os.path.lexists(staging / DATA_DIR)
    )


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
        leftovers.append(Leftover(header.key, tier, staging, header.total_bytes))
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
