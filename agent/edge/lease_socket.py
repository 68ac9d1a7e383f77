"""The lease socket: a connection that sent a valid hello holds its lease.

The protocol is described in ``agent.store.leases``; this module is its
network side (accepting connections, reading the hello, SO_PEERCRED).
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import logging
import os
import socket
import stat
import struct
from pathlib import Path
from types import TracebackType
from typing import Self

from agent._exceptions import Conflict, InvalidRequest, NotFound, PrewarmError
from agent.store.leases import HELLO_LIMIT, HELLO_TIMEOUT_SECONDS, LeaseTable, PeerCredentials

__all__ = ["LeaseServer"]

log = logging.getLogger("agent.leases")

_PEERCRED = struct.Struct("3i")
# Error replies carry the gRPC status name of the same failure over the API,
# so a client maps both to one error class.
_CODE_BY_ERROR: tuple[tuple[type[PrewarmError], str], ...] = (
    (InvalidRequest, "INVALID_ARGUMENT"),
    (NotFound, "NOT_FOUND"),
    (Conflict, "FAILED_PRECONDITION"),
)


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
