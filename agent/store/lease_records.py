"""What the lease table keeps about each lease, and who is on the other end of a lease socket."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LeaseRecord", "PeerCredentials"]


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The process on the other end of a Unix socket, as the kernel reports it."""

    pid: int
    uid: int
    gid: int


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
