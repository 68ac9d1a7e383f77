"""Both data planes against the real S3 server, directly and through a fault-injecting proxy.

The puller runs in the test's event loop with a real ``S3Source``; the server is
moto in its own process (``s3_server``), and ``FaultProxy`` sits between them
when a test needs S3 to misbehave. Every successful pull must publish files
byte-identical to the source; a pull that cannot succeed must publish nothing.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from source_helpers import restored_environment

from agent import SourceUnavailable
from agent._config import Settings
from agent._uri import parse_uri
from agent._vocabulary import DataPlaneName, PullOptions
from agent.leases.table import LeaseTable
from agent.pull.puller import Puller
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult
from agent.source.range_worker import USER_AGENT as PROCESSES_USER_AGENT
from agent.source.s3 import S3Source
from agent.store.catalog import Store
from agent.testing import Fault, FaultKind, FaultProxy, S3Server, SampleModel

MiB = 1024 * 1024
PLANES = ["processes", "aiobotocore"]


def _plane_params() -> list[Any]:
    """Both planes: the S3 data plane, and the in-loop reads a request may still ask for."""
    return [pytest.param(plane) for plane in PLANES]


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    # The tests point botocore at their server through the process environment;
    # give the next test the environment back.
    with restored_environment():
        yield


def _use_endpoint(s3: S3Server, endpoint: str) -> None:
    os.environ.update(s3.env())
    os.environ["AWS_ENDPOINT_URL"] = endpoint


class Agent:
    """A puller and the service around it, in this event loop."""

    def __init__(self, service: AgentService, puller: Puller, store: Store) -> None:
        self.service = service
        self.puller = puller
        self.store = store

    async def ensure(
        self, uri: str, options: PullOptions | None = None, include: tuple[str, ...] = ()
    ) -> EnsureResult:
        result = None
        async for event in self.service.ensure(
            EnsureRequest(uri=parse_uri(uri), include=include, options=options)
        ):
            if isinstance(event, EnsureResult):
                result = event
        assert result is not None
        return result


@asynccontextmanager
async def running_agent(
    tmp_path: Path, s3: S3Server, endpoint: str, **s3_settings: Any
) -> AsyncIterator[Agent]:
    _use_endpoint(s3, endpoint)
    values: dict[str, Any] = {
        "endpoint_url": endpoint,
        "addressing_style": "path",
        "chunk_size": MiB,
        "concurrency": 2,
        "retries": 2,
    }
    values.update(s3_settings)
    settings = Settings.model_validate(
        {
            "default_tier": "disk",
            "socket_path": tmp_path / "agent.sock",
            "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
            "s3": values,
        }
    )
    store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
    await store.open()
    async with (
        S3Source(settings.s3) as source,
        Puller(store, source, settings.s3, settings.integrity) as puller,
    ):
        service = AgentService(store, puller, source, LeaseTable(60, 3600), settings=settings)
        yield Agent(service, puller, store)


def assert_identical(result: EnsureResult, model: SampleModel) -> None:
    for key in model.keys:
        relative = key[len(model.prefix) :]
        expected = (model.source_dir / relative).read_bytes()
        assert (result.model.path / relative).read_bytes() == expected, relative


def shards(model: SampleModel) -> list[str]:
    return sorted(key for key in model.keys if key.endswith(".safetensors"))


def only(key: str) -> str:
    """An include glob that matches just this object."""
    return key.rsplit("/", 1)[-1]


def published(tmp_path: Path) -> list[str]:
    return [
        p.name
        for tier in ("shm", "disk")
        if (tmp_path / tier / "snapshots").is_dir()
        for p in (tmp_path / tier / "snapshots").iterdir()
    ]


def sent_by(user_agent: str) -> str:
    """The data plane a GET's User-Agent names."""
    if PROCESSES_USER_AGENT in user_agent:
        return "processes"
    return "aiobotocore" if "botocore" in user_agent.lower() else "unknown"


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the shared S3 server."""
    with FaultProxy(s3_server.endpoint_url) as running:
        yield running


# -- each plane, straight to the server -------------------------------------------------


@pytest.mark.parametrize("plane", _plane_params())
async def test_plane_publishes_byte_identical_files(
    plane: DataPlaneName, tmp_path: Path, s3_server: S3Server, small_model: SampleModel
) -> None:
    """Each plane publishes the model byte for byte, one journal range per delivered chunk."""
    s3_server.clear_requests()
    async with running_agent(tmp_path, s3_server, s3_server.endpoint_url) as agent:
        result = await agent.ensure(small_model.uri, PullOptions(data_plane=plane))
        # The published digests are per journal range; re-hashing the files by
        # range finds them equal only if every delivered chunk was one range.
        [check] = await agent.service.verify(result.model.key, every=False, report_only=True)
    assert_identical(result, small_model)
    assert check.problems == ()
    agents = [
        r.user_agent
        for r in s3_server.requests(bucket=small_model.bucket)
        if r.method == "GET" and r.range
    ]
    # The bytes really came through the plane asked for.
    assert agents
    assert all(sent_by(agent) == plane for agent in agents), agents


async def test_a_pull_resumes_from_another_planes_journal(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, proxy: FaultProxy
) -> None:
    """A processes pull resumes from ranges an aiobotocore pull journaled before it failed."""
    # aiobotocore gives up on the last shard half way (every GET of it fails)...
    last = shards(small_model)[-1]
    proxy.add(Fault.internal_error(key=last, times=None))
    async with running_agent(tmp_path, s3_server, proxy.endpoint_url, retries=0) as agent:
        with pytest.raises(SourceUnavailable):
            await agent.ensure(small_model.uri, PullOptions(data_plane="aiobotocore"))
        proxy.clear()
        # ...and the processes plane fetches only what is missing.
        result = await agent.ensure(small_model.uri, PullOptions(data_plane="processes"))
    assert_identical(result, small_model)
    assert 0 < result.resumed_bytes < result.model.total_bytes


# -- transient faults: retried, byte-identical ------------------------------------------


FAULTS: dict[str, Fault] = {
    "internal_error": Fault.internal_error(times=2),
    "slow_down": Fault.slow_down(times=2),
    "reset": Fault.reset(times=2),
    "truncate": Fault.truncate(after_bytes=100_000, times=2),
}


@pytest.mark.parametrize("plane", _plane_params())
@pytest.mark.parametrize("kind", list(FAULTS))
async def test_transient_faults_are_retried_and_the_result_is_identical(
    plane: DataPlaneName,
    kind: FaultKind,
    *,
    tmp_path: Path,
    s3_server: S3Server,
    small_model: SampleModel,
    proxy: FaultProxy,
) -> None:
    """5xx, SlowDown, resets and short bodies are retried and the files come out identical."""
    template = FAULTS[kind]
    # Only object GETs, so the listing and the checksum HEADs go through untouched.
    proxy.add(
        Fault(template.kind, key=small_model.prefix, times=2, after_bytes=template.after_bytes)
    )
    async with running_agent(tmp_path, s3_server, proxy.endpoint_url) as agent:
        result = await agent.ensure(small_model.uri, PullOptions(data_plane=plane))
    assert proxy.injected(kind) == 2
    assert_identical(result, small_model)


@pytest.mark.parametrize("plane", _plane_params())
async def test_a_stalled_get_is_abandoned_and_retried(
    plane: DataPlaneName,
    tmp_path: Path,
    s3_server: S3Server,
    small_model: SampleModel,
    proxy: FaultProxy,
) -> None:
    """A GET that goes silent is dropped after the low-speed window, not the read timeout."""
    proxy.add(Fault.stall(after_bytes=10_000, key=small_model.prefix, times=1))
    async with running_agent(tmp_path, s3_server, proxy.endpoint_url, low_speed_seconds=1) as agent:
        result = await agent.ensure(small_model.uri, PullOptions(data_plane=plane))
    assert proxy.injected("stall") == 1
    assert_identical(result, small_model)
    # Abandoned after the low-speed window, long before the 60 s read timeout.
    assert result.timings.download < 30


# -- persistent faults: the pull fails, names the object, publishes nothing -------------


@pytest.mark.parametrize("plane", _plane_params())
async def test_a_persistent_fault_fails_the_pull_naming_the_object(
    plane: DataPlaneName,
    tmp_path: Path,
    s3_server: S3Server,
    small_model: SampleModel,
    proxy: FaultProxy,
) -> None:
    """An object that keeps failing fails the pull with its S3 URI and cause; nothing published."""
    victim = shards(small_model)[1]
    proxy.add(Fault.slow_down(key=victim, times=None))
    async with running_agent(tmp_path, s3_server, proxy.endpoint_url, retries=1) as agent:
        with pytest.raises(SourceUnavailable) as failure:
            # Only the victim: the failure names it, and nothing else is pulled.
            await agent.ensure(small_model.uri, PullOptions(data_plane=plane), (only(victim),))
    message = str(failure.value)
    assert f"s3://{small_model.bucket}/{victim}" in message
    assert "SlowDown" in message
    assert published(tmp_path) == []


@pytest.mark.parametrize("plane", _plane_params())
async def test_a_body_that_is_always_cut_short_is_never_published(
    plane: DataPlaneName,
    tmp_path: Path,
    s3_server: S3Server,
    small_model: SampleModel,
    proxy: FaultProxy,
) -> None:
    """A body always cut short fails the pull naming the object, and publishes nothing."""
    victim = shards(small_model)[0]
    proxy.add(Fault.truncate(after_bytes=1000, key=victim, times=None))
    async with running_agent(tmp_path, s3_server, proxy.endpoint_url, retries=1) as agent:
        with pytest.raises(SourceUnavailable, match=victim):
            await agent.ensure(small_model.uri, PullOptions(data_plane=plane), (only(victim),))
    assert published(tmp_path) == []


# -- stopping ---------------------------------------------------------------------------


async def test_stopping_a_pull_does_not_wait_out_a_silent_s3(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel, proxy: FaultProxy
) -> None:
    """Shutdown stops a pull stuck on a silent S3 promptly and keeps its staging."""
    # Every GET goes silent: the workers would wait for the first-byte deadline.
    proxy.add(Fault.stall(key=small_model.prefix, times=None))
    async with running_agent(tmp_path, s3_server, proxy.endpoint_url, low_speed_seconds=1) as agent:
        pull = asyncio.create_task(
            agent.ensure(small_model.uri, PullOptions(data_plane="processes"))
        )
        await asyncio.to_thread(proxy.wait_injected, "stall")
        stopping = time.monotonic()
        # Leaving the block stops the puller, which cancels its pulls (a shutdown).
    stopped = time.monotonic() - stopping
    with pytest.raises(asyncio.CancelledError):
        await pull
    assert stopped < 10, stopped
    assert published(tmp_path) == []
    assert list((tmp_path / "disk" / "staging").iterdir())  # kept for a resume
