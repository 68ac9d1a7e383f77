"""The client holding leases on a real lease socket served in this process.

A stand-in agent (grpc.aio, same event loop) grants leases from a real
``LeaseTable`` and a real ``LeaseServer`` serves the lease socket next to its
API socket. Blocking client calls run in a worker thread so the loop keeps
serving; the table is only ever touched on the loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from agent._exceptions import PrewarmError
from agent._proto.prewarm.v1 import prewarm_pb2 as pb
from agent._proto.prewarm.v1 import prewarm_pb2_grpc as pb_grpc
from agent.client import (
    AccessDenied,
    AgentUnavailable,
    AsyncClient,
    AsyncLeaseHold,
    Client,
    Conflict,
    LeaseGrant,
    LeaseHold,
    ModelInfo,
    NotFound,
)
from agent.edge.lease_socket import LeaseServer
from agent.leases.table import LeaseRecord, LeaseTable

T = TypeVar("T")
KEY = "k1"
# Where the agent says the lease socket is: a path on "the node" that this
# test process cannot see, as in a pod that mounts the agent's directory
# elsewhere. The client finds it next to the API socket instead.
NODE_LEASE_SOCKET = "/run/prewarm-not-here/lease.sock"


def _ts(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _lease(record: LeaseRecord) -> pb.Lease:
    lease = pb.Lease(id=record.id, key=record.key, socket_path=NODE_LEASE_SOCKET)
    if record.expires is not None:
        lease.expires.CopyFrom(_ts(record.expires))
    return lease


def _lease_info(record: LeaseRecord) -> pb.LeaseInfo:
    info = pb.LeaseInfo(
        id=record.id,
        client_name=record.client_name,
        acquired=_ts(record.acquired),
        held=record.held,
    )
    if record.holder is not None:
        info.pid, info.uid, info.gid = record.holder.pid, record.holder.uid, record.holder.gid
    if record.expires is not None:
        info.expires.CopyFrom(_ts(record.expires))
    return info


class _LeasingAgent(pb_grpc.PrewarmServicer):
    """Every URI is snapshot k1, already cached; leases come from a real table."""

    def __init__(self, table: LeaseTable) -> None:
        self.table = table

    async def EnsureModel(self, request: pb.EnsureModelRequest, context: Any) -> AsyncIterator[Any]:
        handle = pb.ModelHandle(uri=request.uri, key=KEY, path="/cache/k1", tier=pb.TIER_SHM)
        if request.lease:
            record = self.table.grant(KEY, request.client_name, request.lease_ttl_seconds)
            handle.lease.CopyFrom(_lease(record))
        yield pb.EnsureModelEvent(handle=handle)

    async def GetModel(self, request: pb.GetModelRequest, context: Any) -> pb.ModelInfo:
        return pb.ModelInfo(
            uri="s3://b/m/",
            key=KEY,
            tier=pb.TIER_SHM,
            leases=[_lease_info(r) for r in self.table.for_key(KEY)],
        )

    async def RenewLease(self, request: pb.RenewLeaseRequest, context: Any) -> pb.Lease:
        try:
            return _lease(self.table.renew(request.id, request.ttl_seconds))
        except PrewarmError as exc:
            await context.abort(grpc.StatusCode[exc.status], str(exc))
            raise

    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: Any) -> Any:
        try:
            self.table.release(request.id)
        except PrewarmError as exc:
            await context.abort(grpc.StatusCode[exc.status], str(exc))
        return pb.ReleaseLeaseResponse()


@dataclass
class Agent:
    socket_path: Path
    lease_socket: Path
    table: LeaseTable
    server: LeaseServer


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    table = LeaseTable(default_ttl=60, max_ttl=600)
    socket_path = tmp_path / "agent.sock"
    server = grpc.aio.server()
    # Only the RPCs these tests call are served; the rest answer UNIMPLEMENTED.
    pb_grpc.add_PrewarmServicer_to_server(_LeasingAgent(table), server)  # type: ignore[abstract]
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    try:
        async with LeaseServer(table, tmp_path / "lease.sock") as lease_server:
            yield Agent(socket_path, lease_server.path, table, lease_server)
    finally:
        await server.stop(None)


async def _in_thread(fn: Callable[[], T]) -> T:
    return await asyncio.to_thread(fn)


def _held_by_me(info: ModelInfo) -> bool:
    [lease] = info.leases
    return (lease.held, lease.pid, lease.uid, lease.gid) == (
        True,
        os.getpid(),
        os.getuid(),
        os.getgid(),
    )


async def test_leased_holds_the_lease_for_the_block_and_releases_it(agent: Agent) -> None:
    """Client.leased holds the lease (found next to the API socket) for the block, then releases it.

    Inside the block this process is the holder and the lease has no expiry.
    """

    def use() -> tuple[LeaseGrant | None, ModelInfo]:
        with (
            Client(agent.socket_path) as client,
            client.leased("s3://b/m/", client_name="ns/pod") as handle,
        ):
            return handle.lease, client.get(KEY)

    grant, inside = await _in_thread(use)
    assert grant is not None
    assert grant.key == KEY
    assert grant.socket_path == Path(NODE_LEASE_SOCKET)
    assert _held_by_me(inside)
    assert inside.leases[0].client_name == "ns/pod"
    assert inside.leases[0].expires is None
    # Released by the time the block has exited, not eventually.
    assert agent.table.active() == []


async def test_async_leased_holds_the_lease_for_the_block_and_releases_it(agent: Agent) -> None:
    """AsyncClient.leased holds the lease for the block and none is left active after it."""
    async with AsyncClient(agent.socket_path) as client:
        async with client.leased("s3://b/m/", client_name="ns/pod") as handle:
            assert handle.lease is not None
            assert _held_by_me(await client.get(KEY))
            assert agent.table.get(handle.lease.id).held
        assert agent.table.active() == []


async def test_leased_releases_the_lease_when_the_block_raises(agent: Agent) -> None:
    """An exception in the leased block propagates and the lease is released all the same."""

    class Boom(Exception):
        pass

    def use() -> None:
        with Client(agent.socket_path) as client, client.leased("s3://b/m/"):
            raise Boom

    with pytest.raises(Boom):
        await _in_thread(use)
    assert agent.table.active() == []


async def test_async_leased_releases_the_lease_when_cancelled(agent: Agent) -> None:
    """Cancelling a task inside an async leased block ends its lease."""
    entered = asyncio.Event()

    async def use() -> None:
        async with AsyncClient(agent.socket_path) as client, client.leased("s3://b/m/"):
            entered.set()
            await asyncio.Event().wait()  # until cancelled

    async with asyncio.timeout(10):
        task = asyncio.create_task(use())
        await entered.wait()
        [record] = agent.table.active()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await agent.table.wait_released(record.id)


async def test_leased_releases_the_lease_when_the_hold_cannot_open(agent: Agent) -> None:
    """When the lease socket cannot be reached, leased raises AgentUnavailable before the block and
    releases the granted lease.
    """
    agent.lease_socket.unlink()  # the agent serves no lease socket the client can reach

    def use() -> None:
        with Client(agent.socket_path) as client, client.leased("s3://b/m/"):
            raise AssertionError("the block must not run")

    with pytest.raises(AgentUnavailable, match="no prewarm lease socket at"):
        await _in_thread(use)
    assert agent.table.active() == []


async def test_hold_ends_the_lease_when_closed(agent: Agent) -> None:
    """A LeaseHold is held inside its with block, and the lease has ended on the agent by the
    time closing it returns."""
    record = agent.table.grant(KEY, ttl=60)
    grant = _grant(record, agent)

    def hold() -> bool:
        with LeaseHold(grant, name="worker") as held:
            return held.held

    assert await _in_thread(hold)
    assert agent.table.active() == []


async def test_async_hold_reports_who_holds_it(agent: Agent) -> None:
    """An AsyncLeaseHold makes this process (with its name) the holder, until the block exits."""
    record = agent.table.grant(KEY, "granted", ttl=60)
    async with AsyncLeaseHold(_grant(record, agent), name="worker") as hold:
        assert hold.held
        held = agent.table.get(record.id)
        assert held.holder is not None
        assert held.holder.pid == os.getpid()
        assert held.client_name == "worker"
    assert not hold.held
    assert agent.table.active() == []  # closing waited for the agent to end it


async def test_hold_of_an_unknown_lease_is_not_found(agent: Agent) -> None:
    """Holding a released (unknown) lease is NotFound, for both the sync and the async hold."""
    record = agent.table.grant(KEY)
    agent.table.release(record.id)
    grant = _grant(record, agent)
    with pytest.raises(NotFound, match="does not exist or has expired"):
        await _in_thread(LeaseHold(grant).open)
    with pytest.raises(NotFound, match="does not exist or has expired"):
        await AsyncLeaseHold(grant).open()


async def test_second_hold_of_the_same_lease_is_a_conflict(agent: Agent) -> None:
    """A second hold of a lease that is already held is a Conflict, and the first hold keeps it."""
    record = agent.table.grant(KEY)
    grant = _grant(record, agent)
    async with AsyncLeaseHold(grant):
        with pytest.raises(Conflict, match="already held"):
            await _in_thread(LeaseHold(grant).open)
        assert agent.table.get(record.id).held


async def test_hold_without_a_lease_socket_is_agent_unavailable(tmp_path: Path) -> None:
    """A hold with no lease socket at the path is AgentUnavailable saying so, sync and async."""
    grant = LeaseGrant(id="x", key=KEY, expires=None, socket_path=tmp_path / "lease.sock")
    with pytest.raises(AgentUnavailable, match="no prewarm lease socket"):
        LeaseHold(grant).open()
    with pytest.raises(AgentUnavailable, match="no prewarm lease socket"):
        await AsyncLeaseHold(grant).open()


async def test_renewed_lease_can_still_be_held(agent: Agent) -> None:
    """A renewed lease gets a later expiry; held open it has none and renewing or releasing it
    by id is AccessDenied; once the hold closes releasing it is NotFound.
    """
    async with AsyncClient(agent.socket_path) as client:
        handle = await client.ensure("s3://b/m/", lease=True, lease_ttl=5)
        assert handle.lease is not None
        renewed = await client.renew_lease(handle.lease.id, ttl=120)
        assert renewed.expires is not None
        assert handle.lease.expires is not None
        assert renewed.expires > handle.lease.expires
        async with AsyncLeaseHold(handle.lease, socket_path=agent.lease_socket):
            assert agent.table.get(handle.lease.id).expires is None  # held open: no expiry
            with pytest.raises(AccessDenied, match="held open"):
                await client.renew_lease(handle.lease.id)
            with pytest.raises(AccessDenied, match="held open"):
                await client.release_lease(handle.lease.id)
            assert agent.table.get(handle.lease.id).held
        # Closing the hold waited for the agent: the lease is gone already.
        with pytest.raises(NotFound):
            await client.release_lease(handle.lease.id)


def _grant(record: LeaseRecord, agent: Agent) -> LeaseGrant:
    return LeaseGrant(id=record.id, key=record.key, expires=None, socket_path=agent.lease_socket)
