"""Moving one compile cache between this node's disk and S3: restore and upload.

A restore downloads every archive the key's manifest names, unpacks each into
its own scratch directory in ``.tmp/`` (checked against its digest) and merges
them into one, the newest archive winning a path two hold; the caller
publishes that directory into the index. An upload hashes the key's
directory, packs the files the manifest does not list with that content, and
hands them to ``RemoteCompileCaches``, which adds them to the manifest. A file
whose bytes changed between the hash and the pack is still being written: the
upload stops and the watcher tries again once the directory is quiet. The
caller holds the key's lock around both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent._exceptions import (
    Conflict,
    IntegrityError,
    InvalidRequest,
    NoSpace,
    PrewarmError,
    quoted,
)
from agent._fs import remove_tree
from agent.compile.archive import (
    ChangedDuringPack,
    FileFacts,
    PackResult,
    content_digest,
    pack,
    unpack,
)
from agent.compile.index import CacheIndex, CacheRecord
from agent.compile.keys import (
    CompileKeyParts,
    compile_key,
    normalise_parts,
    parts_from_dict,
    parts_to_dict,
)
from agent.compile.manifest import Manifest
from agent.compile.model_index import KeysFound
from agent.compile.remote import ArchiveGone, RemoteCompileCaches
from agent.compile.signing import SignatureRefused
from agent.obs.metrics import COMPILE_CACHE_PHASE_SECONDS, COMPILE_SIGNATURES_REFUSED

__all__ = [
    "CompactOutcome",
    "CompileCacheTransfer",
    "Fetched",
    "PodRestore",
    "PushOutcome",
    "parts_of",
]

log = logging.getLogger(__name__)

_RESTORE_ATTEMPTS = 3
# A key whose manifest lists more archives than this is compacted into one after an
# upload: a restore makes one GET (and one unpack) per archive.
COMPACT_AFTER_ARCHIVES = 8
# Archives a compaction replaced are deleted this long after: far beyond any restore
# (compile_cache.restore_timeout_seconds, 120 s by default) that read the old manifest.
RETIRED_GRACE_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class PushOutcome:
    """What publishing a key came to: uploaded or skipped (and why), where, digest, bytes."""

    uploaded: bool
    uri: str
    digest: str
    bytes: int
    skipped_reason: str


@dataclass(frozen=True, slots=True)
class Fetched:
    """Every archive of a manifest unpacked into ``staging``, and the digest of the result."""

    manifest: Manifest
    staging: Path
    digest: str

    def record(self, parts: CompileKeyParts) -> CacheRecord:
        """A new record for the restored key: it holds what S3 holds."""
        record = CacheRecord.new(parts)
        record.uploaded_digest = self.digest
        record.uploaded = self.manifest.uploaded
        record.restored = True
        record.signed_by = self.manifest.signer
        return record


@dataclass(frozen=True, slots=True)
class CompactOutcome:
    """What a compaction came to: done or not (and why), archives before, retirees deleted."""

    compacted: bool
    archives_before: int
    retired_deleted: int
    skipped_reason: str
    uri: str = ""
    # Bytes of the one archive left (0 when nothing was compacted).
    archive_bytes: int = 0


@dataclass(frozen=True, slots=True)
class PodRestore:
    """What a pod's restore came to: an archive, or the reason it starts empty."""

    fetched: Fetched | None
    seconds: float
    note: str


