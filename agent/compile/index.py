"""One compile domain's caches on this node's disk: one record and one directory per key.

Layout under ``<disk root>/compile/<domain>/`` (modes: see agent.compile.domains)::

    <key>/              the directory pods point their engine at (see engine_env)
    .meta/<key>.json    key parts, use and upload record; written before <key>/ appears
    .tmp/               restores and packs in progress (emptied at start)
    .trash/             evicted directories on their way out (emptied at start)

A key exists when both its record and its directory do; ``load`` drops either
half found alone, and a key directory that is not the agent's, of the domain's
group, mode 2770 (someone changed it). A directory appears whole: it is built
in ``.tmp/``, handed to the domain's group and renamed into place, so a pod
never sees half an archive.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent._config import ConfigError
from agent._exceptions import IntegrityError, InvalidRequest
from agent._fs import open_dir, remove_tree, retire, write_json_atomic
from agent.compile.archive import walk_artifacts
from agent.compile.domains import DOMAIN_DIR_MODE, KEY_DIR_MODE, PRIVATE_DIR_MODE
from agent.compile.keys import (
    CompileKeyParts,
    compile_key,
    normalise_parts,
    parts_from_dict,
    parts_to_dict,
    sub_cache_dirs,
)
from agent.compile.verdict import SubCacheSizes, Verdict, measure_sub_caches

__all__ = ["CacheIndex", "CacheRecord", "CompileCacheReport", "has_artifacts"]

log = logging.getLogger(__name__)

META_FORMAT = 1
_BOOKKEEPING = (".meta", ".tmp", ".trash")


@dataclass(frozen=True, slots=True)
class CompileCacheReport:
    """One key on the node, as listed: parts, path, size, use, upload record, last verdict."""

    key: str
    path: Path
    parts: CompileKeyParts
    bytes: int
    file_count: int
    created: float
    last_used: float
    # Content digest of the last upload or restore ("" if none) and when it happened.
    uploaded_digest: str
    uploaded: float
    restored: bool
    # The last launch's verdict (None before any launch reported ready).
    last_verdict: Verdict | None = None
    # Uploads wait for a launch to report ready (prewarm exec --ready-url/--ready-file).
    publish_on_ready: bool = False
    # The compile domain it belongs to (agent.compile.domains).
    domain: str = ""
    # The trusted key that signed what was last restored or uploaded ("": unsigned or none).
    signed_by: str = ""


@dataclass(slots=True)
class CacheRecord:
    """What ``.meta/<key>.json`` holds, plus the sizes last measured (not stored)."""

    parts: CompileKeyParts
    created: float
    last_used: float
    uploaded_digest: str = ""
    uploaded: float = 0.0
    restored: bool = False
    # What each sub-cache held at the restore, creation or last verdict.
    baseline: SubCacheSizes = field(default_factory=dict)
    last_verdict: Verdict | None = None
    publish_on_ready: bool = False
    # The trusted key that signed the manifest last restored or uploaded.
    signed_by: str = ""
    bytes: int = 0
    file_count: int = 0

    @classmethod
    def new(cls, parts: CompileKeyParts) -> CacheRecord:
        """The record of a key made now, empty."""
        now = time.time()
        return cls(parts=parts, created=now, last_used=now)


class CacheIndex:
    """The records of every key on the node, kept in step with the directories on disk.

    The caller serialises work on one key (the facade's per-key locks); the
    file work runs in worker threads.
    """

    def __init__(self, root: Path, gid: int | None = None) -> None:
        self.root = root
        # The group whose pods write this domain's keys (None: the agent's own).
        self.gid = os.getegid() if gid is None else gid
        self.temp = root / ".tmp"
        self._records: dict[str, CacheRecord] = {}

    async def load(self) -> None:
        """Rebuild the index from disk, clearing what an earlier run left half done."""
        self._records = await asyncio.to_thread(_scan, self.root, self.gid)

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[str]:
        """The keys, as they are now (the index may change while the caller awaits)."""
        return iter(list(self._records))

    def items(self) -> Iterator[tuple[str, CacheRecord]]:
        """Every (key, record), as a snapshot safe to iterate while the index changes."""
        return iter(list(self._records.items()))

    def get(self, key: str) -> CacheRecord | None:
        """The record of ``key``; None when the key is not on the node."""
        return self._records.get(key)

    def directory(self, key: str) -> Path:
        """The directory of ``key`` (which may not exist yet)."""
        return self.root / key

    def scratch(self, key: str, suffix: str = "") -> Path:
        """A fresh path in ``.tmp/`` for work on ``key`` that must not be seen half done."""
        return self.temp / f"{key}.{secrets.token_hex(4)}{suffix}"

    def total_bytes(self) -> int:
        """Bytes of every key of the domain, as last measured."""
        return sum(record.bytes for record in self._records.values())

    def info(self, key: str, record: CacheRecord) -> CompileCacheReport:
        """``key``'s record as the listing shows it."""
        return CompileCacheReport(
            key=key,
            path=self.directory(key),
            parts=record.parts,
            bytes=record.bytes,
            file_count=record.file_count,
            created=record.created,
            last_used=record.last_used,
            uploaded_digest=record.uploaded_digest,
            uploaded=record.uploaded,
            restored=record.restored,
            last_verdict=record.last_verdict,
            publish_on_ready=record.publish_on_ready,
            domain=self.root.name,
            signed_by=record.signed_by,
        )

    async def sub_caches(self, key: str) -> SubCacheSizes:
        """What each sub-cache of ``key`` holds now."""
        return await asyncio.to_thread(measure_sub_caches, self.directory(key), self.gid)

    async def measure(self, key: str, record: CacheRecord) -> None:
        """Set ``record``'s sizes to what ``key``'s directory holds now."""
        record.bytes, record.file_count = await asyncio.to_thread(_measure, self.directory(key))

    async def has_artifacts(self, key: str) -> bool:
        """Whether ``key``'s directory holds at least one artifact (off the event loop)."""
        return await asyncio.to_thread(has_artifacts, self.directory(key), self.gid)

    async def save(self, key: str, record: CacheRecord, *, strict: bool) -> None:
        """Write ``key``'s record; unless ``strict``, a failed write is only logged."""
        try:
            await asyncio.to_thread(_write_meta, self.root, key, record)
        except OSError as exc:
            if strict:
                raise
            log.warning("could not record use of compile cache %s: %s", key, exc)

    async def publish(self, key: str, record: CacheRecord, staging: Path) -> None:
        """Record the key, then move ``staging`` (restored or new) into place as its directory."""
        try:
            await self.save(key, record, strict=True)
            await asyncio.to_thread(
                _place, staging, self.directory(key), record.parts.engine, self.gid
            )
        except BaseException:
            await self.discard(staging)
            raise
        await self.measure(key, record)
        record.baseline = await self.sub_caches(key)
        await self.save(key, record, strict=False)
        self._records[key] = record

    async def checked_env(self, key: str, env: dict[str, str]) -> dict[str, str]:
        """``env`` once every directory it names is a real directory inside ``key``'s.

        A pod can write into its key directory, so a link (or a file) may sit
        where a sub-cache directory belongs; it is replaced by an empty
        directory and logged. Raises IntegrityError if a path still resolves
        outside the key directory.
        """
        return await asyncio.to_thread(_checked_env, self.directory(key), env, self.gid)

    async def remove(self, key: str) -> None:
        """Forget ``key`` and delete its record and directory."""
        self._records.pop(key, None)
        await asyncio.to_thread(_remove, self.root, key)

    async def discard(self, path: Path) -> None:
        """Delete a scratch path; finishes even if the caller is cancelled meanwhile."""
        await asyncio.shield(asyncio.to_thread(remove_tree, path))


def has_artifacts(directory: Path, group: int | None = None) -> bool:
    """Whether ``directory`` holds at least one artifact as packing counts them."""
    return directory.is_dir() and next(walk_artifacts(directory, group), None) is not None


# -- file work (worker threads) -------------------------------------------------------------------


def _measure(directory: Path) -> tuple[int, int]:
    """Bytes and files under ``directory`` (everything: this is what the disk holds)."""
    total = files = 0
    for base, _, names in os.walk(directory):
        for name in names:
            try:
                total += (Path(base) / name).lstat().st_size
                files += 1
            except FileNotFoundError:
                continue
    return total, files


def _place(staging: Path, final: Path, engine: str, gid: int) -> None:
    staging.mkdir(parents=True, exist_ok=True)
    # The engines create these themselves; creating them here lets a pod that
    # mounts the directory read-only for a sub-process still find them.
    for sub in sub_cache_dirs(engine):
        _make_real_directory(staging, sub, gid)
    _hand_to_group(staging, gid)
    if final.exists():  # left behind without a record; never handed out, safe to replace
        remove_tree(final)
    staging.rename(final)


def _hand_to_group(staging: Path, gid: int) -> None:
    """Give a tree built in ``.tmp/`` (restored files, fresh directories) to the domain's group.

    Only ever on a tree no pod can reach yet (``.tmp/`` is the agent's alone),
    so nothing here can have been swapped for a link; archives hold no links.
    Directories become 2770, so the domain's pods write into them and whatever
    they make there is the group's; files keep their mode (0644 or 0755).
    """
    for base, directories, files in os.walk(staging):
        for name in files:
            os.chown(Path(base) / name, -1, gid, follow_symlinks=False)
        for name in [*directories, ""]:
            path = Path(base) / name if name else Path(base)
            os.chown(path, -1, gid, follow_symlinks=False)
            if not path.is_symlink():  # never there; chmod would follow one
                path.chmod(KEY_DIR_MODE)


def _make_real_directory(base: Path, relative: str, gid: int) -> bool:
    """Make ``base/relative`` a directory, replacing links and files on the way; True if any.

    ``base`` may be a key directory pods write into: a directory made here is
    given to the group through a descriptor opened without following links.
    """
    replaced = False
    current = base
    for part in Path(relative).parts:
        current = current / part
        try:
            mode = current.lstat().st_mode
        except FileNotFoundError:
            _make_group_directory(current, gid)
            continue
        if stat.S_ISDIR(mode):
            continue
        # A link (dangling or not) or a file where a directory belongs: never follow it.
        current.unlink()
        _make_group_directory(current, gid)
        replaced = True
    return replaced


def _make_group_directory(path: Path, gid: int) -> None:
    path.mkdir()
    try:
        fd = open_dir(path)
    except OSError:
        return  # replaced by a pod meanwhile: the caller's checks see what is there now
    try:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, KEY_DIR_MODE)
    finally:
        os.close(fd)


