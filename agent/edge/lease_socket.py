"""The lease socket: a connection that sent a valid hello holds its lease.

A client connects and sends one JSON line, ``{"lease": "<id>", "name":
"<optional client name>"}``; the agent reads the peer's pid/uid/gid with
SO_PEERCRED and answers one JSON line, ``{"ok": true, "key": "<snapshot key>"}``
or ``{"ok": false, "error": "<sentence>", "code": "<status name>"}`` (the same
status name the API would give for that error). The lease lives while the
connection stays open. The first process to hold a lease binds it: a hello for
it from another process is PERMISSION_DENIED (from another connection of the
same process FAILED_PRECONDITION). When the client half-closes, the agent ends the
lease and then closes its end, so the client can wait for that. What a lease
means is ``agent.leases.table``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
from collections import Counter
from pathlib import Path
from types import TracebackType
from typing import Self

from agent._exceptions import InvalidRequest, NoSpace, PrewarmError
from agent.edge.request_limits import check_text
from agent.edge.status import status_detail
from agent.edge.unix_socket import (
    SocketDirectory,
    clear_stale_socket,
    owner_only_umask,
    socket_group_id,
)
from agent.leases.holders import start_time_of_peer
from agent.leases.table import LeaseTable, PeerCredentials, lease_tag

__all__ = [
    "HELLO_LIMIT",
    "HELLO_TIMEOUT_SECONDS",
    "MAX_PENDING",
    "MAX_PENDING_PER_UID",
    "POST_HELLO_LIMIT",
    "LeaseServer",
]

# The hello is one short JSON line; anything longer is not a prewarm client.
HELLO_LIMIT = 4096
# A client that connects and says nothing must not pin a connection forever.
HELLO_TIMEOUT_SECONDS = 5.0
# Connections still owing their hello, per uid in one cgroup (a container, on a
# Kubernetes node: pods of every tenant often run as root) and in all: each holds
# a descriptor of the agent's, and silent peers must not use them all up before
# their timeout.
MAX_PENDING_PER_UID = 32
MAX_PENDING = 256
# Bytes a holder may send after its hello (room for keep-alives): every byte is read
# on the event loop that answers the API, so a flood ends the connection.
POST_HELLO_LIMIT = 64 * 1024

log = logging.getLogger("agent.leases")

_PEERCRED = struct.Struct("3i")
# A process's cgroup list is a few lines; more is never needed to tell containers apart.
_CGROUP_BYTES = 4096


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
        self._directory: SocketDirectory | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._pending: Counter[tuple[int, str]] = Counter()
        self._closing = False
        self._ended_by_shutdown = 0

    @property
    def path(self) -> Path:
        """Where the lease socket listens."""
        return self._path

    @property
    def table(self) -> LeaseTable:
        """The lease table whose leases are held on this socket."""
        return self._table

    def connection_count(self) -> int:
        """Connections open now, whether or not they hold a lease yet."""
        return len(self._handlers)

    async def __aenter__(self) -> Self:
        """Bind the socket (owner-only, then its mode and group) and start serving."""
        gid = socket_group_id(self._group)
        clear_stale_socket(self._path, "leases")
        self._directory = SocketDirectory(self._path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Bound here, not inside start_unix_server, so that no await
            # happens under the umask.
            with owner_only_umask():
                sock.bind(self._directory.bind_address)
            self._inode = self._directory.secure(self._mode, gid)
            self._server = await asyncio.start_unix_server(
                self._accept, sock=sock, limit=HELLO_LIMIT
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
        """Stop serving, close held connections and remove the socket."""
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
            # One line for every lease the shutdown ended, not one each.
            ended = self._ended_by_shutdown
            log.info(
                "lease socket closed: %d lease%s held open ended with it",
                ended,
                "" if ended == 1 else "s",
                extra={"socket": str(self._path), "leases_ended": ended},
            )

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback, not a coroutine: the connection's task is then the server's own.
        # For a coroutine, asyncio 3.11 adds a done-callback that calls task.exception(),
        # which raises for a cancelled task and logs a traceback per connection at shutdown.
        task = asyncio.get_running_loop().create_task(self._serve_connection(reader, writer))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        held: str | None = None
        try:
            if self._closing:
                return
            creds = _peer_credentials(writer)
            peer = (creds.uid, _cgroup_of(creds.pid))
            try:
                self._admit(creds, peer)
                self._pending[peer] += 1
                try:
                    lease_id, name = await _read_hello(reader, self._hello_timeout)
                finally:
                    self._pending[peer] -= 1
                    if self._pending[peer] <= 0:
                        del self._pending[peer]
                record = self._table.hold(lease_id, creds, name)
            except PrewarmError as exc:
                log.info(
                    "lease hello refused: %s",
                    exc,
                    extra={"pid": creds.pid, "uid": creds.uid, "gid": creds.gid},
                )
                # The status name the API would answer the same failure with.
                await _reply(writer, {"ok": False, "error": status_detail(exc), "code": exc.status})
                return
            held = record.id
            log.info(
                "lease held",
                extra={
                    "lease": lease_tag(record.id),
                    "key": record.key,
                    "client": record.client_name,
                    "pid": creds.pid,
                    "uid": creds.uid,
                    "gid": creds.gid,
                },
            )
            await _reply(writer, {"ok": True, "key": record.key})
            if not await _until_eof(reader):
                log.warning(
                    "lease connection cut off: it sent more than %d bytes after its hello",
                    POST_HELLO_LIMIT,
                    extra={"lease": lease_tag(record.id), "pid": creds.pid, "uid": creds.uid},
                )
        except ConnectionError:
            pass  # the peer went away mid-reply: the same as closing
        finally:
            if held is not None:
                self._end(held)
            writer.close()
            # Returns within one loop turn; the close above already freed
            # the socket even if this wait is cut short.
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _end(self, lease_id: str) -> None:
        """The holding connection closed: end its lease (counted, not logged, at shutdown)."""
        ended = self._table.unhold(lease_id)
        if ended is None:
            return
        if self._closing:
            self._ended_by_shutdown += 1
            return
        holder = ended.holder
        log.info(
            "lease released: its connection closed",
            extra={
                "lease": lease_tag(lease_id),
                "key": ended.key,
                "pid": holder.pid if holder else None,
            },
        )

    def _admit(self, creds: PeerCredentials, peer: tuple[int, str]) -> None:
        """NoSpace when too many connections, of this peer or in all, still owe their hello."""
        mine, total = self._pending[peer], self._pending.total()
        if mine >= MAX_PENDING_PER_UID or total >= MAX_PENDING:
            raise NoSpace(
                f"Too many lease connections are waiting to send their hello ({mine} of uid "
                f"{creds.uid} in this container, {total} in all; at most {MAX_PENDING_PER_UID} "
                f"per uid in a container and {MAX_PENDING} in all). Send the hello right after "
                "connecting, and close connections you do not use."
            )

    def _remove_socket_file(self) -> None:
        if self._directory is not None:
            self._directory.remove_own(self._inode)
            self._directory.close()
            self._directory = None


def _peer_credentials(writer: asyncio.StreamWriter) -> PeerCredentials:
    """The peer's pid/uid/gid (SO_PEERCRED) and its start time, which names it across restarts."""
    sock = writer.get_extra_info("socket")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    started = start_time_of_peer(sock, pid)
    return PeerCredentials(pid=pid, uid=uid, gid=gid, start_time=started)


