"""Holding a lease open on the agent's lease socket, for as long as a block runs.

The protocol: connect to the lease socket, send one JSON line
``{"lease": "<id>", "name": "<client name>"}``, read one JSON line back,
``{"ok": true, "key": ...}`` or ``{"ok": false, "error": ..., "code": ...}``.
From then on the lease lives exactly as long as the connection: when this
process closes it, exits or is killed, the kernel closes the socket and the
agent ends the lease at once. Nothing is sent after the hello, so holding
costs no thread and no timer: the open socket is the whole mechanism.

``close()`` half-closes the connection and waits (up to the timeout) for the
agent to close its end, which it does once the lease has ended: when close
returns and ``ended`` is True, the lease is over on the agent too, so nothing
needs releasing; a ReleaseLease after it would only be answered NotFound (and
counted as a failed request). ``ended`` stays False when the hold never opened
or the agent did not confirm in time: then a ReleaseLease is what ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Generic, Self, TypeVar

from agent._exceptions import AgentUnavailable, PrewarmError

from ._closing import ClosedOnAsyncExit, ClosedOnExit
from ._errors import error_for_code
from ._types import LeaseGrant

__all__ = ["AsyncLeaseHold", "LeaseHold"]

# The agent reads at most this much of a hello, and answers in one short line.
_LINE_LIMIT = 4096
_DEFAULT_TIMEOUT = 5.0
# What stays open while the lease is held: a socket, or an asyncio stream's writer.
Connection = TypeVar("Connection")


class _Hold(Generic[Connection]):
    """What the sync and async holders share: the state, the hello, the reply, the errors."""

    def __init__(
        self,
        lease: LeaseGrant,
        *,
        name: str = "",
        socket_path: str | os.PathLike[str] | None = None,
        timeout: float = _DEFAULT_TIMEOUT,
    ) -> None:
        self._lease = lease
        self._name = name
        self._socket_path = Path(socket_path) if socket_path is not None else lease.socket_path
        self._timeout = timeout
        self._connection: Connection | None = None
        self._ended = False

    @property
    def lease(self) -> LeaseGrant:
        return self._lease

    @property
    def socket_path(self) -> Path:
        return self._socket_path

    @property
    def held(self) -> bool:
        """True from a successful ``open()`` until ``close()``."""
        return self._connection is not None

    @property
    def ended(self) -> bool:
        """True once ``close()`` saw the agent end the lease (it closed its end)."""
        return self._ended

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(lease={self._lease.id!r}, key={self._lease.key!r}, "
            f"socket_path={str(self._socket_path)!r})"
        )

    def _refuse_second_open(self) -> None:
        if self._connection is not None:
            raise PrewarmError(
                f"lease {self._lease.id} is already held by this {type(self).__name__}."
            )

    def _hello(self) -> bytes:
        return json.dumps({"lease": self._lease.id, "name": self._name}).encode() + b"\n"

    def _check_reply(self, line: bytes) -> None:
        where = f"the prewarm agent's lease socket {self._socket_path}"
        if not line.endswith(b"\n") and len(line) < _LINE_LIMIT:
            raise AgentUnavailable(
                f"{where} closed the connection without answering the hello for lease "
                f"{self._lease.id}; the agent may be stopping: check `systemctl status prewarmd`."
            )
        try:
            reply = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            reply = None
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            raise PrewarmError(
                f"{where} answered {line[:200]!r}, not a lease reply; the client and the "
                "agent may be different versions."
            )
        if not reply["ok"]:
            message = str(reply.get("error") or "the agent refused the lease without a reason")
            raise error_for_code(str(reply.get("code", "")), message)

    @contextlib.contextmanager
    def _speaking(self) -> Iterator[None]:
        """Failures to connect, send or read, as AgentUnavailable with what to do about them."""
        try:
            yield
        except OSError as exc:
            raise self._unavailable(exc) from exc

    def _unavailable(self, exc: OSError) -> AgentUnavailable:
        path = self._socket_path
        if isinstance(exc, FileNotFoundError):
            return AgentUnavailable(
                f"there is no prewarm lease socket at {path}: the agent is not running, or it "
                "is older than this client, or its directory is mounted elsewhere in this "
                "pod (pass socket_path)."
            )
        if isinstance(exc, PermissionError):
            return AgentUnavailable(
                f"permission denied on the prewarm lease socket {path}: run as a member of "
                "the socket's group (see socket_group in /etc/prewarm/agent.toml) or as root."
            )
        if isinstance(exc, ConnectionRefusedError):
            return AgentUnavailable(
                f"nobody is listening on the prewarm lease socket {path} (connection refused): "
                "start the agent (systemctl start prewarmd)."
            )
        if isinstance(exc, TimeoutError):
            return AgentUnavailable(
                f"the prewarm agent did not answer on its lease socket {path} within "
                f"{self._timeout:g} s; it may be overloaded or stuck."
            )
        return AgentUnavailable(f"cannot hold the lease on {path}: {exc}.")


class LeaseHold(_Hold[socket.socket], ClosedOnExit):
    """Holds a lease open on the agent's lease socket until closed; blocking.

    ``with LeaseHold(handle.lease, name="ns/pod"):`` the snapshot is not evicted
    inside the block, and the lease ends when the block exits (or when this
    process dies, whichever comes first). ``socket_path`` overrides the path
    the agent named (``Client.leased`` finds it next to the API socket);
    ``timeout`` bounds the connect and the reply. An unknown or expired lease
    raises ``NotFound``; one another process holds ``AccessDenied``, one another
    connection of this process holds ``Conflict``.

    A child made by ``fork()`` without ``exec`` shares the open connection: the
    lease lasts while either process has it open, until ``close()`` here ends
    it for both (a child that outlives the block should hold its own lease).
    """

    def __enter__(self) -> Self:
        self.open()
        return self

    def open(self) -> None:
        """Connect, send the hello, check the reply; the lease is held when this returns."""
        self._refuse_second_open()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout)
            with self._speaking():
                sock.connect(str(self._socket_path))
                sock.sendall(self._hello())
                line = _receive_line(sock)
            self._check_reply(line)
            # From here on nothing is read or written: the socket only has to
            # stay open. Blocking mode, so nothing times out while held.
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self._connection = sock

    def close(self) -> None:
        """End the lease and wait for the agent to confirm it. Safe to call twice."""
        sock, self._connection = self._connection, None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(self._timeout)
            while sock.recv(_LINE_LIMIT):
                pass  # the agent closes its end once the lease has ended
            self._ended = True
        except OSError:
            pass  # the agent is gone or slow: closing below ends the lease all the same
        finally:
            sock.close()


class AsyncLeaseHold(_Hold[tuple[asyncio.StreamReader, asyncio.StreamWriter]], ClosedOnAsyncExit):
    """``LeaseHold`` for asyncio code: ``async with AsyncLeaseHold(lease): ...``."""

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def open(self) -> None:
        """Connect, send the hello, check the reply; the lease is held when this returns."""
        self._refuse_second_open()
        writer: asyncio.StreamWriter | None = None
        try:
            with self._speaking():
                async with asyncio.timeout(self._timeout):
                    reader, writer = await asyncio.open_unix_connection(
                        self._socket_path, limit=_LINE_LIMIT
                    )
                    writer.write(self._hello())
                    await writer.drain()
                    line = await _read_line(reader)
            self._check_reply(line)
        except BaseException:
            if writer is not None:
                # Closing is enough to end the connection; not waiting keeps
                # this path free of awaits that a cancellation could cut.
                writer.close()
            raise
        self._connection = (reader, writer)

    async def close(self) -> None:
        """End the lease and wait for the agent to confirm it. Safe to call twice."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        reader, writer = connection
        try:
            writer.write_eof()
            async with asyncio.timeout(self._timeout):
                while await reader.read(_LINE_LIMIT):
                    pass  # the agent closes its end once the lease has ended
            self._ended = True
        except (OSError, TimeoutError):
            pass  # the agent is gone or slow: closing below ends the lease all the same
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def _receive_line(sock: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n") and len(line) < _LINE_LIMIT:
        chunk = sock.recv(_LINE_LIMIT - len(line))
        if not chunk:
            break
        line += chunk
    return line


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        return exc.partial
    except asyncio.LimitOverrunError:
        # Longer than any reply: hand back what there is; the check reports it.
        return await reader.read(_LINE_LIMIT)
