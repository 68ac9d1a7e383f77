"""Published volumes, one small file each: what a restart of the plugin picks up again.

A record is written before its mount is made and removed after the mount is
gone, so after any crash the records cover every mount the plugin made;
``CsiNode.recover`` settles each one: a volume still mounted gets its lease held
again, one the kubelet took down meanwhile is forgotten. The directory is root's
alone (0700).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.csi.volumes import VolumeKind

__all__ = ["PublishedVolume", "VolumeRecords"]

log = logging.getLogger(__name__)
_MAX_RECORD = 64 * 1024


@dataclass(frozen=True, slots=True)
class PublishedVolume:
    """One volume this node published: where, for whom, and the lease that keeps it."""

    volume_id: str
    target: str
    kind: VolumeKind
    tenant: str
    # The model's request (empty for a socket volume), to tell a repeat from a change.
    ask: str
    # The directory bound at the target, and whom the lease is for.
    source: str = ""
    pod: str = ""


class VolumeRecords:
    """The records directory: save, find, drop, and read every record at start."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, volume_id: str) -> Path:
        # Volume ids are the kubelet's text: a digest keeps them out of the path.
        return self.directory / (hashlib.sha256(volume_id.encode()).hexdigest()[:40] + ".json")

    def save(self, record: PublishedVolume) -> None:
        """Write ``record`` whole (a crash leaves the old one or the new one, never half)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        path = self._path(record.volume_id)
        temporary = path.with_suffix(".tmp")
        data = json.dumps(asdict(record)).encode()
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        temporary.replace(path)
        directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)  # the rename itself survives a power loss
        finally:
            os.close(directory)

    def get(self, volume_id: str) -> PublishedVolume | None:
        """The record of ``volume_id``, or None."""
        return self._read(self._path(volume_id))

    def drop(self, volume_id: str) -> None:
        """Forget ``volume_id`` (nothing to do if it has no record)."""
        with contextlib.suppress(FileNotFoundError):
            self._path(volume_id).unlink()

    def all(self) -> list[PublishedVolume]:
        """Every readable record; an unreadable one is logged and left for a person."""
        if not self.directory.is_dir():
            return []
        found = (self._read(path) for path in sorted(self.directory.glob("*.json")))
        return [record for record in found if record is not None]

    def _read(self, path: Path) -> PublishedVolume | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("CSI volume record %s cannot be opened (%s); left in place", path, exc)
            return None
        try:
            data = os.read(fd, _MAX_RECORD + 1)
        finally:
            os.close(fd)
        try:
            fields = json.loads(data)
            if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
                raise ValueError("not an object of strings")
            return PublishedVolume(**fields)
        except (ValueError, TypeError) as exc:
            log.warning("CSI volume record %s is unreadable (%s); left in place", path, exc)
            return None
