"""What the lease table keeps about each lease, and who is on the other end of a lease socket."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = ["RESTORED_PREFIX", "LeaseRecord", "PeerCredentials", "lease_tag", "restored_id"]

# Ids of leases restored after a restart: never a real id (those are url-safe base64).
RESTORED_PREFIX = "restored:"
_TAG_DIGITS = 8


def lease_tag(lease_id: str) -> str:
    """What logs call a lease: 8 hex digits of its id's SHA-256.

    A lease id is a capability (whoever knows it may hold it), and logs travel
    further than the API does; the tag follows one lease through the log and
    cannot be turned back into its id.
    """
    return hashlib.sha256(lease_id.encode()).hexdigest()[:_TAG_DIGITS]


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The process on the other end of a Unix socket, as the kernel reports it."""

    pid: int
    uid: int
    gid: int
    # When the process started (clock ticks after boot): with the pid, names it
    # apart from a later process given the same pid. None: not known here. Left out
    # of ==, which compares what SO_PEERCRED reports; ``same_process`` compares all.
    start_time: int | None = field(default=None, compare=False)

    def same_process(self, other: PeerCredentials) -> bool:
        """The same process as ``other``: pid, uid and a known start time all equal."""
        return self.start_time is not None and (self.pid, self.uid, self.start_time) == (
            other.pid,
            other.uid,
            other.start_time,
        )


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """One lease, as of the moment it was read from the table."""

    id: str
    key: str
    client_name: str
    # Seconds since the epoch (the table's clock).
    acquired: float
    # When the lease ends unless renewed; None while a connection holds it.
    expires: float | None
    # Who holds the lease connection; None while nobody does.
    holder: PeerCredentials | None = None
    held: bool = False
    # The socket (tenant) whose EnsureModel asked for it ("" in-process): only that
    # socket may renew or release it, and its leases count against its cap.
    grantee: str = ""
    # Held before the agent restarted by a process still alive, which has not come
    # back to the lease socket yet (its id is then ``restored_id`` of the real one).
    orphaned: bool = False


def restored_id(lease_id: str) -> str:
    """What a held lease is known by on disk and after a restart: a hash, never the id.

    The id is a capability; only its holder, who still has it, can name the
    restored lease again (and must be the same process to take it back).
    """
    return RESTORED_PREFIX + hashlib.sha256(lease_id.encode()).hexdigest()
