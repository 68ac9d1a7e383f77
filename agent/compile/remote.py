"""Compile-cache archives in S3: where they live, and how nodes switch to a new one.

Layout under ``compile_cache.uri`` (``s3://bucket/prefix``)::

    <prefix>/<key>/pointer.json                          which archive is current
    <prefix>/<key>/archives/<digest16>-<ms>-<rand>.tar.zst   immutable, one per upload

An upload never overwrites an object that anyone reads: the archive goes to a
name no other node can pick, and only then is the small pointer switched to
it, with a conditional PUT (``If-Match`` the pointer's ETag as read before, or
``If-None-Match: *`` when there was none). If another node switched the
pointer in between, S3 answers 412; the uploader reads the pointer again and
stops if it names the same content, else switches again (the last writer wins,
and every reader sees either the old archive or the new one, never a mix).
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

from botocore import exceptions as boto

from agent._exceptions import Conflict, IntegrityError, NotFound
from agent._uri import ModelUri
from agent.compile.archive import DIGEST_PREFIX, PackResult
from agent.source.s3 import S3Source

__all__ = ["ArchiveGone", "Pointer", "RemoteCompileCaches", "UploadOutcome"]

log = logging.getLogger(__name__)

POINTER_FORMAT = 1
POINTER_NAME = "pointer.json"
_SWITCH_ATTEMPTS = 5
_READ_BLOCK = 1024 * 1024
_PRECONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


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


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, boto.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return str(error.get("Code") or status)
    return ""


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
        raise IntegrityError(
            f"The compile-cache pointer of {key} is unreadable ({exc}); the next upload "
            "for this key replaces it.",
            path=POINTER_NAME,
            check="pointer",
        ) from exc


class RemoteCompileCaches:
    """Reads and writes packed compile caches under one S3 prefix."""

    def __init__(self, source: S3Source, uri: ModelUri) -> None:
        self._source = source
        self._uri = uri

    def uri_of(self, key: str) -> str:
        return f"s3://{self._uri.bucket}/{self._object(key, '')}"

    def _object(self, key: str, name: str) -> str:
        return f"{self._uri.prefix}{key}/{name}"

    def _translate(self, exc: Exception, doing: str) -> Exception:
        return self._source._translate(exc, doing, bucket=self._uri.bucket)

    async def read_pointer(self, key: str) -> Pointer | None:
        """The current pointer of ``key``; None when nothing was uploaded yet."""
        name = self._object(key, POINTER_NAME)
        doing = f"reading s3://{self._uri.bucket}/{name}"
        try:
            response = await self._source.client.get_object(Bucket=self._uri.bucket, Key=name)
            async with response["Body"] as body:
                data: bytes = await body.read()
        except Exception as exc:
            if _error_code(exc) in _MISSING_CODES:
                return None
            raise self._translate(exc, doing) from exc
        return _parse_pointer(key, data, str(response.get("ETag", "")))

    async def _pointer_etag(self, key: str) -> str | None:
        name = self._object(key, POINTER_NAME)
        try:
            response = await self._source.client.head_object(Bucket=self._uri.bucket, Key=name)
        except Exception as exc:
            if _error_code(exc) in _MISSING_CODES:
                return None
            raise self._translate(exc, f"reading s3://{self._uri.bucket}/{name}") from exc
        return str(response.get("ETag", ""))

    async def download(self, pointer: Pointer, dest: Path) -> None:
        """Write the archive ``pointer`` names to ``dest``; refuse one of another size."""
        name = self._object(pointer.key, pointer.archive)
        doing = f"downloading s3://{self._uri.bucket}/{name}"
        try:
            response = await self._source.client.get_object(Bucket=self._uri.bucket, Key=name)
        except Exception as exc:
            if _error_code(exc) in _MISSING_CODES:
                raise ArchiveGone(f"{name} is gone (superseded by a newer upload).") from exc
            raise self._translate(exc, doing) from exc
        received = 0
        try:
            async with response["Body"] as body:
                with dest.open("wb") as out:
                    while chunk := await body.read(_READ_BLOCK):
                        received += len(chunk)
                        if received > pointer.archive_bytes:
                            break
                        await asyncio.to_thread(out.write, chunk)
        except Exception as exc:
            raise self._translate(exc, doing) from exc
        if received != pointer.archive_bytes:
            raise IntegrityError(
                f"s3://{self._uri.bucket}/{name} holds {received} bytes or more; its pointer "
                f"says {pointer.archive_bytes}. It is truncated or was replaced; the next "
                "upload for this key replaces it.",
                path=name,
                check="size",
            )

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

    async def _put(self, key: str, name: str, body: bytes, **extra: Any) -> None:
        target = self._object(key, name)
        kwargs: dict[str, Any] = {"Bucket": self._uri.bucket, "Key": target, "Body": body}
        if "content_type" in extra:
            kwargs["ContentType"] = extra.pop("content_type")
        kwargs.update(extra)
        try:
            await self._source.client.put_object(**kwargs)
        except Exception as exc:
            raise self._translate(exc, f"uploading s3://{self._uri.bucket}/{target}") from exc

    async def _switch_pointer(self, key: str, body: bytes, etag: str | None) -> bool:
        """Write the pointer only if it is still as read; False when another writer won."""
        condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            await self._put(key, POINTER_NAME, body, content_type="application/json", **condition)
        except Exception as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            if _error_code(cause) in _PRECONDITION_CODES:
                return False
            raise
        return True

    async def _delete(self, key: str, name: str) -> None:
        target = self._object(key, name)
        try:
            await self._source.client.delete_object(Bucket=self._uri.bucket, Key=target)
        except Exception as exc:  # only garbage is left behind; say so and go on
            log.warning("could not delete s3://%s/%s: %s", self._uri.bucket, target, exc)
