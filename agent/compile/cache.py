"""torch.compile caches: a directory per key on the disk tier, shared across nodes via S3.

Layout under ``<disk root>/compile/``::

    <key>/              the directory pods point their engine at (see engine_env)
    .meta/<key>.json    key parts, use and upload record; written before <key>/ appears
    .tmp/               restores and packs in progress (removed at start)
    .trash/             evicted directories on their way out

A directory appears whole: a restore extracts into ``.tmp/`` and renames into
place, so a pod never sees half an archive. Compile caches count towards the
disk tier's budget and are evicted after every evictable model (see
``extra_candidates``). Pods fill the directories; ``SettleWatcher`` reports a
key once it has been quiet, and the manager then uploads it when its content
differs from what this node last uploaded or restored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from agent._config import Settings
from agent._exceptions import Conflict, IntegrityError, InvalidRequest, NotFound, PrewarmError
from agent._uri import parse_uri
from agent.compile.archive import ChangedDuringPack, content_digest, pack, unpack, walk_artifacts
from agent.compile.keys import (
    KEY_LENGTH,
    CompileKeyParts,
    compile_key,
    engine_env,
    normalise_parts,
    parts_from_dict,
    parts_to_dict,
)
from agent.compile.lock import CompileLocks, LockEvent
from agent.compile.remote import ArchiveGone, Pointer, RemoteCompileCaches
from agent.compile.watch import SettleWatcher
from agent.obs.metrics import COMPILE_CACHE_PHASE_SECONDS
from agent.source.s3 import S3Source
from agent.store.budget import Candidate
from agent.store.store import Store

__all__ = ["CompileCacheInfo", "CompileCaches", "EnsuredCompileCache", "PushOutcome"]

log = logging.getLogger(__name__)

META_FORMAT = 1
_MIN_KEY_PREFIX = 8
_HEX = frozenset("0123456789abcdef")
_RESTORE_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class CompileCacheInfo:
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


@dataclass(frozen=True, slots=True)
class EnsuredCompileCache:
    info: CompileCacheInfo
    env: dict[str, str]
    restored: bool
    restore_seconds: float
    restore_note: str


@dataclass(frozen=True, slots=True)
class PushOutcome:
    uploaded: bool
    uri: str
    digest: str
    bytes: int
    skipped_reason: str


@dataclass(slots=True)
class _Record:
    parts: CompileKeyParts
    created: float
    last_used: float
    uploaded_digest: str = ""
    uploaded: float = 0.0
    restored: bool = False
    bytes: int = 0
    file_count: int = 0


class CompileCaches:
    """Every compile cache on the node; an async context manager that owns its watcher."""

    def __init__(self, settings: Settings, store: Store, source: S3Source) -> None:
        self._settings = settings.compile_cache
        self._root = settings.tiers.disk_root / "compile"
        self._store = store
        uri = self._settings.uri
        self._remote = RemoteCompileCaches(source, parse_uri(uri)) if uri else None
        self._records: dict[str, _Record] = {}
        # One operation per key at a time: restore, upload, evict.
        self._key_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.locks = CompileLocks()
        self._watcher = SettleWatcher(self._root, self._settings.quiet_seconds, self._settled)

    # -- lifetime ----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._records = await asyncio.to_thread(_scan, self._root)
        self._store.attach_extra("disk", self)
        await self._watcher.__aenter__()
        # Whatever pods wrote while the agent was down is checked once.
        for key in self._records:
            self._watcher.touch(key)
        log.info(
            "compile caches ready",
            extra={"compile_caches": len(self._records), "remote": self._settings.uri or ""},
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.locks.close()
        await self._watcher.__aexit__(exc_type, exc, tb)

    # -- queries -------------------------------------------------------------------------------

    def statistics(self) -> tuple[int, int]:
        """(number of compile caches, their bytes as last measured)."""
        return len(self._records), sum(r.bytes for r in self._records.values())

    async def caches(self) -> list[CompileCacheInfo]:
        """Every compile cache, with sizes measured now."""
        for key, record in list(self._records.items()):
            record.bytes, record.file_count = await asyncio.to_thread(_measure, self._root / key)
        return sorted((self._info(k, r) for k, r in self._records.items()), key=_by_use)

    def find(self, ref: str) -> str:
        """The key a full key or a unique prefix (8+ hex digits) names."""
        prefix = ref.strip().lower()
        if not (_MIN_KEY_PREFIX <= len(prefix) <= KEY_LENGTH) or not set(prefix) <= _HEX:
            raise InvalidRequest(
                f"{ref!r} is not a compile-cache key (8 to {KEY_LENGTH} hex digits). "
                "Copy one from `prewarm compile ls`."
            )
        matches = [key for key in self._records if key.startswith(prefix)]
        if not matches:
            raise NotFound(
                f"No compile cache has a key starting with {prefix}. See `prewarm compile ls`."
            )
        if len(matches) > 1:
            raise InvalidRequest(
                f"Key prefix {prefix} matches {len(matches)} compile caches; give more digits."
            )
        return matches[0]

    # -- the pod's request -----------------------------------------------------------------------

    async def ensure(
        self, parts: CompileKeyParts, *, skip_restore: bool = False, client_name: str = ""
    ) -> EnsuredCompileCache:
        """The directory for ``parts``: as it is, restored from S3, or new and empty."""
        canonical = normalise_parts(parts)
        key = compile_key(canonical)
        directory = self._root / key
        # A key on the node is answered without its lock: an upload of it may
        # hold the lock for a while, and the pod has no reason to wait for that.
        record = self._records.get(key)
        if record is not None and directory.is_dir():
            return await self._hit(key, record)
        async with self._key_locks[key]:
            record = self._records.get(key)
            if record is not None and directory.is_dir():
                return await self._hit(key, record)
            if skip_restore:
                restored, seconds, note = None, 0.0, "restore skipped on request"
            elif self._remote is None:
                restored, seconds, note = None, 0.0, "compile_cache.uri is not set: local only"
            else:
                restored, seconds, note = await self._restore(key)
            record = await self._publish(key, canonical, restored)
        log.info(
            "compile cache %s for %s: %s",
            key,
            client_name or "anonymous",
            f"restored in {seconds:.2f} s" if restored else f"new ({note})",
            extra={"key": key, "client": client_name, "restored": restored is not None},
        )
        return self._ensured(key, record, restored=restored is not None, seconds=seconds, note=note)

    async def _hit(self, key: str, record: _Record) -> EnsuredCompileCache:
        record.last_used = time.time()
        await self._save(key, record, strict=False)
        return self._ensured(key, record, restored=False, seconds=0.0, note="")

    async def pull(self, ref: str) -> EnsuredCompileCache:
        """Restore a key from S3 now, replacing the local directory; errors are raised."""
        key = self._key_or_full(ref)
        if self._remote is None:
            raise Conflict("compile_cache.uri is not set; there is nothing to pull from.")
        async with self._key_locks[key]:
            if self.locks.in_use(key):
                raise Conflict(
                    f"Compile cache {key} is in use (a pod holds its compile lock); pull it "
                    "after the pod lets go."
                )
            started = time.monotonic()
            fetched = await self._fetch(key)
            if fetched is None:
                raise NotFound(
                    f"Nothing was uploaded for compile cache {key} at {self._remote.uri_of(key)}."
                )
            pointer, staging = fetched
            try:
                parts = self._records[key].parts if key in self._records else _parts_of(pointer)
            except IntegrityError:
                await asyncio.to_thread(_remove_tree, staging)
                raise
            if key in self._records:
                await asyncio.to_thread(_remove, self._root, key)
                self._records.pop(key, None)
            seconds = time.monotonic() - started
            COMPILE_CACHE_PHASE_SECONDS.labels("restore").observe(seconds)
            record = await self._publish(key, parts, (pointer, staging))
        return self._ensured(key, record, restored=True, seconds=seconds, note="")

    async def push(self, ref: str) -> PushOutcome:
        """Pack and upload a key now (skipped when S3 already has the same content)."""
        key = self.find(ref)
        if self._remote is None:
            return PushOutcome(False, "", "", 0, "compile_cache.uri is not set")
        async with self._key_locks[key]:
            return await self._upload(key)

    async def evict(self, ref: str) -> list[CompileCacheInfo]:
        key = self.find(ref)
        if self.locks.in_use(key):
            raise Conflict(
                f"Compile cache {key} is in use: {self.locks.holder(key) or 'a pod'} holds its "
                "compile lock. Evict it after the pod lets go."
            )
        async with self._key_locks[key]:
            record = self._records.get(key)
            if record is None:
                raise NotFound(f"Compile cache {key} is not on this node.")
            record.bytes, record.file_count = await asyncio.to_thread(_measure, self._root / key)
            info = self._info(key, record)
            await self._drop(key, "manual")
        return [info]

    def hold_lock(
        self, parts: CompileKeyParts, client_name: str
    ) -> AsyncGenerator[LockEvent, None]:
        """The node's compile lock for ``parts``' key (see CompileLocks.hold)."""
        key = compile_key(parts)
        directory = self._root / key
        return self.locks.hold(key, client_name or "anonymous", lambda: _has_artifacts(directory))

    # -- the store's extra usage (counted in the disk budget, evicted last) ------------------------

    def extra_bytes(self) -> int:
        return self.statistics()[1]

    def extra_candidates(self) -> list[Candidate]:
        busy = self.locks.busy_keys()
        return [
            Candidate(
                key=key,
                size=record.bytes,
                last_used=record.last_used,
                protected=key in busy or self._key_locks[key].locked(),
            )
            for key, record in self._records.items()
        ]

    async def evict_extra(self, keys: Sequence[str], reason: str) -> int:
        freed = 0
        for key in keys:
            record = self._records.get(key)
            if record is None or self.locks.in_use(key) or self._key_locks[key].locked():
                continue
            async with self._key_locks[key]:
                freed += record.bytes
                await self._drop(key, reason)
        return freed

    # -- internals -------------------------------------------------------------------------------

    def _key_or_full(self, ref: str) -> str:
        try:
            return self.find(ref)
        except NotFound:
            key = ref.strip().lower()
            if len(key) == KEY_LENGTH and set(key) <= _HEX:
                return key  # not on this node yet; pull may bring it
            raise

    def _info(self, key: str, record: _Record) -> CompileCacheInfo:
        return CompileCacheInfo(
            key=key,
            path=self._root / key,
            parts=record.parts,
            bytes=record.bytes,
            file_count=record.file_count,
            created=record.created,
            last_used=record.last_used,
            uploaded_digest=record.uploaded_digest,
            uploaded=record.uploaded,
            restored=record.restored,
        )

    def _ensured(
        self, key: str, record: _Record, *, restored: bool, seconds: float, note: str
    ) -> EnsuredCompileCache:
        env = engine_env(record.parts.engine, self._root / key, key)
        return EnsuredCompileCache(self._info(key, record), env, restored, seconds, note)

    async def _restore(self, key: str) -> tuple[tuple[Pointer, Path] | None, float, str]:
        """Fetch a key for a pod: any failure becomes a note and an empty directory."""
        assert self._remote is not None
        started = time.monotonic()
        timeout = self._settings.restore_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                fetched = await self._fetch(key)
        except IntegrityError as exc:
            log.warning("refused the compile-cache archive of %s: %s", key, exc, extra={"key": key})
            return None, 0.0, f"refused the archive in S3: {exc}"
        except TimeoutError:
            return None, 0.0, f"restore from S3 took longer than {timeout:g} s; starting cold"
        except PrewarmError as exc:
            log.warning("could not restore compile cache %s: %s", key, exc, extra={"key": key})
            return None, 0.0, f"could not restore from S3: {exc}"
        if fetched is None:
            return None, 0.0, f"nothing uploaded yet at {self._remote.uri_of(key)}"
        seconds = time.monotonic() - started
        COMPILE_CACHE_PHASE_SECONDS.labels("restore").observe(seconds)
        return fetched, seconds, ""

    async def _fetch(self, key: str) -> tuple[Pointer, Path] | None:
        """Download and unpack ``key``'s current archive into a staging directory."""
        assert self._remote is not None
        temp = self._root / ".tmp"
        for _ in range(_RESTORE_ATTEMPTS):
            pointer = await self._remote.read_pointer(key)
            if pointer is None:
                return None
            token = secrets.token_hex(4)
            staging = temp / f"{key}.{token}"
            archive = temp / f"{key}.{token}.tar.zst"
            try:
                await self._remote.download(pointer, archive)
                await asyncio.to_thread(staging.mkdir)
                await asyncio.to_thread(
                    unpack,
                    archive,
                    staging,
                    expected_digest=pointer.digest,
                    max_bytes=self._room(),
                )
            except ArchiveGone:
                await asyncio.to_thread(_remove_tree, staging)
                continue  # superseded while we read the pointer: read it again
            except BaseException:
                await asyncio.shield(asyncio.to_thread(_remove_tree, staging))
                raise
            finally:
                await asyncio.shield(asyncio.to_thread(archive.unlink, missing_ok=True))
            return pointer, staging
        raise Conflict(
            f"The compile-cache archive of {key} kept being replaced while it was read; "
            "another node is uploading it. Try again."
        )

    async def _publish(
        self, key: str, parts: CompileKeyParts, restored: tuple[Pointer, Path] | None
    ) -> _Record:
        """Record the key, then move its directory (restored or new) into place."""
        now = time.time()
        record = _Record(parts=parts, created=now, last_used=now)
        if restored is not None:
            pointer, staging = restored
            record.uploaded_digest, record.uploaded, record.restored = (
                pointer.digest,
                pointer.uploaded,
                True,
            )
        else:
            staging = self._root / ".tmp" / f"{key}.{secrets.token_hex(4)}"
        try:
            await self._save(key, record, strict=True)
            await asyncio.to_thread(_place, staging, self._root / key, parts.engine)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(_remove_tree, staging))
            raise
        record.bytes, record.file_count = await asyncio.to_thread(_measure, self._root / key)
        self._records[key] = record
        return record

    async def _settled(self, key: str) -> None:
        """The watcher's report: ``key`` changed and has been quiet since."""
        if key not in self._records:
            return
        async with self._key_locks[key]:
            record = self._records.get(key)
            directory = self._root / key
            if record is None or not directory.is_dir():
                return
            record.bytes, record.file_count = await asyncio.to_thread(_measure, directory)
            if await asyncio.to_thread(_has_artifacts, directory):
                released = self.locks.release_waiters(key)
                if released:
                    log.info("compile cache %s is warm: let %d waiting pod(s) go", key, released)
            if self._remote is None or not self._settings.upload:
                return
            try:
                outcome = await self._upload(key)
            except PrewarmError as exc:
                log.warning(
                    "upload of compile cache %s failed (%s); it is retried after the next "
                    "change, or with `prewarm compile push`",
                    key,
                    exc,
                    extra={"key": key},
                )
                return
        if outcome.uploaded:
            log.info("uploaded compile cache %s to %s", key, outcome.uri, extra={"key": key})
        else:
            log.debug("compile cache %s not uploaded: %s", key, outcome.skipped_reason)

    async def _upload(self, key: str) -> PushOutcome:
        """Pack and upload ``key`` unless S3 (as far as we know) has the same content."""
        assert self._remote is not None
        record = self._records[key]
        directory = self._root / key
        uri = self._remote.uri_of(key)
        try:
            current = await asyncio.to_thread(content_digest, directory)
        except ChangedDuringPack as exc:
            return PushOutcome(False, uri, "", 0, f"still being written ({exc})")
        if current.file_count == 0:
            return PushOutcome(False, uri, current.digest, 0, "no artifacts yet")
        if current.digest == record.uploaded_digest:
            return PushOutcome(
                False, uri, current.digest, 0, "unchanged since the last upload or restore"
            )
        started = time.monotonic()
        archive = self._root / ".tmp" / f"{key}.{secrets.token_hex(4)}.tar.zst"
        try:
            try:
                packed = await asyncio.to_thread(pack, directory, archive)
            except ChangedDuringPack as exc:
                return PushOutcome(False, uri, "", 0, f"still being written ({exc})")
            outcome = await self._remote.upload(key, archive, packed, parts_to_dict(record.parts))
        finally:
            await asyncio.shield(asyncio.to_thread(archive.unlink, missing_ok=True))
        record.uploaded_digest, record.uploaded = packed.digest, time.time()
        await self._save(key, record, strict=False)
        if outcome.uploaded:
            COMPILE_CACHE_PHASE_SECONDS.labels("upload").observe(time.monotonic() - started)
        return PushOutcome(
            outcome.uploaded,
            outcome.uri,
            packed.digest,
            packed.archive_bytes if outcome.uploaded else 0,
            outcome.reason,
        )

    async def _drop(self, key: str, reason: str) -> None:
        self._records.pop(key, None)
        await asyncio.to_thread(_remove, self._root, key)
        log.info("evicted compile cache %s: %s", key, reason, extra={"key": key})

    async def _save(self, key: str, record: _Record, *, strict: bool) -> None:
        try:
            await asyncio.to_thread(_write_meta, self._root, key, record)
        except OSError as exc:
            if strict:
                raise
            log.warning("could not record use of compile cache %s: %s", key, exc)

    def _room(self) -> int:
        limits = self._store.limits("disk")
        return max(0, limits.fs_free_bytes - limits.reserve_bytes)


