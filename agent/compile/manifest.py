"""What ``<key>/manifest.json`` says: every archive uploaded for a key, and their union.

Nodes that compile the same key add archives to one manifest instead of
replacing each other's: each archive holds the files its uploader had that the
manifest did not list yet *with that content* (path and sha256), and is named
by the digest of those files. Archives are listed in the order they were
added; when two hold the same path, the newest wins, so a file uploaded while
a compiler was still writing it (empty, cut short) is replaced by the finished
copy its node sends once it differs from what the manifest lists.

Caches uploaded by agents before manifests existed have only
``<key>/pointer.json`` naming one archive whose file list is unknown; they are
read as a manifest with one such *legacy* archive, and the first manifest
written for the key keeps it, so nothing uploaded before is lost.

A key that gathered many archives is *compacted*: their union becomes one
archive, the only one listed, and the others are listed as ``retired`` with
the time, to be deleted once no restore can still be reading them. Agents
that do not know ``retired`` ignore it (those archives are then never deleted).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent._exceptions import IntegrityError
from agent.compile.archive import DIGEST_PREFIX, FileFacts, digest_of_files

__all__ = ["ArchiveEntry", "Manifest", "parse_legacy_pointer", "parse_manifest"]

MANIFEST_FORMAT = 2
LEGACY_POINTER_FORMAT = 1
_MAX_ARCHIVES = 10_000
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class ArchiveEntry:
    """One uploaded archive: where it is, what it holds, who uploaded it."""

    name: str  # relative to <prefix>/<key>/
    digest: str
    archive_bytes: int
    content_bytes: int
    file_count: int
    uploaded: float
    uploader: str
    # The files it holds; None for a legacy archive whose list was never recorded.
    files: tuple[FileFacts, ...] | None
    # sha256 of the archive as stored (hex), checked before it is unpacked; "" in
    # entries written before agents recorded it.
    archive_sha256: str = ""

    def to_json(self) -> dict[str, Any]:
        """The entry as the manifest's JSON holds it."""
        extra = {"archive_sha256": self.archive_sha256} if self.archive_sha256 else {}
        return extra | {
            "name": self.name,
            "digest": self.digest,
            "archive_bytes": self.archive_bytes,
            "content_bytes": self.content_bytes,
            "file_count": self.file_count,
            "uploaded": self.uploaded,
            "uploader": self.uploader,
            "files": None if self.files is None else [list(f) for f in self.files],
        }


@dataclass(frozen=True, slots=True)
class Manifest:
    """Every archive of a key, and the ETag the manifest was read with ("" if none yet)."""

    key: str
    archives: tuple[ArchiveEntry, ...]
    parts: dict[str, Any]
    etag: str = ""
    # Read from a legacy pointer.json: no manifest.json exists yet.
    legacy: bool = False
    # Archives a compaction took out of the list, and when: restores that read the
    # manifest before may still be reading them, so they are deleted only later.
    retired: tuple[tuple[str, float], ...] = ()
    # The name of the trusted key whose signature the manifest was read with ("": unsigned
    # or not read from S3). A manifest written back is signed by the writer's key.
    signer: str = ""
    # Each listed path's facts as the newest archive holding it lists them.
    latest: Mapping[str, FileFacts] = field(init=False)

    def __post_init__(self) -> None:
        newest = {f[0]: f for entry in self.archives for f in entry.files or ()}
        object.__setattr__(self, "latest", newest)

    @property
    def digest(self) -> str:
        """The union's digest; with a legacy archive, a digest of the archives' digests."""
        if all(entry.files is not None for entry in self.archives):
            return digest_of_files(self.union_files())
        joined = "\n".join(entry.digest for entry in self.archives).encode()
        return DIGEST_PREFIX + hashlib.sha256(joined).hexdigest()

    @property
    def archive_bytes(self) -> int:
        """Bytes of every archive listed, as stored in S3."""
        return sum(entry.archive_bytes for entry in self.archives)

    @property
    def content_bytes(self) -> int:
        """Bytes of every archive listed, unpacked."""
        return sum(entry.content_bytes for entry in self.archives)

    @property
    def uploaded(self) -> float:
        """When the newest archive was uploaded (0.0 without any)."""
        return max((entry.uploaded for entry in self.archives), default=0.0)

    def union_files(self) -> list[FileFacts]:
        """Every listed file once, as a restore leaves it: the newest archive wins a path."""
        return list(self.latest.values())

    def lacking(self, local: Iterable[FileFacts]) -> tuple[FileFacts, ...]:
        """The ``local`` files S3 lacks: a path not listed, or listed newest with other content.

        A legacy archive's file list is unknown: what only it holds counts as lacking.
        """
        return tuple(facts for facts in local if self.latest.get(facts[0]) != facts)

    def with_archive(self, entry: ArchiveEntry) -> Manifest:
        """This manifest with ``entry`` last (the newest), moved there if already listed.

        Archives are named by their content, so a node re-sending files an older
        archive holds (over a newer, different copy) names that archive again:
        moving it last is what makes its copy the one restored.
        """
        older = tuple(existing for existing in self.archives if existing.name != entry.name)
        return Manifest(self.key, (*older, entry), self.parts, self.etag, self.legacy, self.retired)

    def names(self, name: str) -> bool:
        """Whether ``name`` is one of this manifest's archives, listed or retired."""
        return any(a.name == name for a in self.archives) or any(
            retired == name for retired, _ in self.retired
        )

    @property
    def compactable(self) -> bool:
        """Whether the archives can become one: more than one, every file list known."""
        return len(self.archives) > 1 and all(a.files is not None for a in self.archives)

    def compacted(self, entry: ArchiveEntry, now: float) -> Manifest:
        """This manifest with ``entry`` (the union of every archive) as its only archive.

        The archives it replaces are retired at ``now``, not forgotten: whoever
        deletes them later (``swept``) knows their names and their age.
        """
        replaced = tuple((a.name, now) for a in self.archives if a.name != entry.name)
        retired = tuple(r for r in self.retired if r[0] != entry.name)
        return Manifest(self.key, (entry,), self.parts, self.etag, False, (*retired, *replaced))

    def retired_before(self, moment: float) -> tuple[str, ...]:
        """Names retired before ``moment`` that no listed archive uses again."""
        listed = {a.name for a in self.archives}
        return tuple(name for name, at in self.retired if at < moment and name not in listed)

    def swept(self, names: Iterable[str]) -> Manifest:
        """This manifest without ``names`` among its retired archives (they were deleted)."""
        gone = set(names)
        retired = tuple(r for r in self.retired if r[0] not in gone)
        return Manifest(self.key, self.archives, self.parts, self.etag, self.legacy, retired)

    def covers(self, entry: ArchiveEntry) -> bool:
        """True when a restore would already give every file of ``entry`` as it holds it."""
        return entry.files is not None and not self.lacking(entry.files)

    def to_bytes(self) -> bytes:
        """The manifest as the JSON object stored in S3."""
        document = {
            "format": MANIFEST_FORMAT,
            "key": self.key,
            "digest": self.digest,
            "file_count": len(self.union_files()),
            "content_bytes": self.content_bytes,
            "parts": self.parts,
            "archives": [entry.to_json() for entry in self.archives],
        }
        if self.retired:
            document["retired"] = [[name, at] for name, at in self.retired]
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _unreadable(key: str, name: str, cause: Exception) -> IntegrityError:
    return IntegrityError(
        f"The compile-cache {name} of {key} is unreadable ({cause}); the next upload "
        "for this key replaces it.",
        path=name,
        check="pointer",
    )


