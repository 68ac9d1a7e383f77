"""The request path in-process: one EnsureRequest carries its requester; the plane registry.

The requester is part of the request, not of the context it runs in: two
requests for the same URI in the same task are checked each against its own
tenant. The data-plane registry answers by name and resolves ``auto``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent._config import AccessLimits, S3Settings, Settings
from agent._exceptions import AccessDenied, InvalidRequest
from agent._uri import parse_uri
from agent.leases.table import LeaseTable
from agent.pull.puller import Puller
from agent.service.access import PullGate, Requester, Tenant
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult
from agent.source.plane_registry import DataPlanes
from agent.store.catalog import Store
from agent.testing import MemorySource

URI = "s3://models/m/"


def _tenant(name: str, sources: tuple[str, ...]) -> Tenant:
    none = AccessLimits()
    return Tenant(name, sources, (), none, none, PullGate(0))


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[AgentService]:
    """The agent's operations over an in-memory source holding one small model."""
    source = MemorySource()
    source.put("models", "m/w.bin", b"w" * 1024)
    settings = Settings.model_validate(
        {
            "socket_path": tmp_path / "agent.sock",
            "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
        }
    )
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    async with Puller(store, source, S3Settings()) as puller:
        yield AgentService(store, puller, source, LeaseTable(60, 3600), settings=settings)


async def _answer(service: AgentService, request: EnsureRequest) -> EnsureResult:
    events = [event async for event in service.ensure(request)]
    assert isinstance(events[-1], EnsureResult)
    return events[-1]


async def test_each_request_is_checked_against_its_own_requester(service: AgentService) -> None:
    """Same task, same URI: the tenant allowed other sources is denied, the next one served."""
    elsewhere = Requester(_tenant("team-b", ("s3://other/*",)))
    allowed = Requester(_tenant("team-a", ("s3://models/*",)))
    with pytest.raises(AccessDenied, match="team-b"):
        await _answer(service, EnsureRequest(uri=parse_uri(URI), requester=elsewhere))
    result = await _answer(service, EnsureRequest(uri=parse_uri(URI), requester=allowed))
    assert not result.hit


def test_a_request_checks_its_filters_and_puts_them_in_canonical_order() -> None:
    """Globs are deduplicated and sorted however the request is built; an empty one is refused."""
    request = EnsureRequest(uri=parse_uri(URI), include=("b*", "a*", "b*"))
    assert request.include == ("a*", "b*")
    with pytest.raises(InvalidRequest, match="Exclude pattern"):
        EnsureRequest(uri=parse_uri(URI), exclude=("",))


async def test_auto_is_aiobotocore_on_a_source_that_cannot_presign() -> None:
    """The processes plane cannot run on the in-memory source: auto is aiobotocore."""
    async with DataPlanes(MemorySource(), S3Settings(), gbps=25.0) as planes:
        assert planes.default.name == "aiobotocore"
        assert planes.choose("auto").name == "aiobotocore"
        assert planes.processes is None


async def test_naming_a_plane_that_cannot_run_here_says_why() -> None:
    """A request naming processes on a source that cannot presign is INVALID_ARGUMENT."""
    async with DataPlanes(MemorySource(), S3Settings(), gbps=25.0) as planes:
        with pytest.raises(InvalidRequest, match="no processes data plane"):
            planes.choose("processes")