# -- file work (worker threads) -------------------------------------------------------------------


def _by_use(info: CompileCacheInfo) -> tuple[float, str]:
    return (-info.last_used, info.key)


def _parts_of(pointer: Pointer) -> CompileKeyParts:
    try:
        parts = normalise_parts(parts_from_dict(pointer.parts))
        if compile_key(parts) != pointer.key:
            raise InvalidRequest("they hash to another key")
    except (InvalidRequest, TypeError) as exc:
        raise IntegrityError(
            f"The compile-cache pointer of {pointer.key} holds unusable key parts ({exc}).",
            path="pointer.json",
            check="pointer",
        ) from exc
    return parts


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _has_artifacts(directory: Path) -> bool:
    return directory.is_dir() and next(walk_artifacts(directory), None) is not None


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


def _place(staging: Path, final: Path, engine: str) -> None:
    staging.mkdir(parents=True, exist_ok=True)
    # The engines create these themselves; creating them here lets a pod that
    # mounts the directory read-only for a sub-process still find them.
    subdirs = {"torch": ("inductor", "triton"), "sglang": ("inductor", "triton", "sglang")}
    for sub in subdirs.get(engine, ("inductor", "triton", "vllm")):
        (staging / sub).mkdir(exist_ok=True)
    if final.exists():  # left behind without a record; never handed out, safe to replace
        _remove_tree(final)
    staging.rename(final)