class CompileCacheTransfer:
    """Restores and uploads keys of one index against one S3 prefix."""

    def __init__(
        self,
        remote: RemoteCompileCaches,
        index: CacheIndex,
        *,
        room: Callable[[], int],
        restore_timeout: float,
        min_upload_interval: float = 0.0,
    ) -> None:
        self._remote = remote
        self._index = index
        self._compact_after = COMPACT_AFTER_ARCHIVES
        self._retired_grace = RETIRED_GRACE_SECONDS
        self._min_upload_interval = min_upload_interval
        # When each key was last uploaded, and last compacted after an upload (monotonic).
        self._uploaded_at: dict[str, float] = {}
        self._compacted_at: dict[str, float] = {}
        # Bytes the disk can still take: an archive that unpacks to more is refused.
        self._room = room
        self._restore_timeout = restore_timeout

    def uri_of(self, key: str) -> str:
        """The S3 URI of ``key``'s prefix."""
        return self._remote.uri_of(key)

    async def keys_like(self, parts: CompileKeyParts) -> KeysFound:
        """The keys S3 holds of ``parts``' model and engine (agent.compile.model_index)."""
        return await self._remote.keys.keys_like(parts)

    async def restore_for_pod(self, key: str) -> PodRestore:
        """Fetch a key for a pod: any failure becomes a note and an empty directory."""
        started = time.monotonic()
        timeout = self._restore_timeout
        try:
            async with asyncio.timeout(timeout):
                fetched = await self.fetch(key)
        except SignatureRefused as exc:
            COMPILE_SIGNATURES_REFUSED.labels(self._remote.domain, exc.reason).inc()
            log.warning(
                "refused the compile cache %s in S3 (%s): %s",
                key,
                exc.reason,
                exc,
                extra={"key": key, "reason": exc.reason},
            )
            return PodRestore(None, 0.0, f"refused: {exc}")
        except IntegrityError as exc:
            log.warning("refused the compile-cache archive of %s: %s", key, exc, extra={"key": key})
            return PodRestore(None, 0.0, f"refused the archive in S3: {exc}")
        except TimeoutError:
            return PodRestore(
                None, 0.0, f"restore from S3 took longer than {timeout:g} s; starting cold"
            )
        except PrewarmError as exc:
            log.warning("could not restore compile cache %s: %s", key, exc, extra={"key": key})
            return PodRestore(None, 0.0, f"could not restore from S3: {exc}")
        if fetched is None:
            return PodRestore(None, 0.0, f"nothing uploaded yet at {self._remote.uri_of(key)}")
        seconds = time.monotonic() - started
        COMPILE_CACHE_PHASE_SECONDS.labels("restore").observe(seconds)
        return PodRestore(fetched, seconds, "")

    async def fetch(self, key: str) -> Fetched | None:
        """Download and merge ``key``'s archives; None when nothing was uploaded."""
        for _ in range(_RESTORE_ATTEMPTS):
            manifest = await self._remote.read_manifest(key)
            if manifest is None or not manifest.archives:
                return None
            self._check_room(manifest)
            staging = self._index.scratch(key)
            try:
                await asyncio.to_thread(staging.mkdir)
                # Newest first, each keeping the paths already there: the newest copy wins.
                for entry in reversed(manifest.archives):
                    await self._fetch_into(key, manifest, entry.name, staging)
                digest = (await asyncio.to_thread(content_digest, staging)).digest
            except ArchiveGone:
                await self._index.discard(staging)
                continue  # a legacy archive superseded while we read: read again
            except BaseException:
                await self._index.discard(staging)
                raise
            return Fetched(manifest, staging, digest)
        raise Conflict(
            f"The compile-cache archive of {key} kept being replaced while it was read; "
            "another node is uploading it. Try again."
        )

    async def _fetch_into(self, key: str, manifest: Manifest, name: str, staging: Path) -> None:
        """One archive of ``manifest``, checked in a scratch directory, merged into ``staging``."""
        entry = next(e for e in manifest.archives if e.name == name)
        part = self._index.scratch(key)
        archive = part.with_name(f"{part.name}.tar.zst")
        try:
            await self._remote.download(key, entry, archive)
            await asyncio.to_thread(part.mkdir)
            await _unpack_cancellable(archive, part, entry.digest, self._room())
            await asyncio.to_thread(_merge_into, part, staging)
        finally:
            await asyncio.shield(asyncio.to_thread(archive.unlink, missing_ok=True))
            await self._index.discard(part)

    def _check_room(self, manifest: Manifest) -> None:
        """Refuse, before any download, archives that with their content would not fit."""
        needed = manifest.archive_bytes + manifest.content_bytes
        room = self._room()
        if needed > room:
            raise NoSpace(
                f"The compile-cache archives of {manifest.key} need {needed} bytes on the disk "
                f"tier (archives and content); only {room} are free within its budget and "
                "reserve. Free space or raise tiers.disk budget; the pod starts cold meanwhile."
            )

    async def upload(self, key: str, record: CacheRecord) -> PushOutcome:
        """Pack and upload ``key`` unless S3 (as far as we know) has the same content."""
        directory = self._index.directory(key)
        group = self._index.gid
        uri = self._remote.uri_of(key)
        foreign: list[str] = []
        try:
            current = await asyncio.to_thread(content_digest, directory, group, foreign)
        except ChangedDuringPack as exc:
            return PushOutcome(False, uri, "", 0, f"still being written ({exc})")
        _warn_foreign(key, foreign)
        if skipped := self._skip_reason(key, current, record):
            return PushOutcome(False, uri, current.digest, 0, skipped)
        started = time.monotonic()
        archives: list[Path] = []
        local = frozenset(facts[0] for facts in current.files)

        async def pack_delta(wanted: tuple[FileFacts, ...]) -> tuple[Path, PackResult]:
            archive = self._index.scratch(key, ".tar.zst")
            archives.append(archive)
            others = local - {facts[0] for facts in wanted}
            packed = await asyncio.to_thread(pack, directory, archive, skip=others, group=group)
            _check_unchanged(wanted, packed)
            return archive, packed

        try:
            outcome = await self._remote.upload(
                key, current.files, pack_delta, parts_to_dict(record.parts)
            )
        except ChangedDuringPack as exc:
            return PushOutcome(False, uri, "", 0, f"still being written ({exc})")
        finally:
            for archive in archives:
                await asyncio.shield(asyncio.to_thread(archive.unlink, missing_ok=True))
        # Uploaded or found already there: either way S3 now holds this content.
        record.uploaded_digest, record.uploaded = current.digest, time.time()
        if outcome.manifest is not None:
            record.signed_by = self._remote.signer
        await self._index.save(key, record, strict=False)
        sent = outcome.manifest.archives[-1].archive_bytes if outcome.manifest else 0
        if outcome.uploaded:
            self._uploaded_at[key] = time.monotonic()
            COMPILE_CACHE_PHASE_SECONDS.labels("upload").observe(time.monotonic() - started)
        if outcome.manifest is not None:
            await self._index_key(key, record)
            await self._tidy(key, outcome.manifest)
        return PushOutcome(outcome.uploaded, outcome.uri, current.digest, sent, outcome.reason)

    def upload_wait(self, key: str) -> float:
        """Seconds before ``key`` may be uploaded again (0: now)."""
        last = self._uploaded_at.get(key)
        if last is None:
            return 0.0
        return max(0.0, last + self._min_upload_interval - time.monotonic())

    def _skip_reason(self, key: str, current: PackResult, record: CacheRecord) -> str:
        """Why ``key`` is not uploaded now ("" when it is): nothing to send, no key to sign
        with where signatures are required, S3 has this content already, or the key was
        uploaded too recently."""
        if current.file_count == 0:
            return "no artifacts yet"
        if refusal := self._remote.unsigned_refusal():
            return refusal
        if current.digest == record.uploaded_digest:
            return "unchanged since the last upload or restore"
        if wait := self.upload_wait(key):
            return (
                f"uploaded less than {self._min_upload_interval:g} s ago; a key is uploaded at "
                "most that often (compile_cache.min_upload_interval_seconds), and this one "
                f"goes up in {wait:.0f} s"
            )
        return ""

    async def _index_key(self, key: str, record: CacheRecord) -> None:
        """List the key under its model in S3, so other nodes' misses can name it.

        Only a hint for why-miss: a failure is logged and never fails the upload.
        """
        try:
            await self._remote.keys.add(key, record.parts)
        except PrewarmError as exc:
            log.warning(
                "compile cache %s: could not list it under its model in S3: %s",
                key,
                exc,
                extra={"key": key},
            )

    async def _tidy(self, key: str, manifest: Manifest) -> None:
        """After an upload: compact a key past ``compact_after`` archives (at most once per
        ``retired_grace``), delete old retirees.

        Neither is the upload's business to fail: a failure is logged, and the
        next upload of the key tries again.
        """
        last = self._compacted_at.get(key)
        # Once per key per retired grace at most: each compaction downloads every archive.
        due = last is None or time.monotonic() - last >= self._retired_grace
        try:
            if len(manifest.archives) > self._compact_after and due:
                self._compacted_at[key] = time.monotonic()
                await self.compact(key)
            elif manifest.retired_before(time.time() - self._retired_grace):
                await self._sweep_now(key)
        except PrewarmError as exc:
            log.warning("compaction of compile cache %s failed: %s", key, exc, extra={"key": key})

    async def compact(self, key: str) -> CompactOutcome:
        """Make the key's archives in S3 one archive of their union (as a restore merges them).

        The union is restored into scratch space here, packed, checked to hold
        exactly what the manifest says, and switched in with a conditional
        manifest write; archives retired more than ``retired_grace`` ago are
        deleted. Nothing a restoring node reads is deleted under it. A key
        with nothing to compact still has its due retirees deleted.
        """
        manifest = await self._remote.read_manifest(key)
        reason = _not_compactable(manifest)
        if manifest is None or reason:
            deleted = await self._sweep_now(key) if manifest is not None else 0
            count = len(manifest.archives) if manifest is not None else 0
            return CompactOutcome(False, count, deleted, reason, self.uri_of(key))
        fetched = await self.fetch(key)
        reason = _not_compactable(fetched.manifest if fetched else None)
        if fetched is None or reason:  # changed since it was read
            await self._discard(fetched)
            count = len(fetched.manifest.archives) if fetched else 0
            return CompactOutcome(False, count, 0, reason, self.uri_of(key))
        manifest, archive = fetched.manifest, self._index.scratch(key, ".tar.zst")
        try:
            packed = await asyncio.to_thread(pack, fetched.staging, archive)
            if packed.digest != manifest.digest:
                raise IntegrityError(
                    f"the union of {key}'s archives packs to {packed.digest}, its manifest "
                    f"says {manifest.digest}",
                    path="manifest.json",
                    check="digest",
                )
            switched = await self._remote.replace_archives(key, manifest, (archive, packed))
        finally:
            await asyncio.shield(asyncio.to_thread(archive.unlink, missing_ok=True))
            await self._discard(fetched)
        count = len(manifest.archives)
        if not switched:
            return CompactOutcome(
                False, count, 0, "another node changed the manifest meanwhile", self.uri_of(key)
            )
        deleted = await self._sweep_now(key)
        log.info(
            "compacted compile cache %s: %d archives -> 1 (%d bytes); deleted %d retired",
            key,
            count,
            packed.archive_bytes,
            deleted,
            extra={"key": key},
        )
        return CompactOutcome(True, count, deleted, "", self.uri_of(key), packed.archive_bytes)

    async def _sweep_now(self, key: str) -> int:
        """Delete the key's archives retired long enough ago, as the manifest says now."""
        manifest = await self._remote.read_manifest(key)
        if manifest is None:
            return 0
        return await self._remote.sweep(key, manifest, time.time() - self._retired_grace)

    async def _discard(self, fetched: Fetched | None) -> None:
        if fetched is not None:
            await self._index.discard(fetched.staging)


