"""The lease socket (agent.edge.lease_socket) over a real Unix socket, with a real table."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent import Conflict, InvalidRequest
from agent.edge.lease_socket import HELLO_LIMIT, LeaseServer
from agent.leases.table import LeaseTable, PeerCredentials

ME = PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())


@pytest.fixture
def table() -> LeaseTable:
    return LeaseTable(default_ttl=60, max_ttl=600)


@pytest.fixture
async def server(tmp_path: Path, table: LeaseTable) -> AsyncIterator[LeaseServer]:
    async with LeaseServer(table, tmp_path / "run" / "lease.sock", mode=0o660) as served:
        yield served


async def _connect(
    server: LeaseServer, hello: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, object]]:
    reader, writer = await asyncio.open_unix_connection(server.path)
    writer.write(hello)
    await writer.drain()
    async with asyncio.timeout(10):
        reply = json.loads(await reader.readline())
    assert isinstance(reply, dict)
    return reader, writer, reply


def _hello(lease_id: str, name: str | None = None) -> bytes:
    document = {"lease": lease_id} if name is None else {"lease": lease_id, "name": name}
    return json.dumps(document).encode() + b"\n"


async def test_socket_file_is_created_with_the_mode(server: LeaseServer) -> None:
    """The lease socket file is a socket with the configured mode."""
    mode = server.path.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o660


async def test_connection_holds_the_lease_with_this_processs_credentials(
    server: LeaseServer, table: LeaseTable
) -> None:
    """A valid hello holds the lease under the peer's kernel credentials and hello name."""
    record = table.grant("k1", "granted")
    _, writer, reply = await _connect(server, _hello(record.id, "ns/pod"))
    try:
        assert reply == {"ok": True, "key": "k1"}
        [held] = table.active()
        assert held.held
        assert held.holder == ME
        assert held.client_name == "ns/pod"
        assert held.expires is None
    finally:
        writer.close()
        await writer.wait_closed()


async def test_closing_the_connection_releases_the_lease(
    server: LeaseServer, table: LeaseTable
) -> None:
    """Closing the holding connection ends the lease."""
    record = table.grant("k1")
    _, writer, reply = await _connect(server, _hello(record.id))
    assert reply["ok"] is True
    writer.close()
    await writer.wait_closed()
    async with asyncio.timeout(5):
        await table.wait_released(record.id)
    assert table.leased_keys() == set()


async def test_bytes_after_the_hello_are_ignored(server: LeaseServer, table: LeaseTable) -> None:
    """Bytes a holder sends after its hello neither end nor change the lease."""
    record = table.grant("k1")
    _, writer, _ = await _connect(server, _hello(record.id))
    try:
        writer.write(b"keep-alive\n" * 1000)
        await writer.drain()
        assert table.get(record.id).held
    finally:
        writer.close()
        await writer.wait_closed()


@pytest.mark.parametrize(
    ("hello", "error", "code"),
    [
        (_hello("no-such-lease"), "does not exist or has expired", "NOT_FOUND"),
        (b"not json\n", "not JSON", "INVALID_ARGUMENT"),
        (b"[1, 2]\n", "not a JSON object", "INVALID_ARGUMENT"),
        (b'{"name": "x"}\n', 'no "lease" string', "INVALID_ARGUMENT"),
        (b'{"lease": "x", "name": 3}\n', '"name" is not a string', "INVALID_ARGUMENT"),
        (b"x" * (HELLO_LIMIT + 10) + b"\n", "longer than 4096 bytes", "INVALID_ARGUMENT"),
    ],
)
async def test_bad_hello_gets_an_error_reply_and_the_connection_closes(
    server: LeaseServer, hello: bytes, error: str, code: str
) -> None:
    """A bad hello gets one error line with the API's status name, then the agent closes."""
    reader, writer, reply = await _connect(server, hello)
    try:
        assert reply["ok"] is False
        assert error in str(reply["error"])
        assert reply["code"] == code
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # closed by the agent
    finally:
        writer.close()
        await writer.wait_closed()


async def test_hello_cut_short_gets_an_error_reply(server: LeaseServer) -> None:
    """A connection that ends mid-hello gets an error reply, not silence."""
    reader, writer = await asyncio.open_unix_connection(server.path)
    try:
        writer.write(b'{"lease": ')
        writer.write_eof()
        async with asyncio.timeout(10):
            reply = json.loads(await reader.readline())
        assert reply["ok"] is False
        assert "ended before a full hello line" in reply["error"]
    finally:
        writer.close()
        await writer.wait_closed()


