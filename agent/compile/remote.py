"""Compile-cache archives in S3: where they live, and how nodes switch to a new one.

Layout under ``compile_cache.uri`` (``s3://bucket/prefix``)::

    <prefix>/<key>/pointer.json                          which archive is current
    <prefix>/<key>/archives/<digest16>-<ms>-<rand>.tar.zst   immutable, one per upload

An upload never overwrites an object that anyone reads: the archive goes to a
name no other node can pick, and only then is the small pointer switched to
it, with a conditional PUT (``If-Match`` the pointer's ETag as read before, or
``If-None-Match: *`` when there was none). If another node switched the
pointer in between, S3 answers 412 (the source raises Conflict); the uploader
reads the pointer again and stops if it names the same content, else switches
again (the last writer wins, and every reader sees either the old archive or
the new one, never a mix). Everything goes through the source interface
(agent.source.interface), so this runs unchanged over the in-memory source.
The archive the pointer named before is deleted after the switch; a restore
that finds its archive gone reads the pointer again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent._exceptions import Conflict, IntegrityError, NotFound, SourceChanged
from agent._uri import ModelUri
from agent.compile.archive import DIGEST_PREFIX, PackResult
from agent.source.interface import ObjectSource, ObjectTooLarge

__all__ = ["ArchiveGone", "Pointer", "RemoteCompileCaches", "UploadOutcome"]

log = logging.getLogger(__name__)

POINTER_FORMAT = 1
POINTER_NAME = "pointer.json"
# A pointer is a few hundred bytes of JSON; anything far larger is not one.
POINTER_MAX_BYTES = 1024 * 1024
_SWITCH_ATTEMPTS = 5
_READ_BLOCK = 1024 * 1024


class ArchiveGone(NotFound):
    """The archive a pointer named was deleted (superseded); read the pointer again."""


@dataclass(frozen=True, slots=True)
class Pointer:
    """What ``<key>/pointer.json`` says, and the ETag it was read with."""

    key: str
    archive: str  # relative to <prefix>/<key>/
    digest: str
    archive_bytes: int
    content_bytes: int
    file_count: int
    uploaded: float
    uploader: str
    parts: dict[str, Any]
    etag: str = ""


@dataclass(frozen=True, slots=True)
class UploadOutcome:
    uploaded: bool
    uri: str
    reason: str = ""


def _parse_pointer(key: str, body: bytes, etag: str) -> Pointer:
    try:
        document = json.loads(body)
        if document.get("format") != POINTER_FORMAT or document.get("key") != key:
            raise ValueError(f"format {document.get('format')!r}, key {document.get('key')!r}")
        archive = str(document["archive"])
        digest = str(document["digest"])
        if not archive.startswith("archives/") or ".." in archive or "/" in archive[9:]:
            raise ValueError(f"archive name {archive!r}")
        if not digest.startswith(DIGEST_PREFIX):
            raise ValueError(f"digest {digest!r}")
        return Pointer(
            key=key,
            archive=archive,
            digest=digest,
            archive_bytes=int(document["archive_bytes"]),
            content_bytes=int(document["content_bytes"]),
            file_count=int(document["file_count"]),
            uploaded=float(document["uploaded"]),
            uploader=str(document.get("uploader", "")),
            parts=dict(document.get("parts", {})),
            etag=etag,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _unreadable(key, exc) from exc


def _unreadable(key: str, cause: Exception) -> IntegrityError:
    return IntegrityError(
        f"The compile-cache pointer of {key} is unreadable ({cause}); the next upload "
        "for this key replaces it.",
        path=POINTER_NAME,
        check="pointer",
    )


class RemoteCompileCaches:
    """Reads and writes packed compile caches under one prefix of the object store."""

    def __init__(self, source: ObjectSource, uri: ModelUri) -> None:
        self._source = source
        self._uri = uri

    def uri_of(self, key: str) -> str:
        return f"s3://{self._uri.bucket}/{self._object(key, '')}"

    def _object(self, key: str, name: str) -> str:
        return f"{self._uri.prefix}{key}/{name}"

    async def read_pointer(self, key: str) -> Pointer | None:
        """The current pointer of ``key``; None when nothing was uploaded yet."""
        name = self._object(key, POINTER_NAME)
        try:
            stored = await self._source.get_object(
                self._uri.bucket, name, max_bytes=POINTER_MAX_BYTES
            )
        except ObjectTooLarge as exc:
            raise _unreadable(key, exc) from exc
        if stored is None:
            return None
        return _parse_pointer(key, stored.data, stored.etag)

    async def _pointer_etag(self, key: str) -> str | None:
        head = await self._source.head_object(self._uri.bucket, self._object(key, POINTER_NAME))
        return head.etag if head is not None else None

    async def download(self, pointer: Pointer, dest: Path) -> None:
        """Write the archive ``pointer`` names to ``dest``; refuse one of another size."""
        bucket, name = self._uri.bucket, self._object(pointer.key, pointer.archive)
        head = await self._source.head_object(bucket, name)
        if head is None:
            raise ArchiveGone(f"{name} is gone (superseded by a newer upload).")
        if head.size != pointer.archive_bytes:
            raise IntegrityError(
                f"s3://{bucket}/{name} holds {head.size} bytes; its pointer says "
                f"{pointer.archive_bytes}. It is truncated or was replaced; the next "
                "upload for this key replaces it.",
                path=name,
                check="size",
            )
        with dest.open("wb") as out:
            if not head.size:
                return
            try:
                # Pinned to the ETag just read: an archive replaced or deleted meanwhile
                # fails the read instead of mixing two uploads.
                async with self._source.open_range(
                    bucket, name, etag=head.etag, start=0, length=head.size
                ) as reader:
                    while chunk := await reader.read(_READ_BLOCK):
                        await asyncio.to_thread(out.write, chunk)
            except SourceChanged as exc:
                raise ArchiveGone(f"{name} was superseded while it was read.") from exc

    async def upload(
        self, key: str, archive: Path, packed: PackResult, parts: dict[str, Any]
    ) -> UploadOutcome:
        """Upload ``archive`` under a fresh name and switch ``key``'s pointer to it."""
        uri = self.uri_of(key)
        try:
            current: Pointer | None = await self.read_pointer(key)
            etag = current.etag if current else None
        except IntegrityError:
            current, etag = None, await self._pointer_etag(key)  # replace the broken pointer
        if current is not None and current.digest == packed.digest:
            return UploadOutcome(False, uri, "S3 already has this content")
        digest_hex = packed.digest.removeprefix(DIGEST_PREFIX)
        archive_name = (
            f"archives/{digest_hex[:16]}-{int(time.time() * 1000)}-{secrets.token_hex(4)}.tar.zst"
        )
        body = await asyncio.to_thread(archive.read_bytes)
        await self._put(key, archive_name, body, content_type="application/zstd")
        document = {
            "format": POINTER_FORMAT,
            "key": key,
            "archive": archive_name,
            "digest": packed.digest,
            "archive_bytes": len(body),
            "content_bytes": packed.content_bytes,
            "file_count": packed.file_count,
            "uploaded": time.time(),
            "uploader": socket.gethostname(),
            "parts": parts,
        }
        pointer_body = json.dumps(document, sort_keys=True, indent=1).encode()
        for _ in range(_SWITCH_ATTEMPTS):
            if await self._switch_pointer(key, pointer_body, etag):
                break
            # Another node switched the pointer since we read it.
            current = await self.read_pointer(key)
            etag = current.etag if current else None
            if current is not None and current.digest == packed.digest:
                await self._delete(key, archive_name)
                return UploadOutcome(False, uri, "another node uploaded the same content")
        else:
            await self._delete(key, archive_name)
            raise Conflict(
                f"The compile-cache pointer of {key} at {uri} kept changing under "
                f"{_SWITCH_ATTEMPTS} attempts; another node is uploading it. Push again later."
            )
        if current is not None and current.archive != archive_name:
            await self._delete(key, current.archive)  # superseded; readers re-read the pointer
        return UploadOutcome(True, uri)

    async def _put(self, key: str, name: str, body: bytes, *, content_type: str) -> None:
        target = self._object(key, name)
        await self._source.put_object(self._uri.bucket, target, body, content_type=content_type)

    async def _switch_pointer(self, key: str, body: bytes, etag: str | None) -> bool:
        """Write the pointer only if it is still as read; False when another writer won."""
        try:
            await self._source.put_object(
                self._uri.bucket,
                self._object(key, POINTER_NAME),
                body,
                content_type="application/json",
                if_match=etag or None,
                if_absent=not etag,
            )
        except Conflict:
            return False
        return True

    async def _delete(self, key: str, name: str) -> None:
        target = self._object(key, name)
        try:
            await self._source.delete_object(self._uri.bucket, target)
        except Exception as exc:  # only garbage is left behind; say so and go on
            log.warning("could not delete s3://%s/%s: %s", self._uri.bucket, target, exc)
