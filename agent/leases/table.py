"""Leases: what keeps a cached snapshot from being evicted while a pod uses it.

A lease is granted by EnsureModel(lease=true) with a TTL. It then lives in one
of two ways:

- **held**: the client connects to the lease socket and sends one JSON line,
  ``{"lease": "<id>", "name": "<optional client name>"}``. The edge
  (``agent.edge.lease_socket``) reads the peer's pid/uid/gid from the kernel
  (SO_PEERCRED: grpc.aio gives no peer credentials on a Unix socket, so this
  socket is how the agent learns who uses a model) and answers one JSON line
  saying whether the connection now holds the lease. The lease lives while
  that connection stays open and ends the moment it closes (clean exit, kill,
  or the pod going away).
- **timed**: a client that cannot keep a connection renews it (RenewLease)
  before it expires, and may release it (ReleaseLease) early.

A lease id is a capability, returned only to the requester of EnsureModel and
never listed. The first process to hold a lease binds it: another process's
hello for it is AccessDenied, and nobody can renew or release it over the API
while it is held. A lease belongs to its grantee, the socket (tenant) whose
EnsureModel asked for it: renewing or releasing it from another socket is
AccessDenied. A grantee may have ``max_per_peer`` live leases; more is
NoSpace. That also bounds what any uid holds open, per tenant: a uid can hold
only leases granted to some socket. (A cap per uid across sockets would let one
tenant's root pods use up every other tenant's root pods' share.)

A *claim* protects a snapshot key from eviction while a request is in
progress, from before its pull publishes to the grant of its lease. Claims and
leases change only on the event loop, and the evictor checks protection right
before it removes each victim, so choosing victims and granting never interleave.

Expiry is evaluated lazily (a heap of expiries) whenever the table is queried,
so no timer task is needed. A renewal pushes a new expiry and leaves the old
entry to be skipped; the heap is rebuilt from the live records whenever it holds
more than twice as many entries as there are leases, so renewing is O(1)
memory, not an entry per call kept for up to a day.
The table raises the agent's own errors; the socket and the API answer them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import heapq
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from agent._exceptions import AccessDenied, Conflict, InvalidRequest, NoSpace, NotFound

__all__ = [
    "MAX_LEASES_PER_PEER",
    "RESTORED_PREFIX",
    "LeaseRecord",
    "LeaseTable",
    "PeerCredentials",
    "lease_tag",
    "restored_id",
]

# Live leases one grantee may have, and leases one uid may hold open: far more
# than a node's pods need, few enough that listing them stays cheap.
MAX_LEASES_PER_PEER = 256
# Enough of an unknown lease id to recognise it in an error, never a whole hostile line.
_ECHOED_ID = 48
# Stale expiry entries tolerated before the heap is rebuilt (beyond two per live lease).
_SPARE_EXPIRIES = 64
# Ids of leases restored after a restart: never a real id (those are url-safe base64).
RESTORED_PREFIX = "restored:"
_TAG_DIGITS = 8
_Item = TypeVar("_Item")

log = logging.getLogger("agent.leases")


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


class LeaseTable:
    """Every live lease of the agent, by id, and the claims of requests in progress.

    ``default_ttl`` is used when a caller gives no TTL (None or 0); a TTL above
    ``max_ttl`` is clamped to ``max_ttl`` (not refused: a client asking for
    "as long as possible" gets the longest allowed). ``max_per_peer`` caps the
    live leases per grantee (held open or not). ``clock``
    returns seconds since the epoch; tests inject a fake one.

    Records are frozen snapshots: a change replaces the record, so what a
    caller got from ``active()`` never changes under it.
    """

    def __init__(
        self,
        default_ttl: float,
        max_ttl: float,
        clock: Callable[[], float] = time.time,
        *,
        max_per_peer: int = MAX_LEASES_PER_PEER,
    ) -> None:
        """An empty table; see the class for the TTLs, the cap and the clock."""
        if not 0 < default_ttl <= max_ttl:
            raise InvalidRequest(
                f"Lease TTLs must satisfy 0 < default ({default_ttl}) <= max ({max_ttl}); "
                "fix the lease settings."
            )
        if max_per_peer < 1:
            raise InvalidRequest(
                f"max_per_peer must be at least 1, not {max_per_peer}; fix the lease settings."
            )
        self._default_ttl = default_ttl
        self._max_ttl = max_ttl
        self._max_per_peer = max_per_peer
        self._clock = clock
        self._records: dict[str, LeaseRecord] = {}
        # Indexes kept with _records, so no query walks every lease.
        self._by_key: dict[str, set[str]] = {}
        self._per_grantee: Counter[str] = Counter()
        # (expiry, id) of timed leases; an entry whose record changed since is skipped.
        self._expiries: list[tuple[float, str]] = []
        self._claims: Counter[str] = Counter()
        # Replaced on every change: waiters take the current event, check
        # their condition, then wait on it (no lock, no lost wake-ups, since
        # everything runs on one event loop).
        self._changed = asyncio.Event()

    @property
    def default_ttl(self) -> float:
        """The TTL of a lease whose request gives none, in seconds."""
        return self._default_ttl

    @property
    def max_ttl(self) -> float:
        """The longest TTL a lease may have, in seconds (longer asks are clamped)."""
        return self._max_ttl

    def check_room(self, grantee: str) -> None:
        """NoSpace when ``grantee`` already has as many live leases as it may."""
        self._purge()
        count = self._per_grantee[grantee]
        if count >= self._max_per_peer:
            raise NoSpace(
                f"This client already has {count} live leases, the most one client may have "
                f"({self._max_per_peer}); release leases it no longer uses (close their "
                "lease connections or call ReleaseLease) before asking for more."
            )

    def grant(
        self, key: str, client_name: str = "", ttl: float | None = None, *, grantee: str = ""
    ) -> LeaseRecord:
        """A new lease on snapshot ``key`` for ``ttl`` seconds (None or 0: the default).

        A TTL above ``max_ttl`` is clamped to it; a negative one is InvalidRequest.
        NoSpace when ``grantee`` is at its cap.
        """
        seconds = self._ttl(ttl)
        self.check_room(grantee)
        now = self._clock()
        record = LeaseRecord(
            id=secrets.token_urlsafe(24),
            key=key,
            client_name=client_name,
            acquired=now,
            expires=now + seconds,
            grantee=grantee,
        )
        self._add(record)
        log.info(
            "lease granted",
            extra={
                "lease": lease_tag(record.id),
                "key": key,
                "client": client_name,
                "ttl": seconds,
            },
        )
        return record

    def renew(
        self, lease_id: str, ttl: float | None = None, *, grantee: str | None = None
    ) -> LeaseRecord:
        """Push the expiry of a lease to ``ttl`` seconds from now (None or 0: the default).

        TTLs are clamped as in ``grant``. A lease held open by a connection
        belongs to that connection: renewing it is AccessDenied. ``grantee``
        (None: anyone) must be the socket that was granted the lease.
        """
        seconds = self._ttl(ttl)
        record = self._granted_to(lease_id, grantee)
        _refuse_if_held(record, "renewed")
        record = dataclasses.replace(record, expires=self._clock() + seconds)
        self._replace(record)
        return record

    def release(self, lease_id: str, *, grantee: str | None = None) -> LeaseRecord:
        """End a timed lease now and return it as it was; a held one is AccessDenied.

        ``grantee`` as in ``renew``.
        """
        record = self._granted_to(lease_id, grantee)
        _refuse_if_held(record, "released")
        self._remove(lease_id)
        log.info("lease released", extra={"lease": lease_tag(lease_id), "key": record.key})
        return record

    def end_all_for(self, key: str) -> list[LeaseRecord]:
        """End every lease on ``key``, held or not: the snapshot itself is gone."""
        return [r for i in list(self._by_key.get(key, ())) if (r := self._remove(i)) is not None]

    def hold(self, lease_id: str, creds: PeerCredentials, client_name: str = "") -> LeaseRecord:
        """Bind a lease to the process ``creds`` (one connection); it no longer expires.

        ``client_name``, when given, replaces the granted one. Held by another
        process: AccessDenied (the holder is not named); by another connection
        of this process: Conflict.
        """
        record = self._take_back(lease_id, creds) or self._get(lease_id)
        if record.held and record.holder is not None:
            if record.holder.pid != creds.pid or record.holder.uid != creds.uid:
                raise AccessDenied(
                    "This lease is held by another process; a lease belongs to the process "
                    "that held it first, for as long as its connection stays open."
                )
            raise Conflict(
                f"Lease {lease_tag(lease_id)} (its tag in the agent's log) is already held by "
                f"another connection of this process (pid {creds.pid}); a lease is held by one "
                "connection at a time."
            )
        record = dataclasses.replace(
            record,
            client_name=client_name or record.client_name,
            expires=None,
            holder=creds,
            held=True,
        )
        self._replace(record)
        return record

    def adopt(self, record: LeaseRecord) -> None:
        """Take in a lease held before the agent restarted, whose holder still runs.

        ``record`` is ``orphaned``, known by its ``restored_id``, with the holder
        it had; it protects its snapshot until that process comes back to the
        lease socket with the lease's id (``hold``), or ends (``unhold``).
        """
        if not record.orphaned or record.holder is None or record.id in self._records:
            raise ValueError(f"not a restorable lease: {record!r}")
        self._add(dataclasses.replace(record, holder=None, held=False))
        self._replace(record)

    def unhold(self, lease_id: str) -> LeaseRecord | None:
        """The holding connection closed: the lease ends now.

        Returns the record that ended, or None if it had gone (its snapshot evicted by force).
        """
        return self._remove(lease_id)

    def get(self, lease_id: str) -> LeaseRecord:
        """One live lease; NotFound if it does not exist or has expired."""
        return self._get(lease_id)

    def active(self) -> list[LeaseRecord]:
        """Every live lease, oldest first."""
        self._purge()
        return sorted(self._records.values(), key=lambda r: (r.acquired, r.id))

    def count(self, grantee: str | None = None) -> int:
        """How many leases are live (of ``grantee`` only, when given)."""
        self._purge()
        return len(self._records) if grantee is None else self._per_grantee[grantee]

    def for_key(self, key: str) -> list[LeaseRecord]:
        """The live leases on one snapshot, oldest first."""
        self._purge()
        records = (self._records[i] for i in self._by_key.get(key, ()))
        return sorted(records, key=lambda r: (r.acquired, r.id))

    def keys_of(self, grantee: str) -> set[str]:
        """The snapshots ``grantee`` (a socket) holds a live lease on."""
        self._purge()
        return {record.key for record in self._records.values() if record.grantee == grantee}

    def leased_keys(self) -> set[str]:
        """Snapshot keys that at least one live lease is on."""
        self._purge()
        return set(self._by_key)

    def protected_keys(self) -> set[str]:
        """Keys eviction must leave alone: leased, or claimed by a request in progress."""
        return self.leased_keys() | self._claims.keys()

    def is_protected(self, key: str) -> bool:
        """Whether ``key`` is leased or claimed right now."""
        return key in self.protected_keys()

    @contextlib.contextmanager
    def claim(self, key: str) -> Iterator[None]:
        """Protect ``key`` from eviction while the block runs (a request's provisional lease)."""
        self._claims[key] += 1
        try:
            yield
        finally:
            _decrement(self._claims, key)

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

    def changes(self) -> asyncio.Event:
        """An event set at the table's next change (take it, read the table, then wait)."""
        return self._changed

    def _take_back(self, lease_id: str, creds: PeerCredentials) -> LeaseRecord | None:
        """The restored lease ``lease_id`` names, handed back to its holder; None if none.

        Only the process that held it before the restart may: the same pid, uid
        and start time (a later process given that pid is someone else).
        """
        if lease_id in self._records:
            return None
        orphan = self._records.get(restored_id(lease_id))
        if orphan is None or orphan.holder is None:
            return None
        if not orphan.holder.same_process(creds):
            raise AccessDenied(
                "This lease is held by another process; a lease belongs to the process "
                "that held it first, for as long as its connection stays open."
            )
        self._remove(orphan.id)
        # Timed until ``hold`` binds it again, so a hold refused now (the uid's cap)
        # leaves nothing behind for ever.
        expires = self._clock() + self._default_ttl
        record = dataclasses.replace(
            orphan, id=lease_id, holder=None, held=False, orphaned=False, expires=expires
        )
        self._add(record)
        log.info(
            "lease taken back by its holder after a restart",
            extra={"key": record.key, "client": record.client_name, "pid": creds.pid},
        )
        return record

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
                f"Lease {_echo(lease_id)} does not exist or has expired; ask for a new one with "
                "EnsureModel(lease=true), and renew it before it expires or hold it open on "
                "the lease socket."
            )
        return record

    def _granted_to(self, lease_id: str, grantee: str | None) -> LeaseRecord:
        record = self._get(lease_id)
        if grantee is not None and record.grantee != grantee:
            raise AccessDenied(
                "This lease was granted to a request on another socket, and only that socket "
                "may renew or release it; ask for a lease of your own with "
                "EnsureModel(lease=true) on this socket."
            )
        return record

    def _add(self, record: LeaseRecord) -> None:
        self._records[record.id] = record
        self._by_key.setdefault(record.key, set()).add(record.id)
        self._per_grantee[record.grantee] += 1
        self._index_expiry(record)
        self._notify()

    def _replace(self, record: LeaseRecord) -> None:
        self._records[record.id] = record
        self._index_expiry(record)
        self._notify()

    def _remove(self, lease_id: str) -> LeaseRecord | None:
        record = self._records.pop(lease_id, None)
        if record is None:
            return None
        ids = self._by_key[record.key]
        ids.discard(lease_id)
        if not ids:
            del self._by_key[record.key]
        _decrement(self._per_grantee, record.grantee)
        self._notify()
        return record

    def _index_expiry(self, record: LeaseRecord) -> None:
        if record.expires is None:
            return
        heapq.heappush(self._expiries, (record.expires, record.id))
        if len(self._expiries) > 2 * len(self._records) + _SPARE_EXPIRIES:
            # Mostly entries that renewals left behind: keep one per timed lease.
            self._expiries = [
                (r.expires, r.id) for r in self._records.values() if r.expires is not None
            ]
            heapq.heapify(self._expiries)

    def _purge(self) -> None:
        now = self._clock()
        while self._expiries and self._expiries[0][0] <= now:
            expires, lease_id = heapq.heappop(self._expiries)
            record = self._records.get(lease_id)
            if record is None or record.expires != expires:
                continue  # ended, renewed or held since this entry was pushed
            self._remove(lease_id)
            log.info(
                "lease expired",
                extra={
                    "lease": lease_tag(record.id),
                    "key": record.key,
                    "client": record.client_name,
                },
            )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _refuse_if_held(record: LeaseRecord, what: str) -> None:
    if record.held:
        raise AccessDenied(
            f"This lease is held open on the lease socket, so it cannot be {what} over the "
            "API: it lives exactly as long as its holder's connection, and ends when that "
            "connection closes."
        )


def _decrement(counter: Counter[_Item], item: _Item) -> None:
    counter[item] -= 1
    if counter[item] <= 0:
        del counter[item]


def _echo(lease_id: str) -> str:
    shown = lease_id[:_ECHOED_ID]
    return repr(shown) + ("..." if len(lease_id) > _ECHOED_ID else "")
