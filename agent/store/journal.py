"""The chunk journal: which byte ranges of a staging directory are complete.

A pull writes ranges of ``chunk_size`` bytes at their offsets, out of order.
After each range is fully written, one line is appended to ``journal`` in the
staging directory: the file, the offset, the length and the range's content
digest. If the agent dies (SIGKILL, OOM, power loss) the next pull of the same
snapshot reads the journal, re-hashes the ranges it lists (a torn write on
disk after power loss must not be trusted) and fetches only the rest.

The first line is a header naming the snapshot key, the chunk size and every
object (path, size, ETag); a journal whose header differs from the snapshot
being pulled is not resumed. The snapshot key already covers the ETags, so a
changed object never resumes into stale bytes.

Layout of a staging directory::

    staging/<key>/journal    header line, then one line per completed range
    staging/<key>/data/...   the model files, renamed to snapshots/<key> on publish
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent._snapshot import Snapshot

__all__ = ["DATA_DIR", "JOURNAL_NAME", "Journal", "JournalHeader", "read_header"]

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal"
DATA_DIR = "data"
FORMAT = 1


@dataclass(frozen=True, slots=True)
class JournalHeader:
    key: str
    uri: str
    chunk_size: int
    objects: tuple[tuple[str, int, str], ...]

    @classmethod
    def for_snapshot(cls, snapshot: Snapshot, chunk_size: int) -> JournalHeader:
        return cls(
            key=snapshot.key,
            uri=str(snapshot.uri),
            chunk_size=chunk_size,
            objects=tuple((o.relative_path, o.size, o.etag) for o in snapshot.objects),
        )

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.objects)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "key": self.key,
            "uri": self.uri,
            "chunk_size": self.chunk_size,
            "objects": [list(o) for o in self.objects],
        }

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> JournalHeader:
        if document.get("format") != FORMAT:
            raise ValueError(f"unknown journal format {document.get('format')!r}")
        return cls(
            key=str(document["key"]),
            uri=str(document["uri"]),
            chunk_size=int(document["chunk_size"]),
            objects=tuple((str(p), int(s), str(e)) for p, s, e in document["objects"]),
        )


@dataclass(frozen=True, slots=True)
class CompletedRange:
    path: str
    offset: int
    length: int
    digest: bytes


def read_header(staging: Path) -> JournalHeader | None:
    """The header of a staging directory's journal; None if it has no usable one."""
    try:
        with (staging / JOURNAL_NAME).open("rb") as fh:
            return JournalHeader.from_json(json.loads(fh.readline()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Journal:
    """Append-only record of completed ranges; one ``write`` per line (O_APPEND)."""

    def __init__(self, fd: int, header: JournalHeader) -> None:
        self._fd = fd
        self.header = header

    @classmethod
    def create(cls, staging: Path, header: JournalHeader) -> Journal:
        path = staging / JOURNAL_NAME
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644
        )
        os.write(fd, _line(header.to_json()))
        return cls(fd, header)

    @classmethod
    def resume(cls, staging: Path, header: JournalHeader) -> tuple[Journal, list[CompletedRange]]:
        """Open an existing journal for appending, with the ranges it lists.

        Raises ValueError if its header is not ``header`` (a different
        snapshot, chunk size or object list): the caller starts clean.
        """
        path = staging / JOURNAL_NAME
        completed = list(_read_entries(path, header))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        return cls(fd, header), completed

    def record(self, path: str, offset: int, length: int, digest: bytes) -> None:
        os.write(self._fd, _line({"p": path, "o": offset, "n": length, "h": digest.hex()}))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _line(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode() + b"\n"


def _read_entries(path: Path, expected: JournalHeader) -> Iterator[CompletedRange]:
    sizes = {p: size for p, size, _ in expected.objects}
    with path.open("rb") as fh:
        found = JournalHeader.from_json(json.loads(fh.readline()))
        if found != expected:
            raise ValueError("journal belongs to another snapshot or chunk size")
        for raw in fh:
            if not raw.endswith(b"\n"):
                break  # the last line was cut short by the crash: that range is not done
            try:
                entry = json.loads(raw)
                completed = CompletedRange(
                    str(entry["p"]), int(entry["o"]), int(entry["n"]), bytes.fromhex(entry["h"])
                )
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring a malformed journal line in %s", path)
                continue
            size = sizes.get(completed.path)
            aligned = completed.offset % expected.chunk_size == 0
            if size is None or not aligned or completed.offset + completed.length > size:
                log.warning("ignoring a journal line outside the snapshot in %s", path)
                continue
            yield completed
