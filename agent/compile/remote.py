"""Compile-cache archives in S3: content-addressed archives merged by one manifest per key.

Layout under ``compile_cache.uri`` (``s3://bucket/prefix``)::

    <prefix>/<key>/manifest.json                   every archive of the key (agent.compile.manifest)
    <prefix>/<key>/artifacts/<digest32>.tar.zst    immutable, named by the digest of its files
    <prefix>/<key>/pointer.json, archives/...      written by older agents; still read
    <prefix>/by-model/<model id>/<key>.json        the key's parts (agent.compile.model_index)

An upload never replaces what another node uploaded. The uploader reads the
manifest and its ETag, packs only the files the manifest does not list yet
with the same content (a path listed with other bytes, say a kernel caught
half-written by an earlier upload, is sent again and, being newer, wins the
restore), stores that archive under the digest of its files (the same files give the
same name, so a second upload of them changes nothing), and then adds it to
the manifest with a conditional PUT (``If-Match`` the ETag read, or
``If-None-Match: *`` when there was none). If another node changed the
manifest in between, S3 answers 412 (the source raises Conflict); the uploader
reads the manifest again and adds its archive to *that* one: two nodes that
compile the same key at once end with the union. Archives over
``multipart_threshold`` bytes (5 GiB, S3's single-PUT limit) go up in parts.
Everything goes through the source interface (agent.source.interface), so this
runs unchanged over the in-memory source.

The manifest (and each by-model entry) is stored sealed by the node's signing
key and opened only with a key the domain trusts (agent.compile.signing); it
records each archive's sha256 as stored, which ``download`` checks, so a
restoring node unpacks nothing a trusted key did not vouch for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent._exceptions import Conflict, IntegrityError, NotFound, SourceChanged
from agent._uri import ModelUri
from agent.compile.archive import DIGEST_PREFIX, FileFacts, PackResult
from agent.compile.manifest import (
    ArchiveEntry,
    Manifest,
    parse_legacy_pointer,
    parse_manifest,
)
from agent.compile.model_index import RemoteKeyIndex
from agent.compile.signing import UNCHECKED, Signing
from agent.source.interface import ObjectSource, ObjectTooLarge

__all__ = ["ArchiveGone", "DeltaPacker", "RemoteCompileCaches", "UploadOutcome", "archive_entry"]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LEGACY_POINTER_NAME = "pointer.json"
# A manifest lists every file (about 100 bytes each); far larger is not one.
MANIFEST_MAX_BYTES = 16 * 1024 * 1024
LEGACY_POINTER_MAX_BYTES = 1024 * 1024
MULTIPART_THRESHOLD = 5 * 1024**3
PART_SIZE = 128 * 1024**2
_MERGE_ATTEMPTS = 10
_READ_BLOCK = 1024 * 1024

# Packs exactly the files given (as hashed before the manifest was read) into an
# archive; raises ChangedDuringPack when the directory no longer holds them so.
DeltaPacker = Callable[[tuple[FileFacts, ...]], Awaitable[tuple[Path, PackResult]]]


class ArchiveGone(NotFound):
    """An archive the manifest named is gone (a legacy archive superseded); read it again."""


@dataclass(frozen=True, slots=True)
class UploadOutcome:
    """What an upload to S3 came to: sent or skipped (and why), where, the manifest it left."""

    uploaded: bool
    uri: str
    reason: str = ""
    # The manifest as this upload left it (None when S3 was not changed).
    manifest: Manifest | None = None


class RemoteCompileCaches:
    """Reads and merges packed compile caches under one prefix of the object store."""

    def __init__(
        self,
        source: ObjectSource,
        uri: ModelUri,
        *,
        multipart_threshold: int = MULTIPART_THRESHOLD,
        part_size: int = PART_SIZE,
        why_timeout: float = 5.0,
        signing: Signing = UNCHECKED,
    ) -> None:
        self._source = source
        self._uri = uri
        self._multipart_threshold = multipart_threshold
        self._part_size = part_size
        self._signing = signing
        # The keys of each model uploaded under this prefix, for why-miss.
        self.keys = RemoteKeyIndex(source, uri, timeout=why_timeout, signing=signing)

    @property
    def domain(self) -> str:
        """The compile domain whose prefix this is (as its signatures name it)."""
        return self._signing.domain

    @property
    def signer(self) -> str:
        """The name of the key this node signs with ("" when it does not sign)."""
        return self._signing.key.name if self._signing.key else ""

    def unsigned_refusal(self) -> str:
        """Why this node does not write to S3 ("" when it may): without a signing key its
        uploads would be unsigned, which nodes that require signatures never restore."""
        if self._signing.key is None and not self._signing.trust.accept_unsigned:
            return (
                "this node has no signing key (compile_cache.signing_key) and signatures are "
                "required, so no node would restore what it uploads"
            )
        return ""

    def uri_of(self, key: str) -> str:
        """The S3 URI of ``key``'s prefix."""
        return f"s3://{self._uri.bucket}/{self._object(key, '')}"

    def _object(self, key: str, name: str) -> str:
        return f"{self._uri.prefix}{key}/{name}"

    async def read_manifest(self, key: str) -> Manifest | None:
        """Every archive of ``key`` (a legacy pointer read as one); None when nothing was."""
        stored = await self._get(key, MANIFEST_NAME, MANIFEST_MAX_BYTES)
        if stored is not None:
            opened = self._signing.open(f"{key}/{MANIFEST_NAME}", stored[0])
            manifest = parse_manifest(key, opened.document, stored[1])
            return dataclasses.replace(manifest, signer=opened.signer)
        legacy = await self._get(key, LEGACY_POINTER_NAME, LEGACY_POINTER_MAX_BYTES)
        if legacy is None:
            return None
        # Older agents never signed: their pointer is restored only where unsigned is accepted.
        opened = self._signing.open(f"{key}/{LEGACY_POINTER_NAME}", legacy[0])
        return parse_legacy_pointer(key, opened.document)

    async def _get(self, key: str, name: str, cap: int) -> tuple[bytes, str] | None:
        try:
            stored = await self._source.get_object(
                self._uri.bucket, self._object(key, name), max_bytes=cap
            )
        except ObjectTooLarge as exc:
            raise IntegrityError(
                f"The compile-cache {name} of {key} is too large to read ({exc}). No upload "
                f"replaces it; delete s3://{self._uri.bucket}/{self._object(key, name)} "
                "to start the key afresh.",
                path=name,
                check="size",
            ) from exc
        return None if stored is None else (stored.data, stored.etag)

    async def download(self, key: str, entry: ArchiveEntry, dest: Path) -> None:
        """Write the archive ``entry`` names to ``dest``; refuse one of another size."""
        bucket, name = self._uri.bucket, self._object(key, entry.name)
        head = await self._source.head_object(bucket, name)
        if head is None:
            raise ArchiveGone(f"{name} is gone.")
        if head.size != entry.archive_bytes:
            raise IntegrityError(
                f"s3://{bucket}/{name} holds {head.size} bytes; its manifest says "
                f"{entry.archive_bytes}. It is truncated or was replaced; the next "
                "upload for this key replaces it.",
                path=name,
                check="size",
            )
        digest = hashlib.sha256()
        with dest.open("wb") as out:
            if head.size:
                try:
                    # Pinned to the ETag just read: an archive replaced meanwhile fails the read.
                    async with self._source.open_range(
                        bucket, name, etag=head.etag, start=0, length=head.size
                    ) as reader:
                        while chunk := await reader.read(_READ_BLOCK):
                            await asyncio.to_thread(_write_hashed, out, digest, chunk)
                except SourceChanged as exc:
                    raise ArchiveGone(f"{name} was replaced while it was read.") from exc
        if entry.archive_sha256 and digest.hexdigest() != entry.archive_sha256:
            raise IntegrityError(
                f"s3://{bucket}/{name} is not the archive its manifest lists (sha256 "
                f"{digest.hexdigest()[:16]}..., listed {entry.archive_sha256[:16]}...): it was "
                "replaced in S3 after it was uploaded. Nothing of it is unpacked.",
                path=name,
                check="digest",
            )

    async def upload(
        self,
        key: str,
        local: tuple[FileFacts, ...],
        pack_delta: DeltaPacker,
        parts: dict[str, Any],
    ) -> UploadOutcome:
        """Add the ``local`` files S3 lacks (by path and content) to ``key``'s manifest."""
        uri = self.uri_of(key)
        if refusal := self.unsigned_refusal():
            return UploadOutcome(False, uri, refusal)
        manifest = await self._manifest_for_update(key, parts)
        wanted = manifest.lacking(local)
        if not wanted:
            return UploadOutcome(False, uri, "S3 already has this content")
        archive, packed = await pack_delta(wanted)
        entry = archive_entry(packed, await asyncio.to_thread(_sha256_of, archive))
        await self._put_archive(key, entry.name, archive, packed.archive_bytes)
        for _ in range(_MERGE_ATTEMPTS):
            merged = manifest.with_archive(entry)
            if await self._switch_manifest(key, merged.to_bytes(), manifest.etag or None):
                return UploadOutcome(True, uri, manifest=merged)
            # Another node changed the manifest since we read it: merge into the new one.
            manifest = await self._manifest_for_update(key, parts)
            if manifest.covers(entry):
                return UploadOutcome(False, uri, "another node uploaded the same files")
        raise Conflict(
            f"The compile-cache manifest of {key} at {uri} kept changing under "
            f"{_MERGE_ATTEMPTS} attempts; other nodes are uploading it. Push again later."
        )

    async def replace_archives(
        self, key: str, manifest: Manifest, union: tuple[Path, PackResult]
    ) -> bool:
        """Make ``union`` (every archive of ``manifest`` as one) the key's only archive.

        The switch is conditional on the manifest's ETag, as an upload's is: if
        any node added an archive since ``manifest`` was read, nothing changes
        (False) and a later compaction tries again. The archives replaced stay
        in S3, listed as retired, for ``sweep`` to delete once no restore that
        read the old manifest can still be reading them.
        """
        if self.unsigned_refusal():
            return False
        archive, packed = union
        entry = archive_entry(packed, await asyncio.to_thread(_sha256_of, archive))
        await self._put_archive(key, entry.name, archive, packed.archive_bytes)
        compacted = manifest.compacted(entry, time.time())
        if await self._switch_manifest(key, compacted.to_bytes(), manifest.etag or None):
            return True
        # Lost to another writer: the union is listed nowhere (unless that writer's
        # manifest names the same content), and nothing else would ever delete it.
        current = await self.read_manifest(key)
        if current is None or not current.names(entry.name):
            await self._source.delete_object(self._uri.bucket, self._object(key, entry.name))
        return False

    async def sweep(self, key: str, manifest: Manifest, retired_before: float) -> int:
        """Delete the archives ``manifest`` retired before ``retired_before``; how many.

        Deleted first, then dropped from the manifest (conditionally): a manifest
        changed meanwhile keeps naming them, and the next sweep deletes nothing
        twice that matters (a missing object deletes cleanly).
        """
        due = manifest.retired_before(retired_before)
        if not due:
            return 0
        for name in due:
            await self._source.delete_object(self._uri.bucket, self._object(key, name))
        await self._switch_manifest(key, manifest.swept(due).to_bytes(), manifest.etag or None)
        return len(due)

    async def _manifest_for_update(self, key: str, parts: dict[str, Any]) -> Manifest:
        """The manifest to add to: as read, the legacy pointer's, or an empty one."""
        try:
            manifest = await self.read_manifest(key)
        except IntegrityError as exc:
            if exc.check == "size":
                # Not read whole: replacing it would drop every other node's files.
                raise
            log.warning("replacing the unreadable compile-cache manifest of %s: %s", key, exc)
            head = await self._source.head_object(
                self._uri.bucket, self._object(key, MANIFEST_NAME)
            )
            return Manifest(key, (), parts, head.etag if head is not None else "")
        if manifest is None:
            return Manifest(key, (), parts)
        return manifest

    async def _put_archive(self, key: str, name: str, archive: Path, size: int) -> None:
        bucket, target = self._uri.bucket, self._object(key, name)
        if size > self._multipart_threshold:
            await self._source.put_object_multipart(
                bucket,
                target,
                _file_parts(archive, self._part_size),
                content_type="application/zstd",
            )
            return
        body = await asyncio.to_thread(archive.read_bytes)
        # Named by its content: a Conflict means the same files are there already.
        with contextlib.suppress(Conflict):
            await self._source.put_object(
                bucket, target, body, content_type="application/zstd", if_absent=True
            )

    async def _switch_manifest(self, key: str, body: bytes, etag: str | None) -> bool:
        """Write the manifest only if it is still as read; False when another writer won."""
        try:
            await self._source.put_object(
                self._uri.bucket,
                self._object(key, MANIFEST_NAME),
                self._signing.seal(f"{key}/{MANIFEST_NAME}", body),
                content_type="application/json",
                if_match=etag,
                if_absent=not etag,
            )
        except Conflict:
            return False
        return True


def archive_entry(packed: PackResult, archive_sha256: str) -> ArchiveEntry:
    """The manifest entry of an archive packed now on this node, named by its files' digest;
    ``archive_sha256`` is the archive file's own."""
    return ArchiveEntry(
        name=f"artifacts/{packed.digest.removeprefix(DIGEST_PREFIX)[:32]}.tar.zst",
        digest=packed.digest,
        archive_bytes=packed.archive_bytes,
        content_bytes=packed.content_bytes,
        file_count=packed.file_count,
        uploaded=time.time(),
        uploader=socket.gethostname(),
        files=packed.files,
        archive_sha256=archive_sha256,
    )


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _write_hashed(out: Any, digest: Any, chunk: bytes) -> None:
    digest.update(chunk)
    out.write(chunk)


async def _file_parts(path: Path, part_size: int) -> AsyncIterator[bytes]:
    """``path`` in ``part_size`` pieces, each read in a worker thread."""
    with path.open("rb") as handle:
        while part := await asyncio.to_thread(handle.read, part_size):
            yield part