def _checked_env(directory: Path, env: dict[str, str], gid: int) -> dict[str, str]:
    real_directory = os.path.realpath(directory)
    if directory.is_symlink():
        raise IntegrityError(
            f"Compile-cache directory {directory} is a link; the agent hands out no path through "
            "a link. Evict the key (`prewarm compile evict`) and ask again.",
            path=str(directory),
            check="link",
        )
    prefix = str(directory) + os.sep
    for name, value in env.items():
        if not value.startswith(prefix):
            continue  # not a path (a key tag, a size)
        if _make_real_directory(directory, value.removeprefix(prefix), gid):
            log.warning("replaced a link or file at %s (%s) with an empty directory", value, name)
        if not os.path.realpath(value).startswith(real_directory + os.sep):
            raise IntegrityError(
                f"{name}={value} resolves outside its compile-cache directory; refused. Evict "
                "the key (`prewarm compile evict`) and ask again.",
                path=value,
                check="link",
            )
    return env


def _remove(root: Path, key: str) -> None:
    (root / ".meta" / f"{key}.json").unlink(missing_ok=True)
    remove_tree(retire(root / key, root / ".trash"))


def _write_meta(root: Path, key: str, record: CacheRecord) -> None:
    document: dict[str, Any] = {
        "format": META_FORMAT,
        "key": key,
        "parts": parts_to_dict(record.parts),
        "created": record.created,
        "last_used": record.last_used,
        "uploaded_digest": record.uploaded_digest,
        "uploaded": record.uploaded,
        "restored": record.restored,
        "baseline": {sub: list(pair) for sub, pair in record.baseline.items()},
        "last_verdict": record.last_verdict.to_json() if record.last_verdict else None,
        "publish_on_ready": record.publish_on_ready,
        "signed_by": record.signed_by,
    }
    write_json_atomic(root / ".meta" / f"{key}.json", document)