def _warn_foreign(key: str, foreign: list[str]) -> None:
    if foreign:
        log.warning(
            "compile cache %s: %d files not uploaded: they are not of the domain's group "
            "or have other hard links, so they came from outside the domain (first: %s)",
            key,
            len(foreign),
            quoted(foreign[0]),
            extra={"key": key},
        )


def _not_compactable(manifest: Manifest | None) -> str:
    """Why ``manifest``'s archives cannot become one ("" when they can)."""
    if manifest is None or not manifest.archives:
        return "nothing was uploaded for this key"
    if len(manifest.archives) == 1:
        return "it has one archive already"
    if not manifest.compactable:
        return (
            "an archive uploaded by an older agent lists no files, so the union cannot be "
            "checked; it stays as it is"
        )
    return ""


def _check_unchanged(wanted: tuple[FileFacts, ...], packed: PackResult) -> None:
    """Refuse a pack whose files differ from those hashed before (a file being written)."""
    differing = sorted(set(wanted).symmetric_difference(packed.files))
    if differing:
        raise ChangedDuringPack(
            f"{differing[0][0]} changed between hashing and packing; it is still being written."
        )


def _merge_into(part: Path, staging: Path) -> None:
    """Move ``part``'s files into ``staging``; a path already there (a newer archive's) stays."""
    for base, dirs, names in os.walk(part):
        target = staging / Path(base).relative_to(part)
        if not target.is_dir():
            if target.exists():  # a file of an earlier archive where this one has a folder
                dirs.clear()
                continue
            target.mkdir()
        for name in names:
            if not (target / name).exists():
                (Path(base) / name).rename(target / name)
    remove_tree(part)


