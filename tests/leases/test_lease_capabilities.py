"""Leases as capabilities (issue 11 defect 7) and eviction that re-checks protection (defect 2).

Only the process that holds a lease can hold it; its id is shown to nobody but the requester;
leases per grantee and per uid are capped; a victim leased or claimed after it was chosen
stays. In-process against a real store, table and lease socket; the API end to end against
the real daemon and the shared moto server.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agent_helpers import AgentFactory
from store_helpers import open_store, publish

from agent import NoSpace
from agent._config import TierSettings
from agent._snapshot import Snapshot, SourceObject
from agent._uri import parse_uri
from agent.client import Client
from agent.edge.lease_socket import LeaseServer
from agent.leases.table import LeaseTable, PeerCredentials
from agent.store.eviction import Evictor
from agent.testing import S3Server, make_safetensors_model, upload_model

MiB = 1024 * 1024
ME = PeerCredentials(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())


@pytest.fixture
async def lease_server(tmp_path: Path) -> AsyncIterator[LeaseServer]:
    table = LeaseTable(default_ttl=60, max_ttl=600, max_per_peer=2)
    async with LeaseServer(table, tmp_path / "lease.sock") as served:
        yield served


async def _hold(server: LeaseServer, lease_id: str) -> tuple[socket.socket, dict[str, object]]:
    """A connection that sent the hello for ``lease_id`` (blocking socket, in a thread)."""

    def connect() -> tuple[socket.socket, dict[str, object]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(str(server.path))
        sock.sendall(json.dumps({"lease": lease_id}).encode() + b"\n")
        return sock, json.loads(sock.makefile("rb").readline())

    return await asyncio.to_thread(connect)


async def test_another_process_cannot_hold_a_held_lease(lease_server: LeaseServer) -> None:
    """A hello from another process for a lease this process holds is PERMISSION_DENIED, names
    no holder, and the holder keeps the lease."""
    record = lease_server.table.grant("k1")
    first, reply = await _hold(lease_server, record.id)
    try:
        assert reply["ok"] is True
        script = (
            "import json, socket, sys\n"
            "sock = socket.socket(socket.AF_UNIX)\n"
            "sock.connect(sys.argv[1])\n"
            "sock.sendall(json.dumps({'lease': sys.argv[2]}).encode() + b'\\n')\n"
            "sys.stdout.buffer.write(sock.makefile('rb').readline())\n"
        )
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            script,
            str(lease_server.path),
            record.id,
            stdout=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(30):
            out, _ = await child.communicate()
        refused = json.loads(out)
        assert refused["ok"] is False
        assert refused["code"] == "PERMISSION_DENIED"
        assert str(os.getpid()) not in refused["error"]
        assert lease_server.table.get(record.id).holder == ME
    finally:
        first.close()


async def test_half_close_ends_the_lease_before_the_agent_closes(
    lease_server: LeaseServer,
) -> None:
    """When the holder half-closes, the agent ends the lease first and then closes its end."""
    record = lease_server.table.grant("k1")
    sock, _ = await _hold(lease_server, record.id)

    def half_close() -> bytes:
        sock.shutdown(socket.SHUT_WR)
        return sock.recv(100)

    try:
        assert await asyncio.to_thread(half_close) == b""
        assert lease_server.table.active() == []
    finally:
        sock.close()


def test_one_grantee_gets_at_most_max_per_peer_leases() -> None:
    """A grantee at the cap gets NoSpace; others do not, and ending a lease makes room."""
    table = LeaseTable(default_ttl=60, max_ttl=600, max_per_peer=3)
    leases = [table.grant("k", grantee="/run/a.sock") for _ in range(3)]
    with pytest.raises(NoSpace, match="already has 3 live leases"):
        table.grant("k", grantee="/run/a.sock")
    table.grant("k", grantee="/run/b.sock")
    table.release(leases[0].id)
    table.grant("k", grantee="/run/a.sock")
    assert len(table.for_key("k")) == 4


def _incoming(mib: int) -> Snapshot:
    obj = SourceObject(key="new/w.bin", relative_path="w.bin", size=mib * MiB, etag='"e"')
    return Snapshot(parse_uri("s3://bucket/new/"), (), (), (obj,), "f" * 64)


async def test_victim_leased_after_it_was_chosen_is_kept(tmp_path: Path) -> None:
    """A lease granted between choosing victims and removing them keeps its snapshot: make_room
    chooses again and evicts another one instead."""
    store = await open_store(tmp_path)
    keys = [(await publish(store, n, 3)).key for n in (1, 2, 3)]
    leases = LeaseTable(default_ttl=60, max_ttl=600)
    evictor = Evictor(store, leases, TierSettings(high_watermark=0.85, low_watermark=0.6))
    _, victims = evictor.place(_incoming(3), "shm", strict=True)
    assert [v.key for v in victims] == keys[:1]
    leases.grant(keys[0])  # a hit on the chosen victim, before it is removed
    await evictor.evict(victims, "test")
    assert store.get(keys[0]) is not None
    async with evictor.lock:
        await evictor.make_room(_incoming(3), "shm", strict=True)
    assert store.get(keys[0]) is not None
    assert store.get(keys[1]) is None


async def test_claimed_snapshot_is_not_a_victim(tmp_path: Path) -> None:
    """A key claimed by a request in progress is protected like a leased one, until it ends."""
    store = await open_store(tmp_path)
    keys = [(await publish(store, n, 3)).key for n in (1, 2, 3)]
    leases = LeaseTable(default_ttl=60, max_ttl=600)
    evictor = Evictor(store, leases, TierSettings(high_watermark=0.85, low_watermark=0.6))
    with leases.claim(keys[0]):
        assert keys[0] in evictor.protected_keys()
        _, victims = evictor.place(_incoming(3), "shm", strict=True)
        assert [v.key for v in victims] == keys[1:2]
    assert leases.protected_keys() == set()


def test_lease_ids_are_shown_only_to_the_requester(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """GetModel and ListModels show who holds a lease but never its id; the ensure that asked
    for it gets the id, and holding it over the socket still works."""
    tensors = make_safetensors_model(tmp_path / "m", total_bytes=MiB, shards=1)
    model = upload_model(s3_server.client(), bucket, "models/m", tmp_path / "m", tensors=tensors)
    agent = start_agent()
    with (
        Client(agent.socket_path) as client,
        client.leased(model.uri, client_name="ns/pod") as handle,
    ):
        assert handle.lease is not None
        assert handle.lease.id
        [lease] = client.get(model.uri).leases
        assert lease.id == ""
        assert (lease.client_name, lease.held, lease.pid) == ("ns/pod", True, os.getpid())
        [listed] = client.list_models()
        assert [lease.id for lease in listed.leases] == [""]


def test_leases_per_socket_are_capped(
    start_agent: AgentFactory, s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Past [leases] max_per_peer live leases on one API socket, ensure(lease=True) is
    RESOURCE_EXHAUSTED (NoSpace) with what to do; releasing one makes room again."""
    tensors = make_safetensors_model(tmp_path / "m", total_bytes=MiB, shards=1)
    model = upload_model(s3_server.client(), bucket, "models/m", tmp_path / "m", tensors=tensors)
    agent = start_agent("[leases]\nmax_per_peer = 5\n")
    with Client(agent.socket_path) as client:
        granted = [client.ensure(model.uri, lease=True) for _ in range(5)]
        with pytest.raises(NoSpace, match="release leases it no longer uses"):
            client.ensure(model.uri, lease=True)
        assert client.ensure(model.uri).path.is_dir()  # no lease asked: still served
        first = granted[0].lease
        assert first is not None
        client.release_lease(first.id)
        assert client.ensure(model.uri, lease=True).lease is not None
