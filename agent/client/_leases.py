"""Holding a lease open on the agent's lease socket, for as long as a block runs.

The protocol: connect to the lease socket, send one JSON line
``{"lease": "<id>", "name": "<client name>"}``, read one JSON line back,
``{"ok": true, "key": ...}`` or ``{"ok": false, "error": ..., "code": ...}``.
From then on the lease lives exactly as long as the connection: when this
process closes it, exits or is killed, the kernel closes the socket and the
agent ends the lease at once. Nothing is sent after the hello.

The agent closing its end first means it stopped (a restart, a rolling
update) while this process still needs the snapshot: the hold then takes the
lease again, without the caller doing anything. It reconnects to the lease
socket with backoff and says the same hello; an agent that kept the lease
across its restart hands it back to this same process (agent.leases.keeper).
One that does not know it any more (NotFound) is asked for a new lease on the
same cached snapshot through ``regrant`` (the client's EnsureModel with
``cached_only``), which the hold then holds. A thread (sync) or a task (asyncio)
per hold waits on the connection for this; it reads nothing but the close.

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
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Generic, Self, TypeVar

from ._exceptions import AgentUnavailable, Conflict, NotFound, PrewarmError, error_for_code
from ._models import LeaseGrant, ModelHandle
from ._unreachable import diagnose

__all__ = [
    "HOLD_TIMEOUT",
    "LEASE_ALREADY_ENDED",
    "AsyncLeaseHold",
    "LeaseHold",
    "granted_lease",
    "lease_socket_for",
    "regranted",
]

# The agent reads at most this much of a hello, and answers in one short line.
_LINE_LIMIT = 4096
# How long the lease socket may take to answer when the caller gives no timeout.
HOLD_TIMEOUT = 5.0
# Waits between tries to take a lease again while the agent is away: quick at
# first (a restart takes a second or two), then every few seconds.
_RETRY_FIRST = 0.05
_RETRY_MOST = 2.0

# Failures of the release that follows a held lease which mean there is
# nothing left to end: the lease is gone already, or there is no agent to ask.
LEASE_ALREADY_ENDED: tuple[type[Exception], ...] = (NotFound, AgentUnavailable)

log = logging.getLogger("agent.client.leases")
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
        timeout: float = HOLD_TIMEOUT,
    ) -> None:
        self._lease = lease
        self._name = name
        self._socket_path = Path(socket_path) if socket_path is not None else lease.socket_path
        self._timeout = timeout
        self._connection: Connection | None = None
        self._ended = False

    @property
    def lease(self) -> LeaseGrant:
        """The lease held: a new one after a regrant."""
        return self._lease

    @property
    def socket_path(self) -> Path:
        """The lease socket this hold connects to."""
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
        """The lease, its snapshot and the lease socket, e.g. for logs."""
        return (
            f"{type(self).__name__}(lease={self._lease.id!r}, key={self._lease.key!r}, "
            f"socket_path={str(self._socket_path)!r})"
        )

    def _retry_delays(self) -> Iterator[float]:
        """Backoff between tries to take the lease again: doubling, up to ``_RETRY_MOST``."""
        delay = _RETRY_FIRST
        while True:
            yield delay
            delay = min(_RETRY_MOST, delay * 2)

    def _lost(self) -> None:
        log.warning(
            "the prewarm agent closed the connection holding the lease on snapshot %s "
            "(restarting?); taking the lease again",
            self._lease.key,
        )

    def _taken_again(self) -> None:
        log.warning("the lease on snapshot %s is held again", self._lease.key)

    def _given_up(self, exc: BaseException) -> None:
        log.warning(
            "cannot take the lease on snapshot %s again: %s; the files stay readable, but the "
            "agent may now evict them",
            self._lease.key,
            exc,
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
        if isinstance(exc, PermissionError) and (unreachable := diagnose(path, exc)):
            return unreachable.error()  # names the group, as the API socket's refusal does
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


class LeaseHold(_Hold[socket.socket], contextlib.AbstractContextManager["LeaseHold"]):
    """Holds a lease open on the agent's lease socket until closed; blocking.

    ``with LeaseHold(handle.lease, name="ns/pod"):`` the snapshot is not evicted
    inside the block, and the lease ends when the block exits (or when this
    process dies, whichever comes first). ``socket_path`` overrides the path
    the agent named (``Client.leased`` finds it next to the API socket);
    ``timeout`` bounds the connect and the reply. An unknown or expired lease
    raises ``NotFound``; one another process holds ``AccessDenied``, one another
    connection of this process holds ``Conflict``. When the agent restarts, a
    thread of the hold takes the lease again (``regrant`` answers a new lease on
    the same snapshot when the agent no longer knows this one).

    A child made by ``fork()`` without ``exec`` shares the open connection: the
    lease lasts while either process has it open, until ``close()`` here ends
    it for both (a child that outlives the block should hold its own lease).
    """

    def __init__(
        self,
        lease: LeaseGrant,
        *,
        name: str = "",
        socket_path: str | os.PathLike[str] | None = None,
        timeout: float = HOLD_TIMEOUT,
        regrant: Callable[[], LeaseGrant] | None = None,
    ) -> None:
        super().__init__(lease, name=name, socket_path=socket_path, timeout=timeout)
        self._regrant = regrant
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._keeper: threading.Thread | None = None

    def __enter__(self) -> Self:
        """Open the hold: the lease is held inside the block."""
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the hold: the lease ends with the block."""
        self.close()

    def open(self) -> None:
        """Connect, send the hello, check the reply; the lease is held when this returns."""
        self._refuse_second_open()
        self._connection = self._connect()
        self._stopping.clear()
        self._keeper = threading.Thread(
            target=self._keep, name=f"prewarm-lease-{self._lease.key[:8]}", daemon=True
        )
        self._keeper.start()

    def close(self) -> None:
        """End the lease and wait for the agent to confirm it. Safe to call twice."""
        with self._lock:
            if self._keeper is None:
                return
            self._stopping.set()
            sock = self._connection
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)  # the agent ends the lease, then closes
        keeper, self._keeper = self._keeper, None
        keeper.join(self._timeout)
        with self._lock:
            sock, self._connection = self._connection, None
        if sock is not None:
            if keeper.is_alive():  # the agent is slow: stop waiting for it
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                keeper.join(self._timeout)
            sock.close()

    def _connect(self) -> socket.socket:
        """A new connection that holds the lease (the hello said and answered)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout)
            with self._speaking():
                sock.connect(str(self._socket_path))
                sock.sendall(self._hello())
                line = _receive_line(sock)
            self._check_reply(line)
            # From here on nothing is written: the socket only has to stay open.
            # Blocking mode, so the keeper's wait for the close never times out.
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return sock

    def _keep(self) -> None:
        """The hold's thread: wait until the agent closes the connection, then take it again."""
        try:
            while (sock := self._connection) is not None:
                _wait_until_closed(sock)
                if self._stopping.is_set():
                    self._ended = True  # the agent closed its end: the lease is over
                    return
                self._lost()
                with self._lock:
                    self._connection = None
                sock.close()
                if not self._take_again():
                    return
                self._taken_again()
        except Exception as exc:  # a thread must not die with a traceback on stderr
            self._given_up(exc)

    def _take_again(self) -> bool:
        """Hold the lease on a new connection; False once stopping or refused for good."""
        for delay in self._retry_delays():
            if self._stopping.wait(delay):
                return False
            try:
                sock = self._connect()
            except AgentUnavailable:
                continue  # not back yet
            except NotFound as exc:
                if self._regranted(exc):
                    continue
                return False
            except PrewarmError as exc:
                self._given_up(exc)
                return False
            with self._lock:
                if self._stopping.is_set():
                    sock.close()
                    return False
                self._connection = sock
            return True
        return False  # pragma: no cover - the delays never run out

    def _regranted(self, forgotten: NotFound) -> bool:
        """A new lease to hold after the agent forgot this one; False when there is none.

        True also when the agent is away again: the next try asks once more.
        """
        if self._regrant is None:
            self._given_up(forgotten)
            return False
        try:
            self._lease = self._regrant()
        except AgentUnavailable:
            return True
        except PrewarmError as refused:
            self._given_up(refused)
            return False
        return True


