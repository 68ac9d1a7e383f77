"""Leases: what keeps a cached snapshot from being evicted while a pod uses it.

A lease is granted by EnsureModel(lease=true) with a TTL. It then lives in one
of two ways:

- **held**: the client connects to the lease socket and sends one JSON line,
  ``{"lease": "<id>", "name": "<optional client name>"}``. The agent reads the
  peer's pid/uid/gid with SO_PEERCRED (grpc.aio gives no peer credentials on a
  Unix socket, so this socket is how the agent learns who uses a model) and
  answers one JSON line, ``{"ok": true, "key": "<snapshot key>"}`` or
  ``{"ok": false, "error": "<sentence>", "code": "<gRPC status name>"}``. The
  lease lives while that connection stays open and ends the moment it closes,
  whether the client exited cleanly, was killed, or its pod went away.
- **timed**: a client that cannot keep a connection renews it (RenewLease)
  before it expires, and may release it (ReleaseLease) early.

Expiry is evaluated lazily against the clock whenever the table is queried, so
no timer task is needed; expired records are dropped when seen.

Nothing here knows about gRPC: the API layer calls ``LeaseTable`` and maps its
errors; the daemon owns one ``LeaseServer``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import json
import logging
import math
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

from agent._exceptions import Conflict, InvalidRequest, NotFound, PrewarmError

__all__ = [
    "DEFAULT_LEASE_SOCKET_PATH",
    "HELLO_LIMIT",
    "HELLO_TIMEOUT_SECONDS",
    "LeaseRecord",
    "LeaseServer",
    "LeaseTable",
    "PeerCredentials",
]

log = logging.getLogger("agent.leases")

DEFAULT_LEASE_SOCKET_PATH = Path("/run/prewarm/lease.sock")
# The hello is one short JSON line; anything longer is not a prewarm client.
HELLO_LIMIT = 4096
# A client that connects and says nothing must not pin a connection forever.
HELLO_TIMEOUT_SECONDS = 5.0

_PEERCRED = struct.Struct("3i")
# Error replies carry the gRPC status name of the same failure over the API,
# so a client maps both to one error class.
_CODE_BY_ERROR: tuple[tuple[type[PrewarmError], str], ...] = (
    (InvalidRequest, "INVALID_ARGUMENT"),
    (NotFound, "NOT_FOUND"),
    (Conflict, "FAILED_PRECONDITION"),
)


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


class LeaseServer:
    """Serves the lease socket: a connection that sent a valid hello holds its lease.

    ``mode`` and ``group`` secure the socket file as the API socket is secured
    (``group`` is a group name; empty keeps the daemon's group). A connection
    must send its hello within ``hello_timeout`` seconds. On exit the
    server stops accepting, closes every connection (the leases they held end:
    the daemon is going away, and the table with it) and removes the socket.
    """

    def __init__(
        self,
        table: LeaseTable,
        path: Path,
        mode: int = 0o660,
        group: str = "",
        *,
        hello_timeout: float = HELLO_TIMEOUT_SECONDS,
    ) -> None:
        self._table = table
        self._hello_timeout = hello_timeout
        self._path = Path(path)
        self._mode = mode
        self._group = group
        self._server: asyncio.Server | None = None
        self._inode: int | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def path(self) -> Path:
        return self._path

    @property
    def table(self) -> LeaseTable:
        return self._table

    def connection_count(self) -> int:
        """Connections open now, whether or not they hold a lease yet."""
        return len(self._handlers)

    async def __aenter__(self) -> Self:
        gid = _group_id(self._group)
        _clear_stale_socket(self._path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Bind with a tight umask so the socket is never reachable by
            # others, even briefly. Binding here, not inside
            # start_unix_server, keeps the umask change free of any await,
            # where other tasks would create files under it.
            old_umask = os.umask(0o177)
            try:
                sock.bind(str(self._path))
            finally:
                os.umask(old_umask)
            self._inode = self._path.stat().st_ino
            if gid is not None:
                os.chown(self._path, -1, gid)
            self._path.chmod(self._mode)
            self._server = await asyncio.start_unix_server(
                self._serve_connection, sock=sock, limit=HELLO_LIMIT
            )
        except BaseException:
            sock.close()
            self._remove_socket_file()
            raise
        log.info("lease socket serving", extra={"socket": str(self._path)})
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closing = True
        try:
            if self._server is not None:
                self._server.close()
            # A connection accepted just before close() starts its handler
            # afterwards; it sees _closing and ends at once, and the next
            # round of this loop still awaits it.
            while self._handlers:
                handlers = list(self._handlers)
                for task in handlers:
                    task.cancel()
                await asyncio.gather(*handlers, return_exceptions=True)
            if self._server is not None:
                await self._server.wait_closed()
        finally:
            self._remove_socket_file()
            log.info("lease socket closed", extra={"socket": str(self._path)})

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        held: str | None = None
        try:
            if self._closing:
                return
            creds = _peer_credentials(writer)
            try:
                lease_id, name = await _read_hello(reader, self._hello_timeout)
                record = self._table.hold(lease_id, creds, name)
            except PrewarmError as exc:
                log.info(
                    "lease hello refused: %s",
                    exc,
                    extra={"pid": creds.pid, "uid": creds.uid, "gid": creds.gid},
                )
                await _reply(writer, {"ok": False, "error": str(exc), "code": _code_for(exc)})
                return
            held = record.id
            log.info(
                "lease held",
                extra={
                    "lease": record.id,
                    "key": record.key,
                    "client": record.client_name,
                    "pid": creds.pid,
                    "uid": creds.uid,
                    "gid": creds.gid,
                },
            )
            await _reply(writer, {"ok": True, "key": record.key})
            await _until_eof(reader)
        except ConnectionError:
            pass  # the peer went away mid-reply: the same as closing
        finally:
            if held is not None:
                ended = self._table.unhold(held)
                if ended is not None:
                    holder = ended.holder
                    log.info(
                        "lease released: its connection closed",
                        extra={
                            "lease": held,
                            "key": ended.key,
                            "pid": holder.pid if holder else None,
                        },
                    )
            try:
                writer.close()
                # Returns within one loop turn; the close above already freed
                # the socket even if this wait is cut short.
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
            finally:
                self._handlers.discard(task)

    def _remove_socket_file(self) -> None:
        # Only our own socket: a newer daemon may already have bound the path.
        with contextlib.suppress(FileNotFoundError):
            if self._inode is not None and self._path.stat().st_ino == self._inode:
                self._path.unlink()


def _peer_credentials(writer: asyncio.StreamWriter) -> PeerCredentials:
    sock = writer.get_extra_info("socket")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


async def _read_hello(reader: asyncio.StreamReader, limit_s: float) -> tuple[str, str]:
    """The lease id and client name of the one-line hello; InvalidRequest if it is not one."""
    usage = 'send one JSON line, {"lease": "<id>", "name": "<optional client name>"}'
    try:
        async with asyncio.timeout(limit_s):
            line = await reader.readuntil(b"\n")
    except TimeoutError:
        raise InvalidRequest(
            f"No hello within {limit_s:g} s: {usage} right after connecting."
        ) from None
    except asyncio.LimitOverrunError:
        raise InvalidRequest(f"The hello is longer than {HELLO_LIMIT} bytes: {usage}.") from None
    except asyncio.IncompleteReadError:
        raise InvalidRequest(f"The connection ended before a full hello line: {usage}.") from None
    try:
        hello = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidRequest(f"The hello is not JSON: {usage}.") from None
    if not isinstance(hello, dict):
        raise InvalidRequest(f"The hello is not a JSON object: {usage}.")
    lease_id, name = hello.get("lease"), hello.get("name", "")
    if not isinstance(lease_id, str) or not lease_id:
        raise InvalidRequest(f'The hello has no "lease" string: {usage}.')
    if not isinstance(name, str):
        raise InvalidRequest(f'The hello\'s "name" is not a string: {usage}.')
    # Other fields are ignored, so a newer client can say more to an older agent.
    return lease_id, name


async def _reply(writer: asyncio.StreamWriter, document: dict[str, object]) -> None:
    writer.write(json.dumps(document).encode() + b"\n")
    await writer.drain()


async def _until_eof(reader: asyncio.StreamReader) -> None:
    # Bytes after the hello are read and dropped (room for future keep-alives);
    # the lease lives until the peer's end closes.
    while await reader.read(HELLO_LIMIT):
        pass


def _code_for(error: PrewarmError) -> str:
    for error_type, code in _CODE_BY_ERROR:
        if isinstance(error, error_type):
            return code
    return "INTERNAL"


def _group_id(group: str) -> int | None:
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidRequest(
            f"socket_group {group!r} does not exist; create it (groupadd {group}) or "
            "leave socket_group empty."
        ) from None


def _clear_stale_socket(path: Path) -> None:
    """Make the directory; remove a socket a dead daemon left; refuse anything else."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise Conflict(f"{path} exists and is not a socket; remove it or choose another path.")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # A listener with a full backlog makes connect() wait; it is alive all the same.
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)  # nobody listens: left behind by a daemon that died
        return
    except TimeoutError:
        pass
    finally:
        probe.close()
    raise Conflict(
        f"Another process is already serving leases on {path}. Stop it first "
        "(systemctl stop prewarmd) or choose another lease socket path."
    )
