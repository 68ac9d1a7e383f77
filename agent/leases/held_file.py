"""The held leases, on disk, so that a restart of the agent does not drop them.

One JSON file, private to the agent (0600, in the shm tier's root, so it lives
as long as the boot), rewritten whole after each change of the table::

    {"format": 1, "boot_id": "<this boot>", "leases": [
      {"id": "restored:<sha256 of the lease id>", "key": "<snapshot key>",
       "client": "<name>", "grantee": "<socket>", "acquired": <epoch seconds>,
       "pid": <holder pid>, "uid": <uid>, "gid": <gid>, "start_time": <clock ticks>}]}

It never holds a lease id (a capability), only its hash: the holder, who still
has the id, names the lease again. Read back it is hostile input like any file
on disk: a file that is not the agent's own private regular file, from another
boot, or malformed is ignored (logged), and each entry is checked field by field.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent._fs import write_json_atomic
from agent._snapshot import KEY_LENGTH
from agent.leases.table import RESTORED_PREFIX, LeaseRecord, PeerCredentials, restored_id

__all__ = ["HELD_LEASES_NAME", "HeldLease", "load_held_leases", "save_held_leases"]

HELD_LEASES_NAME = "held-leases.json"
_FORMAT = 1
# Far above what the lease caps allow (256 per uid), far below memory trouble.
_MAX_BYTES = 4 * 1024**2
_MAX_TEXT = 256
_RESTORED_ID = re.compile(re.escape(RESTORED_PREFIX) + "[0-9a-f]{64}")
_KEY = re.compile(f"[0-9a-f]{{{KEY_LENGTH}}}")
_MAX_ID = 2**31 - 1
_MAX_TICKS = 2**63 - 1

log = logging.getLogger("agent.leases")


@dataclass(frozen=True, slots=True)
class HeldLease:
    """One lease as the file keeps it: who held it, on what, since when."""

    id: str
    key: str
    client_name: str
    grantee: str
    acquired: float
    holder: PeerCredentials

    def orphan(self) -> LeaseRecord:
        """The lease as the table takes it back after a restart, until its holder returns."""
        return LeaseRecord(
            id=self.id,
            key=self.key,
            client_name=self.client_name,
            acquired=self.acquired,
            expires=None,
            holder=self.holder,
            held=True,
            grantee=self.grantee,
            orphaned=True,
        )


def save_held_leases(path: Path, records: list[LeaseRecord], boot: str) -> int:
    """Replace the file with the held leases among ``records`` whose holder is known.

    A holder without a start time (not visible from here) cannot be told from a
    later process with its pid, so its lease is not kept. Returns how many were.
    """
    entries = [_entry(record) for record in records if _keepable(record)]
    document = {"format": _FORMAT, "boot_id": boot, "leases": entries}
    write_json_atomic(path, document, mode=0o600)
    return len(entries)


def load_held_leases(path: Path, boot: str) -> list[HeldLease]:
    """The leases the file names, if it is the agent's own and from this boot; else none."""
    document = _read_private_json(path)
    if document is None:
        return []
    if document.get("format") != _FORMAT or not isinstance(document.get("leases"), list):
        log.warning("ignoring %s: not a held-leases file of this agent's format", path)
        return []
    if document.get("boot_id") != boot or not boot:
        log.info("not restoring leases from %s: written before the node's last boot", path)
        return []
    leases: list[HeldLease] = []
    skipped = 0
    for entry in document["leases"]:
        lease = _parse(entry)
        if lease is None:
            skipped += 1
        else:
            leases.append(lease)
    if skipped:
        log.warning("ignoring %d malformed entries of %s", skipped, path)
    return leases


def _keepable(record: LeaseRecord) -> bool:
    holder = record.holder
    return record.held and holder is not None and holder.start_time is not None


def _entry(record: LeaseRecord) -> dict[str, Any]:
    holder = record.holder
    assert holder is not None  # _keepable
    assert holder.start_time is not None
    return {
        "id": record.id if record.orphaned else restored_id(record.id),
        "key": record.key,
        "client": record.client_name,
        "grantee": record.grantee,
        "acquired": record.acquired,
        "pid": holder.pid,
        "uid": holder.uid,
        "gid": holder.gid,
        "start_time": holder.start_time,
    }


def _read_private_json(path: Path) -> dict[str, Any] | None:
    """The file's JSON object if it is a regular file of the agent's alone; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    try:
        info = os.fstat(fd)
        problem = _untrusted(info)
        if problem:
            log.warning("ignoring %s: %s", path, problem)
            return None
        data = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        if len(data) > _MAX_BYTES:
            raise OSError(errno.EFBIG, f"larger than {_MAX_BYTES} bytes")
        document = json.loads(data)
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    return document if isinstance(document, dict) else None


def _untrusted(info: os.stat_result) -> str:
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not the agent's"
    if info.st_mode & 0o077:
        return f"mode {stat.S_IMODE(info.st_mode):04o}, not private to the agent"
    return ""


def _parse(entry: object) -> HeldLease | None:
    """One entry, every field checked; None when any is missing or out of range."""
    if not isinstance(entry, dict):
        return None
    lease_id, key = _text(entry.get("id")), _text(entry.get("key"))
    client, grantee = _text(entry.get("client")), _text(entry.get("grantee"))
    acquired = _seconds(entry.get("acquired"))
    pid, uid, gid = (_number(entry.get(name), _MAX_ID) for name in ("pid", "uid", "gid"))
    start_time = _number(entry.get("start_time"), _MAX_TICKS)
    if lease_id is None or not _RESTORED_ID.fullmatch(lease_id):
        return None
    if key is None or not _KEY.fullmatch(key):
        return None
    if client is None or grantee is None or acquired is None:
        return None
    if not pid or uid is None or gid is None or start_time is None:
        return None
    return HeldLease(
        id=lease_id,
        key=key,
        client_name=client,
        grantee=grantee,
        acquired=acquired,
        holder=PeerCredentials(pid=pid, uid=uid, gid=gid, start_time=start_time),
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and len(value) <= _MAX_TEXT else None


def _number(value: object, most: int) -> int | None:
    return value if type(value) is int and 0 <= value <= most else None


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    seconds = float(value)
    return seconds if 0 <= seconds < math.inf else None