def _remove(root: Path, key: str) -> None:
    (root / ".meta" / f"{key}.json").unlink(missing_ok=True)
    doomed = root / ".trash" / f"{key}.{secrets.token_hex(4)}"
    try:
        (root / key).rename(doomed)
    except FileNotFoundError:
        return
    _remove_tree(doomed)


def _write_meta(root: Path, key: str, record: _Record) -> None:
    document: dict[str, Any] = {
        "format": META_FORMAT,
        "key": key,
        "parts": parts_to_dict(record.parts),
        "created": record.created,
        "last_used": record.last_used,
        "uploaded_digest": record.uploaded_digest,
        "uploaded": record.uploaded,
        "restored": record.restored,
    }
    path = root / ".meta" / f"{key}.json"
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(json.dumps(document, separators=(",", ":")))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_meta(path: Path) -> _Record:
    document = json.loads(path.read_text())
    if document.get("format") != META_FORMAT or document.get("key") != path.stem:
        raise ValueError(f"format {document.get('format')!r}, key {document.get('key')!r}")
    parts = normalise_parts(parts_from_dict(document["parts"]))
    if compile_key(parts) != path.stem:
        raise ValueError("its key parts hash to another key")
    return _Record(
        parts=parts,
        created=float(document["created"]),
        last_used=float(document["last_used"]),
        uploaded_digest=str(document.get("uploaded_digest", "")),
        uploaded=float(document.get("uploaded", 0.0)),
        restored=bool(document.get("restored", False)),
    )


def _scan(root: Path) -> dict[str, _Record]:
    """Rebuild the index: a key exists when both its record and its directory do."""
    for sub in (".meta", ".tmp", ".trash"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for leftover in [*(root / ".tmp").iterdir(), *(root / ".trash").iterdir()]:
        _remove_tree(leftover)
    records: dict[str, _Record] = {}
    for meta in (root / ".meta").glob("*.json"):
        key = meta.stem
        try:
            record = _read_meta(meta)
        except (OSError, ValueError, KeyError, TypeError, InvalidRequest) as exc:
            log.warning("dropping compile cache %s: unreadable record (%s)", key, exc)
            meta.unlink(missing_ok=True)
            continue
        if not (root / key).is_dir():
            meta.unlink(missing_ok=True)  # recorded, but its directory never appeared
            continue
        record.bytes, record.file_count = _measure(root / key)
        records[key] = record
    for directory in root.iterdir():
        if not directory.name.startswith(".") and directory.name not in records:
            log.warning("removing %s: a compile cache without a record", directory)
            _remove_tree(directory)
    return records
