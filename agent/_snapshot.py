"""Snapshots: what a URI held when it was listed, and the cache key derived from it."""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agent._exceptions import InvalidRequest
from agent._uri import ModelUri

__all__ = [
    "KEY_LENGTH",
    "Snapshot",
    "SourceObject",
    "check_globs",
    "key_prefix",
    "select_objects",
    "snapshot_key",
]

KEY_LENGTH = 32  # hex digits of sha256: 128 bits, plenty for one node's cache
# The fewest digits a key prefix may have: fewer would name other snapshots by accident.
MIN_KEY_PREFIX = 8
_HEX = frozenset("0123456789abcdef")


def key_prefix(ref: str) -> str | None:
    """``ref`` in lower case if it is a snapshot key or a prefix of one (8 to KEY_LENGTH hex
    digits), else None."""
    key = ref.lower()
    if MIN_KEY_PREFIX <= len(key) <= KEY_LENGTH and set(key) <= _HEX:
        return key
    return None


@dataclass(frozen=True, slots=True)
class SourceObject:
    """One object of a snapshot, as the listing described it."""

    key: str
    relative_path: str
    size: int
    etag: str
    # S3's checksum algorithm for the object ("" if it has none); not part of the key.
    checksum_algorithm: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A URI's objects at one point in time, filtered by include/exclude globs."""

    uri: ModelUri
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    objects: tuple[SourceObject, ...]
    key: str

    @property
    def total_bytes(self) -> int:
        return sum(obj.size for obj in self.objects)


def check_globs(patterns: Iterable[str], *, what: str) -> tuple[str, ...]:
    """Validate glob patterns and return them in canonical (sorted, unique) order."""
    checked: set[str] = set()
    for pattern in patterns:
        if not pattern or "\x00" in pattern:
            raise InvalidRequest(
                f"{what} pattern {pattern!r} is empty or contains NUL; give globs like "
                "'*.safetensors' or 'original/*'."
            )
        checked.add(pattern)
    return tuple(sorted(checked))


def select_objects(
    objects: Iterable[SourceObject], include: Sequence[str], exclude: Sequence[str]
) -> list[SourceObject]:
    """Objects whose relative path matches an include glob (any, if none) and no exclude glob."""
    return [
        obj
        for obj in objects
        if (not include or any(fnmatch.fnmatchcase(obj.relative_path, g) for g in include))
        and not any(fnmatch.fnmatchcase(obj.relative_path, g) for g in exclude)
    ]


def snapshot_key(
    uri: ModelUri,
    include: Sequence[str],
    exclude: Sequence[str],
    objects: Sequence[SourceObject],
) -> str:
    """Content key of a snapshot: any change to an object's size or ETag changes it."""
    document = {
        "v": 1,
        "uri": str(uri),
        "include": list(include),
        "exclude": list(exclude),
        "objects": sorted([obj.relative_path, obj.size, obj.etag] for obj in objects),
    }
    encoded = json.dumps(document, separators=(",", ":"), ensure_ascii=True).encode()
    return hashlib.sha256(encoded).hexdigest()[:KEY_LENGTH]