def _read_meta(path: Path) -> CacheRecord:
    document = json.loads(path.read_text())
    if document.get("format") != META_FORMAT or document.get("key") != path.stem:
        raise ValueError(f"format {document.get('format')!r}, key {document.get('key')!r}")
    parts = normalise_parts(parts_from_dict(document["parts"]))
    if compile_key(parts) != path.stem:
        raise ValueError("its key parts hash to another key")
    return CacheRecord(
        parts=parts,
        created=float(document["created"]),
        last_used=float(document["last_used"]),
        uploaded_digest=str(document.get("uploaded_digest", "")),
        uploaded=float(document.get("uploaded", 0.0)),
        restored=bool(document.get("restored", False)),
        baseline={
            str(sub): (int(pair[0]), int(pair[1]))
            for sub, pair in dict(document.get("baseline") or {}).items()
        },
        last_verdict=(
            Verdict.from_json(document["last_verdict"]) if document.get("last_verdict") else None
        ),
        publish_on_ready=bool(document.get("publish_on_ready", False)),
        signed_by=str(document.get("signed_by", ""))[:64],
    )


def _scan(root: Path, gid: int) -> dict[str, CacheRecord]:
    _prepare_domain_directory(root, gid)
    for leftover in [*(root / ".tmp").iterdir(), *(root / ".trash").iterdir()]:
        remove_tree(leftover)
    records: dict[str, CacheRecord] = {}
    for meta in (root / ".meta").glob("*.json"):
        key = meta.stem
        try:
            record = _read_meta(meta)
        except (OSError, ValueError, KeyError, TypeError, InvalidRequest) as exc:
            log.warning("dropping compile cache %s: unreadable record (%s)", key, exc)
            meta.unlink(missing_ok=True)
            continue
        try:
            info: os.stat_result | None = (root / key).lstat()
        except FileNotFoundError:
            info = None
        if info is None:
            meta.unlink(missing_ok=True)  # recorded, but its directory never appeared
            continue
        if not _is_private_directory(info, gid, KEY_DIR_MODE):
            log.warning(
                "dropping compile cache %s: its directory is not the agent's of group %d, "
                "mode %04o, so someone outside the domain may have written it",
                key,
                gid,
                KEY_DIR_MODE,
            )
            meta.unlink(missing_ok=True)
            continue  # removed below with the other directories without a record
        record.bytes, record.file_count = _measure(root / key)
        records[key] = record
    for directory in root.iterdir():
        if not directory.name.startswith(".") and directory.name not in records:
            log.warning("removing %s: a compile cache without a record", directory)
            remove_tree(directory)
    return records


