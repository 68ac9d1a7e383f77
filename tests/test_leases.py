"""Leases: the table's rules on a fake clock, and the lease socket over a real Unix socket."""

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

from agent import Conflict, InvalidRequest, NotFound
from agent.edge.lease_socket import LeaseServer
from agent.store.leases import (
    HELLO_LIMIT,
    LeaseTable,
    PeerCredentials,
)

ME = PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> LeaseTable:
    return LeaseTable(default_ttl=60, max_ttl=600, clock=clock)


# --- LeaseTable ---------------------------------------------------------------------------


def test_grant_without_ttl_uses_the_default(table: LeaseTable, clock: FakeClock) -> None:
    record = table.grant("k1", "ns/pod")
    assert record.key == "k1"
    assert record.client_name == "ns/pod"
    assert record.acquired == clock.now
    assert record.expires == clock.now + 60
    assert not record.held
    assert record.holder is None


def test_ttl_of_zero_means_the_default(table: LeaseTable, clock: FakeClock) -> None:
    assert table.grant("k1", ttl=0).expires == clock.now + 60


def test_ttl_above_the_maximum_is_clamped(table: LeaseTable, clock: FakeClock) -> None:
    assert table.grant("k1", ttl=10_000).expires == clock.now + 600
    assert table.grant("k1", ttl=float("inf")).expires == clock.now + 600


@pytest.mark.parametrize("ttl", [-1.0, float("nan")])
def test_negative_or_nan_ttl_is_invalid(table: LeaseTable, ttl: float) -> None:
    with pytest.raises(InvalidRequest, match="positive number of seconds"):
        table.grant("k1", ttl=ttl)


def test_ids_are_unique_and_unguessable(table: LeaseTable) -> None:
    ids = {table.grant("k1").id for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) >= 20 for i in ids)


def test_lease_expires_at_its_ttl(table: LeaseTable, clock: FakeClock) -> None:
    record = table.grant("k1", ttl=30)
    clock.now += 29.9
    assert table.get(record.id) == record
    clock.now += 0.1
    assert table.active() == []
    assert table.leased_keys() == set()
    with pytest.raises(NotFound, match="does not exist or has expired"):
        table.get(record.id)


def test_renew_pushes_the_expiry_from_now(table: LeaseTable, clock: FakeClock) -> None:
    record = table.grant("k1", ttl=30)
    clock.now += 20
    renewed = table.renew(record.id, ttl=30)
    assert renewed.expires == clock.now + 30
    clock.now += 25
    assert [r.id for r in table.active()] == [record.id]


def test_renew_without_ttl_uses_the_default(table: LeaseTable, clock: FakeClock) -> None:
    record = table.grant("k1", ttl=5)
    assert table.renew(record.id).expires == clock.now + 60


def test_renew_of_an_expired_lease_is_not_found_and_says_what_to_do(
    table: LeaseTable, clock: FakeClock
) -> None:
    record = table.grant("k1", ttl=10)
    clock.now += 10
    with pytest.raises(NotFound, match=r"EnsureModel\(lease=true\)"):
        table.renew(record.id)


def test_release_ends_the_lease(table: LeaseTable) -> None:
    record = table.grant("k1")
    assert table.release(record.id) == record
    assert table.active() == []
    with pytest.raises(NotFound):
        table.release(record.id)


def test_unknown_id_is_not_found(table: LeaseTable) -> None:
    for call in (table.get, table.renew, table.release):
        with pytest.raises(NotFound, match="'nope' does not exist"):
            call("nope")
    with pytest.raises(NotFound):
        table.hold("nope", ME)


def test_held_lease_never_expires(table: LeaseTable, clock: FakeClock) -> None:
    record = table.grant("k1", "granted-name", ttl=10)
    held = table.hold(record.id, ME, "holder-name")
    assert held.held
    assert held.holder == ME
    assert held.expires is None
    assert held.client_name == "holder-name"
    clock.now += 10_000
    assert table.for_key("k1") == [held]
    assert table.renew(record.id) == held


