"""Leases belong to the socket that asked for them (issue 11, control 2: leases per socket).

A lease records the socket (tenant) whose EnsureModel was granted it; renewing or releasing
it from another socket is PERMISSION_DENIED, and a tenant sees only its own leases. In the
table, in the service with the in-memory source, and end to end over two real sockets.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import AgentFactory
from store_helpers import open_store

from agent._config import AccessLimits, Settings
from agent._exceptions import AccessDenied
from agent._uri import parse_uri
from agent.client import Client
from agent.leases.table import LeaseTable
from agent.pull.puller import Puller
from agent.service import access
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest, LeaseAsk
from agent.service.results import EnsureResult
from agent.testing import MemorySource, SampleModel
from agent.testing._process import purge_tree

MiB = 1024 * 1024


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: Unix socket paths are limited to 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="pw-ls-", dir="/tmp"))
    yield directory
    purge_tree(directory)


def test_only_the_granting_socket_renews_or_releases_a_lease() -> None:
    """renew/release naming another grantee are AccessDenied and leave the lease alone; the
    grantee itself, and in-process callers (no grantee), may."""
    table = LeaseTable(default_ttl=60, max_ttl=600)
    lease = table.grant("k", grantee="team-a")
    with pytest.raises(AccessDenied, match="another socket"):
        table.renew(lease.id, 30, grantee="team-b")
    with pytest.raises(AccessDenied, match="another socket"):
        table.release(lease.id, grantee="node")
    assert table.get(lease.id).expires == lease.expires
    table.renew(lease.id, 30, grantee="team-a")
    table.renew(lease.id, 30)
    table.release(lease.id, grantee="team-a")
    assert table.count() == 0


def _tenant(name: str) -> access.Tenant:
    none = AccessLimits()
    return access.Tenant(name, (), (), none, none, access.PullGate(0))


async def test_a_lease_records_its_tenant_and_other_tenants_do_not_see_it(tmp_path: Path) -> None:
    """ensure(lease=True) under tenant A grants a lease to A: B sees no lease on the snapshot
    and cannot release it; the node's socket sees it; A releases it."""
    source = MemorySource()
    source.put("models", "m/w.bin", b"w" * MiB)
    settings = Settings.model_validate(
        {
            "socket_path": tmp_path / "agent.sock",
            "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
        }
    )
    store = await open_store(tmp_path)
    async with Puller(store, source, settings.s3) as puller:
        service = AgentService(store, puller, source, LeaseTable(60, 600), settings=settings)
        team_a, team_b = _tenant("team-a"), _tenant("team-b")
        as_a, as_b = access.Requester(team_a), access.Requester(team_b)
        request = EnsureRequest(
            uri=parse_uri("s3://models/m/"), tier="shm", lease=LeaseAsk(), requester=as_a
        )
        events = [e async for e in service.ensure(request)]
        result = events[-1]
        assert isinstance(result, EnsureResult)
        assert result.lease is not None
        assert result.lease.grantee == "team-a"
        key = result.model.key
        assert service.leases_for(key, as_b) == []
        with pytest.raises(AccessDenied):
            service.release_lease(result.lease.id, as_b)
        as_node = access.Requester(_tenant(access.NODE_TENANT))
        assert [lease.id for lease in service.leases_for(key, as_node)] == [result.lease.id]
        assert len(service.leases_for(key, as_a)) == 1
        service.release_lease(result.lease.id, as_a)
        assert service.leases_for(key, as_a) == []


def test_a_lease_from_a_tenant_socket_is_not_renewed_or_released_from_another(
    start_agent: AgentFactory, small_model: SampleModel, short_dir: Path
) -> None:
    """A lease granted on a tenant socket: RenewLease/ReleaseLease on the API socket are
    PERMISSION_DENIED, and the other way round; each socket ends its own lease."""
    tenant_socket = short_dir / "a.sock"
    agent = start_agent(f'[[access.sockets]]\nname = "team-a"\npath = "{tenant_socket}"\n')
    with Client(tenant_socket) as tenant, Client(agent.socket_path) as node:
        from_tenant = tenant.ensure(small_model.uri, lease=True).lease
        from_node = node.ensure(small_model.uri, lease=True).lease
        assert from_tenant is not None
        assert from_node is not None
        with pytest.raises(AccessDenied, match="another socket"):
            node.renew_lease(from_tenant.id, 30)
        with pytest.raises(AccessDenied, match="another socket"):
            node.release_lease(from_tenant.id)
        with pytest.raises(AccessDenied, match="another socket"):
            tenant.release_lease(from_node.id)
        tenant.renew_lease(from_tenant.id, 30)
        tenant.release_lease(from_tenant.id)
        node.release_lease(from_node.id)
        assert node.status().lease_count == 0