class AsyncLeaseHold(
    _Hold[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
    contextlib.AbstractAsyncContextManager["AsyncLeaseHold"],
):
    """``LeaseHold`` for asyncio code: ``async with AsyncLeaseHold(lease): ...``.

    A task of the hold, on the loop that opened it, takes the lease again when
    the agent restarts (``regrant`` as for ``LeaseHold``, a coroutine function).
    """

    def __init__(
        self,
        lease: LeaseGrant,
        *,
        name: str = "",
        socket_path: str | os.PathLike[str] | None = None,
        timeout: float = HOLD_TIMEOUT,
        regrant: Callable[[], Awaitable[LeaseGrant]] | None = None,
    ) -> None:
        super().__init__(lease, name=name, socket_path=socket_path, timeout=timeout)
        self._regrant = regrant
        self._stopping = False
        self._keeper: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        """Open the hold: the lease is held inside the block."""
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Close the hold: the lease ends with the block."""
        await self.close()

    async def open(self) -> None:
        """Connect, send the hello, check the reply; the lease is held when this returns."""
        self._refuse_second_open()
        self._connection = await self._connect()
        self._stopping = False
        self._keeper = asyncio.create_task(self._keep(), name="prewarm-lease-hold")

    async def close(self) -> None:
        """End the lease and wait for the agent to confirm it. Safe to call twice."""
        keeper, self._keeper = self._keeper, None
        if keeper is None:
            return
        self._stopping = True
        if self._connection is None:
            keeper.cancel()  # between connections (the agent is away): nothing to end
        else:
            with contextlib.suppress(OSError):
                self._connection[1].write_eof()  # the agent ends the lease, then closes
        try:
            # The keeper returns once the agent has closed its end.
            async with asyncio.timeout(self._timeout):
                await asyncio.wait([keeper])
        except TimeoutError:
            pass  # the agent is gone or slow: closing below ends the lease all the same
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            connection, self._connection = self._connection, None
            if connection is not None:
                writer = connection[1]
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new connection that holds the lease (the hello said and answered)."""
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
        return reader, writer

    async def _keep(self) -> None:
        """The hold's task: wait until the agent closes the connection, then take it again."""
        try:
            await self._keep_held()
        except Exception as exc:  # a task's error must not go unseen until close
            self._given_up(exc)

    async def _keep_held(self) -> None:
        while (connection := self._connection) is not None:
            reader, writer = connection
            with contextlib.suppress(OSError):
                while await reader.read(_LINE_LIMIT):
                    pass  # the agent sends nothing after its reply; only the close counts
            if self._stopping:
                self._ended = True  # the agent closed its end: the lease is over
                return
            self._lost()
            self._connection = None
            writer.close()
            if not await self._take_again():
                return
            self._taken_again()

    async def _take_again(self) -> bool:
        """Hold the lease on a new connection; False once refused for good."""
        for delay in self._retry_delays():
            await asyncio.sleep(delay)
            try:
                self._connection = await self._connect()
            except AgentUnavailable:
                continue  # not back yet
            except NotFound as exc:
                if await self._regranted(exc):
                    continue
                return False
            except PrewarmError as exc:
                self._given_up(exc)
                return False
            return True
        return False  # pragma: no cover - the delays never run out

    async def _regranted(self, forgotten: NotFound) -> bool:
        """A new lease to hold after the agent forgot this one; False when there is none.

        True also when the agent is away again: the next try asks once more.
        """
        if self._regrant is None:
            self._given_up(forgotten)
            return False
        try:
            self._lease = await self._regrant()
        except AgentUnavailable:
            return True
        except PrewarmError as refused:
            self._given_up(refused)
            return False
        return True


def _wait_until_closed(sock: socket.socket) -> None:
    """Block until the other end closes (or the connection breaks)."""
    with contextlib.suppress(OSError):
        while sock.recv(_LINE_LIMIT):
            pass  # the agent sends nothing after its reply; only the close counts


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


def granted_lease(handle: ModelHandle, api_socket: Path) -> LeaseGrant:
    """The lease an EnsureModel(lease=true) answer must carry."""
    if handle.lease is None:
        raise PrewarmError(
            f"The prewarm agent on {api_socket} answered EnsureModel(lease=true) for "
            f"{handle.uri} without a lease; it is older than this client: upgrade it."
        )
    return handle.lease


def regranted(first: ModelHandle, again: ModelHandle, api_socket: Path) -> LeaseGrant:
    """The lease ``again`` carries, if it is on the snapshot the block uses; else Conflict.

    A different snapshot (the cache now holds a newer one) protects nothing
    the running block maps; its lease is left to expire.
    """
    grant = granted_lease(again, api_socket)
    if again.key != first.key:
        raise Conflict(
            f"the node's cached snapshot of {first.uri} is now {again.key}, not {first.key}, "
            "which this process uses; it cannot be leased again"
        )
    return grant


def lease_socket_for(grant: LeaseGrant, api_socket: Path) -> Path:
    """Where this process reaches the agent's lease socket.

    The agent names the path as it is on the node; a pod that mounts the
    agent's directory elsewhere reaches the API socket (and the lease socket
    next to it) under another path. So the lease socket next to the API
    socket this client uses wins when it exists, else the agent's path.
    """
    sibling = api_socket.parent / grant.socket_path.name
    return sibling if sibling.exists() else grant.socket_path
