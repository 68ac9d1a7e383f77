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

Every line ends with an HMAC-SHA256 under the tier root's ``journal.key``
(``agent.store.roots``): the header's over its JSON, each range's over the
header's MAC and its own JSON. A journal the agent did not write (planted
with digests that match planted data) fails the check and is not resumed.

Layout of a staging directory::

    staging/<key>/journal    header line, then one line per completed range
    staging/<key>/data/...   the model files, renamed to snapshots/<key> on publish
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from agent._snapshot import Snapshot

__all__ = [
    "DATA_DIR",
    "JOURNAL_NAME",
    "Journal",
    "JournalHeader",
    "journaled_bytes",
    "read_header",
]

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal"
DATA_DIR = "data"
FORMAT = 2
_HEADER_CONTEXT = b"prewarm journal header\0"


@dataclass(frozen=True, slots=True)
class JournalHeader:
    """What a journal is about: the snapshot, its chunk size and its objects."""

    key: str
    uri: str
    chunk_size: int
    objects: tuple[tuple[str, int, str], ...]

    @classmethod
    def for_snapshot(cls, snapshot: Snapshot, chunk_size: int) -> JournalHeader:
        """The header for pulling ``snapshot`` in chunks of ``chunk_size`` bytes."""
        return cls(
            key=snapshot.key,
            uri=str(snapshot.uri),
            chunk_size=chunk_size,
            objects=tuple((o.relative_path, o.size, o.etag) for o in snapshot.objects),
        )

    @property
    def total_bytes(self) -> int:
        """Bytes of every object of the snapshot."""
        return sum(size for _, size, _ in self.objects)

    def to_json(self) -> dict[str, Any]:
        """The header as the journal's first line stores it."""
        return {
            "format": FORMAT,
            "key": self.key,
            "uri": self.uri,
            "chunk_size": self.chunk_size,
            "objects": [list(o) for o in self.objects],
        }

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> JournalHeader:
        """The header from the journal's first line; ValueError for another format."""
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


def read_header(staging: Path, secret: bytes) -> JournalHeader | None:
    """The header of a staging directory's journal; None if it has no usable, signed one."""
    try:
        with _open_journal(staging) as fh:
            return _verified_header(fh.readline(), secret)[0]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def journaled_bytes(staging: Path, secret: bytes) -> int:
    """Bytes the signed ranges of a staging directory's journal cover (0 without one).

    What a pull resuming it will not fetch again, unless re-hashing finds a
    range torn (a power loss): an estimate for status, read without hashing.
    """
    try:
        with _open_journal(staging) as fh:
            header, header_mac = _verified_header(fh.readline(), secret)
            ranges = {
                (done.path, done.offset): done.length
                for done in _read_entries(
                    fh, header, secret=secret, header_mac=header_mac, where=staging
                )
            }
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return sum(ranges.values())


class Journal:
    """Append-only record of completed ranges; one ``write`` per line (O_APPEND)."""

    def __init__(self, fd: int, header: JournalHeader, secret: bytes, header_mac: bytes) -> None:
        """A journal open for appending on ``fd``; ``create`` and ``resume`` make one."""
        self._fd = fd
        self.header = header
        self._secret = secret
        self._header_mac = header_mac

    @classmethod
    def create(cls, staging: Path, header: JournalHeader, secret: bytes) -> Journal:
        """A new journal in ``staging``, its header signed with ``secret``."""
        path = staging / JOURNAL_NAME
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o644)
        payload = _payload(header.to_json())
        mac = _sign(secret, _HEADER_CONTEXT, payload)
        os.write(fd, payload + b" " + mac + b"\n")
        return cls(fd, header, secret, mac)

    @classmethod
    def resume(
        cls, staging: Path, header: JournalHeader, secret: bytes
    ) -> tuple[Journal, list[CompletedRange]]:
        """Open an existing journal for appending, with the signed ranges it lists.

        Raises ValueError if its header is unsigned or not ``header`` (a
        different snapshot, chunk size or object list): the caller starts clean.
        """
        with _open_journal(staging) as fh:
            found, header_mac = _verified_header(fh.readline(), secret)
            if found != header:
                raise ValueError("journal belongs to another snapshot or chunk size")
            completed = list(
                _read_entries(fh, header, secret=secret, header_mac=header_mac, where=staging)
            )
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(staging / JOURNAL_NAME, flags)
        return cls(fd, header, secret, header_mac), completed

    def record(self, path: str, offset: int, length: int, digest: bytes) -> None:
        """Append a completed range, signed, in one write."""
        payload = _payload({"p": path, "o": offset, "n": length, "h": digest.hex()})
        mac = _sign(self._secret, self._header_mac, payload)
        os.write(self._fd, payload + b" " + mac + b"\n")

    def close(self) -> None:
        """Close the journal's file (again: nothing)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _payload(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def _sign(secret: bytes, context: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, context + payload, hashlib.sha256).hexdigest().encode()


def _split(raw: bytes, secret: bytes, context: bytes) -> bytes:
    """The JSON of a signed line; ValueError if its MAC does not verify."""
    payload, _, mac = raw.rstrip(b"\n").rpartition(b" ")
    if not hmac.compare_digest(mac, _sign(secret, context, payload)):
        raise ValueError("the line is not signed by this agent")
    return payload


def _verified_header(raw: bytes, secret: bytes) -> tuple[JournalHeader, bytes]:
    payload = _split(raw, secret, _HEADER_CONTEXT)
    return JournalHeader.from_json(json.loads(payload)), _sign(secret, _HEADER_CONTEXT, payload)


def _open_journal(staging: Path) -> BinaryIO:
    return os.fdopen(os.open(staging / JOURNAL_NAME, os.O_RDONLY | os.O_NOFOLLOW), "rb")


def _read_entries(
    lines: Iterable[bytes],
    expected: JournalHeader,
    *,
    secret: bytes,
    header_mac: bytes,
    where: Path,
) -> Iterator[CompletedRange]:
    sizes = {p: size for p, size, _ in expected.objects}
    for raw in lines:
        if not raw.endswith(b"\n"):
            break  # the last line was cut short by the crash: that range is not done
        try:
            entry = json.loads(_split(raw, secret, header_mac))
            completed = CompletedRange(
                str(entry["p"]), int(entry["o"]), int(entry["n"]), bytes.fromhex(entry["h"])
            )
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a malformed or unsigned journal line in %s", where)
            continue
        size = sizes.get(completed.path)
        aligned = completed.offset % expected.chunk_size == 0
        if size is None or not aligned or completed.offset + completed.length > size:
            log.warning("ignoring a journal line outside the snapshot in %s", where)
            continue
        yield completed
