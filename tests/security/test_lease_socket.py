"""Attacks on the lease socket as a hostile local process would try them (issue 11, second pass).

Against a real LeaseServer and lease table on a tmp socket: connections that never say hello
(the agent's descriptors are finite), a slow hello, and a holder that floods bytes after its
hello (every byte would be read on the event loop that also answers the API).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.edge.lease_socket import MAX_PENDING_PER_UID, POST_HELLO_LIMIT, LeaseServer
from agent.leases.table import LeaseTable


@pytest.fixture
async def lease_server(tmp_path: Path) -> AsyncIterator[LeaseServer]:
    table = LeaseTable(default_ttl=60, max_ttl=600)
    async with LeaseServer(table, tmp_path / "lease.sock", hello_timeout=30) as served:
        yield served


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def _read_reply(sock: socket.socket) -> dict[str, object]:
    line = sock.makefile("rb").readline()
    reply: dict[str, object] = json.loads(line)
    return reply


async def test_connections_that_never_say_hello_are_capped_per_uid(
    lease_server: LeaseServer,
) -> None:
    """Past MAX_PENDING_PER_UID silent connections of one uid, a new connection is answered
    RESOURCE_EXHAUSTED at once and closed, so silent peers cannot use up the agent's fds."""
    silent = [
        await asyncio.to_thread(_connect, lease_server.path) for _ in range(MAX_PENDING_PER_UID)
    ]
    try:
        extra = await asyncio.to_thread(_connect, lease_server.path)
        try:
            reply = await asyncio.to_thread(_read_reply, extra)
            assert reply["code"] == "RESOURCE_EXHAUSTED"
            assert "hello" in str(reply["error"])
        finally:
            extra.close()
        # The silent ones, and at most the refused one while its handler finishes closing.
        assert lease_server.connection_count() <= MAX_PENDING_PER_UID + 1
    finally:
        for sock in silent:
            sock.close()


async def test_bytes_flooded_after_the_hello_end_the_connection_and_its_lease(
    lease_server: LeaseServer,
) -> None:
    """A holder that keeps sending after its hello (more than POST_HELLO_LIMIT bytes) is cut off
    and its lease ends, instead of the agent reading the flood forever on its event loop."""
    record = lease_server.table.grant("k1")

    def flood() -> bytes:
        sock = _connect(lease_server.path)
        try:
            sock.sendall(json.dumps({"lease": record.id}).encode() + b"\n")
            reader = sock.makefile("rb")
            assert json.loads(reader.readline())["ok"] is True
            chunk = b"x" * 65536
            sent = 0
            try:
                while sent < POST_HELLO_LIMIT * 4:
                    sent += sock.send(chunk)
                return reader.read()  # EOF once the agent closes its end
            except (BrokenPipeError, ConnectionResetError):
                return b""  # cut off mid-flood: what the test wants
        finally:
            sock.close()

    assert await asyncio.to_thread(flood) == b""
    await lease_server.table.wait_released(record.id)
    assert lease_server.table.active() == []