def _prepare_domain_directory(root: Path, gid: int) -> None:
    """Make the domain's directory and bookkeeping; start afresh if they are not as made.

    A domain directory of another group is one whose tenant's group was
    changed in the config: its key directories and files belong to the old
    group, and handing them over in place would mean walking a tree pods
    write into. Its caches are dropped instead (restored from S3 on demand).
    """
    try:
        info = root.lstat()
    except FileNotFoundError:
        info = None
    if info is not None and not _is_private_directory(info, gid, DOMAIN_DIR_MODE):
        log.warning(
            "removing compile domain %s: it is not the agent's directory of group %d, mode "
            "%04o (its group changed?); its caches are restored from S3 when asked for",
            root,
            gid,
            DOMAIN_DIR_MODE,
        )
        remove_tree(root)
    root.mkdir(mode=DOMAIN_DIR_MODE, exist_ok=True)
    try:
        os.chown(root, -1, gid, follow_symlinks=False)
    except PermissionError as exc:
        raise ConfigError(
            f"The agent (uid {os.geteuid()}) may not give compile domain {root.name!r} to its "
            f"group (gid {gid}): an agent that is not root must be a member of every tenant "
            "socket's group (systemd: SupplementaryGroups=), or run as root."
        ) from exc
    root.chmod(DOMAIN_DIR_MODE)
    for sub in _BOOKKEEPING:
        (root / sub).mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
        (root / sub).chmod(PRIVATE_DIR_MODE)


def _is_private_directory(info: os.stat_result, gid: int, mode: int) -> bool:
    """Whether ``info`` is a real directory of the agent's, of ``gid``, with exactly ``mode``."""
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.geteuid()
        and info.st_gid == gid
        and stat.S_IMODE(info.st_mode) == mode
    )