def _cgroup_of(pid: int) -> str:
    """The cgroups of process ``pid`` (its container, on a node), "" when they cannot be read.

    A peer in another pid namespace the agent cannot see has pid 0; one that
    exited since it connected has nothing to read. Its uid alone keys it then.
    """
    if pid <= 0:
        return ""
    try:
        with Path(f"/proc/{pid}/cgroup").open("rb") as listing:
            return listing.read(_CGROUP_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""


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
    # The same limits as the API's fields: the name is logged and listed by `prewarm show`.
    check_text(lease_id, "hello.lease", like="id")
    check_text(name, "hello.name", like="client_name")
    # Other fields are ignored, so a newer client can say more to an older agent.
    return lease_id, name


async def _reply(writer: asyncio.StreamWriter, document: dict[str, object]) -> None:
    writer.write(json.dumps(document).encode() + b"\n")
    await writer.drain()


async def _until_eof(reader: asyncio.StreamReader) -> bool:
    """Wait for the peer's end to close: True then, False once it sent too much."""
    # Bytes after the hello are read and dropped (room for future keep-alives);
    # the lease lives until the peer's end closes.
    received = 0
    while chunk := await reader.read(HELLO_LIMIT):
        received += len(chunk)
        if received > POST_HELLO_LIMIT:
            return False
    return True
