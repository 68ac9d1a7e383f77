"""Leases: what keeps a cached snapshot from being evicted while a pod uses it.

A lease is granted by EnsureModel(lease=true) with a TTL. It then lives in one
of two ways:

- **held**: the client connects to the lease socket and sends one JSON line,
  ``{"lease": "<id>", "name": "<optional client name>"}``. The edge
  (``agent.edge.lease_socket``) reads the peer's pid/uid/gid from the kernel
  (SO_PEERCRED: grpc.aio gives no peer credentials on a Unix socket, so this
  socket is how the agent learns who uses a model) and answers one JSON line
  saying whether the connection now holds the lease. The lease lives while
  that connection stays open and ends the moment it closes, whether the
  client exited cleanly, was killed, or its pod went away.
- **timed**: a client that cannot keep a connection renews it (RenewLease)
  before it expires, and may release it (ReleaseLease) early.

Expiry is evaluated lazily against the clock whenever the table is queried, so
no timer task is needed; expired records are dropped when seen.

This module is the table only: it raises the agent's own errors, and the
socket and the API decide how to answer them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent._exceptions import Conflict, InvalidRequest, NotFound

__all__ = [
    "LeaseRecord",
    "LeaseTable",
    "PeerCredentials",
]

log = logging.getLogger("agent.leases")


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


class LeaseTable:
    """Every live lease of the agent, by id.

    ``default_ttl`` is used when a caller gives no TTL (None or 0); a TTL above
    ``max_ttl`` is clamped to ``max_ttl`` (not refused: a client asking for
    "as long as possible" gets the longest allowed). ``clock`` returns seconds
    since the epoch; tests inject a fake one.

    Records are frozen snapshots: a change replaces the record, so what a
    caller got from ``active()`` never changes under it.
    """

    def __init__(
        self,
        default_ttl: float,
        max_ttl: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < default_ttl <= max_ttl:
            raise InvalidRequest(
                f"Lease TTLs must satisfy 0 < default ({default_ttl}) <= max ({max_ttl}); "
                "fix the lease settings."
            )
        self._default_ttl = default_ttl
        self._max_ttl = max_ttl
        self._clock = clock
        self._records: dict[str, LeaseRecord] = {}
        # Replaced on every change: waiters take the current event, check
        # their condition, then wait on it (no lock, no lost wake-ups, since
        # everything runs on one event loop).
        self._changed = asyncio.Event()

    @property
    def default_ttl(self) -> float:
        return self._default_ttl

    @property
    def max_ttl(self) -> float:
        return self._max_ttl

    def grant(self, key: str, client_name: str = "", ttl: float | None = None) -> LeaseRecord:
        """A new lease on snapshot ``key`` for ``ttl`` seconds (None or 0: the default).

        A TTL above ``max_ttl`` is clamped to it; a negative one is InvalidRequest.
        """
        seconds = self._ttl(ttl)
        now = self._clock()
        record = LeaseRecord(
            id=secrets.token_urlsafe(16),
            key=key,
            client_name=client_name,
            acquired=now,
            expires=now + seconds,
        )
        self._records[record.id] = record
        self._notify()
        log.info(
            "lease granted",
            extra={"lease": record.id, "key": key, "client": client_name, "ttl": seconds},
        )
        return record

    def renew(self, lease_id: str, ttl: float | None = None) -> LeaseRecord:
        """Push the expiry of a lease to ``ttl`` seconds from now (None or 0: the default).

        TTLs are clamped as in ``grant``. A lease held open by a connection has
        no expiry and is returned unchanged: it lives as long as the connection.
        """
        seconds = self._ttl(ttl)
        record = self._get(lease_id)
        if record.held:
            return record
        record = dataclasses.replace(record, expires=self._clock() + seconds)
        self._records[lease_id] = record
        self._notify()
        return record

    def release(self, lease_id: str) -> LeaseRecord:
        """End a lease now and return it as it was."""
        record = self._get(lease_id)
        del self._records[lease_id]
        self._notify()
        log.info("lease released", extra={"lease": lease_id, "key": record.key})
        return record

    def hold(self, lease_id: str, creds: PeerCredentials, client_name: str = "") -> LeaseRecord:
        """Mark a lease as held open by the process ``creds``; it no longer expires.

        ``client_name``, when given, replaces the name the lease was granted
        with. A lease that another connection already holds is a Conflict.
        """
        record = self._get(lease_id)
        if record.held:
            holder = record.holder
            raise Conflict(
                f"Lease {lease_id} is already held by another connection"
                + (f" (pid {holder.pid})" if holder else "")
                + "; a lease is held by one connection at a time."
            )
        record = dataclasses.replace(
            record,
            client_name=client_name or record.client_name,
            expires=None,
            holder=creds,
            held=True,
        )
        self._records[lease_id] = record
        self._notify()
        return record

    def unhold(self, lease_id: str) -> LeaseRecord | None:
        """The holding connection closed: the lease ends now.

        Returns the record that ended, or None when it had already gone (e.g.
        released over the API while the connection was still open).
        """
        record = self._records.pop(lease_id, None)
        if record is not None:
            self._notify()
        return record

    def get(self, lease_id: str) -> LeaseRecord:
        """One live lease; NotFound if it does not exist or has expired."""
        return self._get(lease_id)

    def active(self) -> list[LeaseRecord]:
        """Every live lease, oldest first."""
        self._purge()
        return sorted(self._records.values(), key=lambda r: (r.acquired, r.id))

    def for_key(self, key: str) -> list[LeaseRecord]:
        """The live leases on one snapshot, oldest first."""
        return [r for r in self.active() if r.key == key]

    def leased_keys(self) -> set[str]:
        """Snapshot keys that at least one live lease protects from eviction."""
        return {r.key for r in self.active()}

    async def wait_released(self, lease_id: str) -> None:
        """Return once ``lease_id`` is gone: released, its connection closed, or expired."""
        while True:
            changed = self._changed
            self._purge()
            record = self._records.get(lease_id)
            if record is None:
                return
            if record.expires is None:
                await changed.wait()
                continue
            # Nothing changes the table when a timed lease runs out, so wake
            # up at its expiry as well as on the next change.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, record.expires - self._clock())):
                    await changed.wait()

    def _ttl(self, ttl: float | None) -> float:
        if ttl is None or ttl == 0:
            return self._default_ttl
        if math.isnan(ttl) or ttl < 0:
            raise InvalidRequest(
                f"A lease TTL of {ttl} seconds is not allowed; give a positive number of "
                "seconds, or 0 for the agent's default."
            )
        return min(ttl, self._max_ttl)

    def _get(self, lease_id: str) -> LeaseRecord:
        self._purge()
        record = self._records.get(lease_id)
        if record is None:
            raise NotFound(
                f"Lease {lease_id!r} does not exist or has expired; ask for a new one with "
                "EnsureModel(lease=true), and renew it before it expires or hold it open on "
                "the lease socket."
            )
        return record

    def _purge(self) -> None:
        now = self._clock()
        expired = [r for r in self._records.values() if r.expires is not None and r.expires <= now]
        for record in expired:
            del self._records[record.id]
            log.info(
                "lease expired",
                extra={"lease": record.id, "key": record.key, "client": record.client_name},
            )
        if expired:
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