async def _unpack_cancellable(archive: Path, dest: Path, digest: str, max_bytes: int) -> None:
    """Unpack in a worker thread that stops when the caller is cancelled (a timed-out restore).

    A thread cannot be killed: on cancellation the unpack is told to stop and
    awaited (it stops at its next block), so nothing keeps writing into
    ``.tmp/`` after the caller has moved on.
    """
    cancel = threading.Event()
    work = asyncio.ensure_future(
        asyncio.to_thread(
            unpack, archive, dest, expected_digest=digest, max_bytes=max_bytes, cancel=cancel
        )
    )
    try:
        await asyncio.shield(work)
    except asyncio.CancelledError:
        cancel.set()
        with contextlib.suppress(Exception):  # stopped: how it ended no longer matters
            await asyncio.shield(work)
        raise


def parts_of(manifest: Manifest) -> CompileKeyParts:
    """The key parts a manifest carries, refused unless they hash to its key."""
    try:
        parts = normalise_parts(parts_from_dict(manifest.parts))
        if compile_key(parts) != manifest.key:
            raise InvalidRequest("they hash to another key")
    except (InvalidRequest, TypeError) as exc:
        raise IntegrityError(
            f"The compile-cache manifest of {manifest.key} holds unusable key parts ({exc}).",
            path="manifest.json",
            check="pointer",
        ) from exc
    return parts