def test_hold_without_a_name_keeps_the_granted_name(table: LeaseTable) -> None:
    record = table.grant("k1", "granted-name")
    assert table.hold(record.id, ME).client_name == "granted-name"


def test_expired_lease_cannot_be_held(table: LeaseTable, clock: FakeClock) -> None:
    record = table.grant("k1", ttl=10)
    clock.now += 11
    with pytest.raises(NotFound):
        table.hold(record.id, ME)


def test_second_holder_is_a_conflict(table: LeaseTable) -> None:
    record = table.grant("k1")
    table.hold(record.id, ME)
    with pytest.raises(Conflict, match=f"pid {ME.pid}"):
        table.hold(record.id, PeerCredentials(1, 2, 3))


def test_unhold_ends_the_lease(table: LeaseTable) -> None:
    record = table.grant("k1")
    table.hold(record.id, ME)
    ended = table.unhold(record.id)
    assert ended is not None
    assert ended.holder == ME
    assert table.active() == []
    assert table.unhold(record.id) is None


def test_queries_by_key(table: LeaseTable, clock: FakeClock) -> None:
    a1 = table.grant("a")
    clock.now += 1
    a2 = table.grant("a")
    b = table.grant("b")
    assert table.for_key("a") == [a1, a2]
    assert table.leased_keys() == {"a", "b"}
    assert [r.id for r in table.active()] == [a1.id, *sorted([a2.id, b.id])]


def test_bad_ttl_settings_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        LeaseTable(default_ttl=600, max_ttl=60)


async def test_wait_released_returns_when_a_timed_lease_expires() -> None:
    table = LeaseTable(default_ttl=0.05, max_ttl=1)
    record = table.grant("k1")
    async with asyncio.timeout(5):
        await table.wait_released(record.id)
    assert table.active() == []


async def test_wait_released_returns_on_release(table: LeaseTable) -> None:
    record = table.grant("k1")
    table.hold(record.id, ME)
    async with asyncio.timeout(5), asyncio.TaskGroup() as tasks:
        waiter = tasks.create_task(table.wait_released(record.id))
        await asyncio.sleep(0)  # let it start waiting
        assert not waiter.done()
        table.release(record.id)


# --- LeaseServer --------------------------------------------------------------------------


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
    mode = server.path.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o660


async def test_connection_holds_the_lease_with_this_processs_credentials(
    server: LeaseServer, table: LeaseTable
) -> None:
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
    record = table.grant("k1")
    _, writer, reply = await _connect(server, _hello(record.id))
    assert reply["ok"] is True
    writer.close()
    await writer.wait_closed()
    async with asyncio.timeout(5):
        await table.wait_released(record.id)
    assert table.leased_keys() == set()


async def test_bytes_after_the_hello_are_ignored(server: LeaseServer, table: LeaseTable) -> None:
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
    path = tmp_path / "lease.sock"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # bound, never listening: what a killed daemon leaves
    async with LeaseServer(table, path):
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(path))


async def test_live_socket_is_not_taken_over(server: LeaseServer, table: LeaseTable) -> None:
    with pytest.raises(Conflict, match="already serving leases"):
        async with LeaseServer(table, server.path):
            pass
    assert server.path.exists()


async def test_path_that_is_not_a_socket_is_refused(tmp_path: Path, table: LeaseTable) -> None:
    path = tmp_path / "lease.sock"
    path.write_text("not a socket")
    with pytest.raises(Conflict, match="is not a socket"):
        async with LeaseServer(table, path):
            pass
    assert path.read_text() == "not a socket"


async def test_unknown_group_is_refused(tmp_path: Path, table: LeaseTable) -> None:
    with pytest.raises(InvalidRequest, match="does not exist"):
        async with LeaseServer(table, tmp_path / "lease.sock", group="no-such-group-xyz"):
            pass
    assert not (tmp_path / "lease.sock").exists()