async def test_silent_connection_is_refused_after_the_hello_timeout(
    tmp_path: Path, table: LeaseTable
) -> None:
    """A connection that sends nothing is answered with an error after the hello timeout."""
    async with LeaseServer(table, tmp_path / "lease.sock", hello_timeout=0.1) as served:
        reader, writer = await asyncio.open_unix_connection(served.path)
        try:
            async with asyncio.timeout(10):
                reply = json.loads(await reader.readline())
                assert await reader.read() == b""
            assert reply["ok"] is False
            assert "No hello within 0.1 s" in reply["error"]
        finally:
            writer.close()
            await writer.wait_closed()


async def test_second_connection_for_a_held_lease_is_refused(
    server: LeaseServer, table: LeaseTable
) -> None:
    """A second hello from the holding process is FAILED_PRECONDITION; the first keeps it."""
    record = table.grant("k1")
    _, first, _ = await _connect(server, _hello(record.id))
    _, second, reply = await _connect(server, _hello(record.id))
    try:
        assert reply["ok"] is False
        assert reply["code"] == "FAILED_PRECONDITION"
        # The refused connection does not end the lease the first one holds.
        second.close()
        await second.wait_closed()
        assert table.get(record.id).held
    finally:
        first.close()
        await first.wait_closed()


async def test_killed_child_process_releases_its_lease(
    server: LeaseServer, table: LeaseTable
) -> None:
    """SIGKILL of the holding process ends its lease; the holder was recorded by pid."""
    record = table.grant("k1")
    script = (
        "import socket, sys\n"
        "sock = socket.socket(socket.AF_UNIX)\n"
        "sock.connect(sys.argv[1])\n"
        "sock.sendall(sys.argv[2].encode())\n"
        "reply = sock.makefile('rb').readline()\n"
        "sys.stdout.buffer.write(reply)\n"
        "sys.stdout.flush()\n"
        "sys.stdin.read()\n"  # block until killed
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        str(server.path),
        _hello(record.id, "child").decode(),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    killed = False
    try:
        async with asyncio.timeout(30):
            reply = json.loads(await child.stdout.readline())  # type: ignore[union-attr]
        assert reply == {"ok": True, "key": "k1"}
        held = table.get(record.id)
        assert held.holder == PeerCredentials(child.pid, os.getuid(), os.getgid())
        assert held.client_name == "child"

        child.send_signal(signal.SIGKILL)
        killed = True
        async with asyncio.timeout(10):
            await table.wait_released(record.id)
        assert table.active() == []
    finally:
        # Never signal twice: Popen.send_signal polls first, and that poll can
        # reap the child behind asyncio's watcher (which then reports 255).
        if not killed:
            child.kill()
        await child.communicate()
    assert child.returncode == -signal.SIGKILL


async def test_exit_closes_connections_and_removes_the_socket(
    tmp_path: Path, table: LeaseTable
) -> None:
    """Leaving the server closes held connections, ends their leases and removes the socket."""
    record = table.grant("k1")
    async with LeaseServer(table, tmp_path / "lease.sock") as served:
        reader, writer, reply = await _connect(served, _hello(record.id))
        assert reply["ok"] is True
        assert served.connection_count() == 1
    try:
        assert served.connection_count() == 0
        assert not served.path.exists()
        assert table.active() == []
        async with asyncio.timeout(10):
            assert await reader.read() == b""
    finally:
        writer.close()
        await writer.wait_closed()


async def test_stale_socket_file_is_replaced(tmp_path: Path, table: LeaseTable) -> None:
    """A socket file left by a dead daemon is replaced by the new server."""
    path = tmp_path / "lease.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # bound, never listening: what a killed daemon leaves
    async with LeaseServer(table, path):
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(path))


async def test_live_socket_is_not_taken_over(server: LeaseServer, table: LeaseTable) -> None:
    """A socket another server is listening on is a Conflict and stays in place."""
    with pytest.raises(Conflict, match="already serving leases"):
        async with LeaseServer(table, server.path):
            pass
    assert server.path.exists()


async def test_path_that_is_not_a_socket_is_refused(tmp_path: Path, table: LeaseTable) -> None:
    """A regular file at the socket path is refused and left untouched."""
    path = tmp_path / "lease.sock"
    path.write_text("not a socket")
    with pytest.raises(Conflict, match="is not a socket"):
        async with LeaseServer(table, path):
            pass
    assert path.read_text() == "not a socket"


async def test_unknown_group_is_refused(tmp_path: Path, table: LeaseTable) -> None:
    """An unknown socket group is an InvalidRequest and leaves no socket behind."""
    with pytest.raises(InvalidRequest, match="does not exist"):
        async with LeaseServer(table, tmp_path / "lease.sock", group="no-such-group-xyz"):
            pass
    assert not (tmp_path / "lease.sock").exists()