def _archive_name(name: object, folder: str) -> str:
    text = str(name)
    rest = text.removeprefix(folder)
    if rest == text or not rest or "/" in rest or rest in (".", "..") or "\\" in rest:
        raise ValueError(f"archive name {text!r}")
    return text


def _digest(value: object) -> str:
    text = str(value)
    if not text.startswith(DIGEST_PREFIX):
        raise ValueError(f"digest {text!r}")
    return text


def _files(value: Any) -> tuple[FileFacts, ...]:
    files: list[FileFacts] = []
    for path, size, sha, executable in value:
        if not isinstance(path, str) or not isinstance(sha, str):
            raise TypeError(f"file entry {path!r}")
        files.append((path, int(size), sha, bool(executable)))
    return tuple(files)


def _entry(document: dict[str, Any]) -> ArchiveEntry:
    files = document.get("files")
    legacy = files is None
    return ArchiveEntry(
        name=_archive_name(document["name"], "archives/" if legacy else "artifacts/"),
        digest=_digest(document["digest"]),
        archive_bytes=int(document["archive_bytes"]),
        content_bytes=int(document["content_bytes"]),
        file_count=int(document["file_count"]),
        uploaded=float(document["uploaded"]),
        uploader=str(document.get("uploader", "")),
        files=None if legacy else _files(files),
        archive_sha256=_sha256(document.get("archive_sha256", "")),
    )


def _sha256(value: object) -> str:
    text = str(value)
    if text and not _SHA256.fullmatch(text):
        raise ValueError(f"archive_sha256 {text[:80]!r}")
    return text


def _retired(value: Any) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, list) or len(value) > _MAX_ARCHIVES:
        raise ValueError("retired is not a list of at most 10,000")
    return tuple((_archive_name(name, "artifacts/"), float(at)) for name, at in value)


def parse_manifest(key: str, body: bytes, etag: str) -> Manifest:
    """A manifest.json as read; IntegrityError when it is not one for ``key``."""
    try:
        document = json.loads(body)
        if document.get("format") != MANIFEST_FORMAT or document.get("key") != key:
            raise ValueError(f"format {document.get('format')!r}, key {document.get('key')!r}")
        archives = document["archives"]
        if not isinstance(archives, list) or len(archives) > _MAX_ARCHIVES:
            raise ValueError("archives is not a list of at most 10,000")
        return Manifest(
            key,
            tuple(_entry(a) for a in archives),
            dict(document.get("parts", {})),
            etag,
            retired=_retired(document.get("retired", [])),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _unreadable(key, "manifest.json", exc) from exc


def parse_legacy_pointer(key: str, body: bytes) -> Manifest:
    """A pointer.json written by an older agent, as a manifest of its one archive."""
    try:
        document = json.loads(body)
        if document.get("format") != LEGACY_POINTER_FORMAT or document.get("key") != key:
            raise ValueError(f"format {document.get('format')!r}, key {document.get('key')!r}")
        entry = _entry({**document, "name": document["archive"], "files": None})
        return Manifest(key, (entry,), dict(document.get("parts", {})), "", legacy=True)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _unreadable(key, "pointer.json", exc) from exc
