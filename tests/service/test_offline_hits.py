"""Hits that never wait on S3: a refused endpoint falls back at once, cached_only asks S3 nothing.

The refused-endpoint tests set ``offline_after_seconds`` and botocore's attempts
high, so an agent that still retried the listing would run into the test's
timeout: they pin behaviour, not a duration.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import AgentFactory, cache_entries, tree_digest

from agent._config import S3Settings, Settings
from agent._exceptions import NotFound, SourceUnavailable
from agent._uri import parse_uri
from agent.client import Client
from agent.leases.table import LeaseTable
from agent.pull.puller import Puller
from agent.service.operations import AgentService
from agent.service.request import EnsureRequest
from agent.service.results import EnsureResult
from agent.source.interface import ObjectSource
from agent.source.s3 import S3Source, SourceUnreachable
from agent.store.catalog import Store
from agent.testing import Fault, FaultProxy, MemorySource, S3Server, SampleModel, upload_model

# Long enough that waiting for it, or for botocore's 20 attempts, trips the test timeout.
PATIENT = "offline_after_seconds = 600\n[s3]\nretries = 20\n"

ServiceFactory = Callable[..., AbstractAsyncContextManager[AgentService]]


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The shared server's credentials in this process's environment, for an S3Source here."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def service_over(tmp_path: Path) -> ServiceFactory:
    """Build the agent's operations over a given source, on tiers under tmp_path."""

    @asynccontextmanager
    async def build(source: ObjectSource, **settings: Any) -> AsyncIterator[AgentService]:
        config = Settings.model_validate(
            {
                "socket_path": tmp_path / "agent.sock",
                "tiers": {"shm_root": tmp_path / "shm", "disk_root": tmp_path / "disk"},
                **settings,
            }
        )
        store = Store({"shm": tmp_path / "shm", "disk": tmp_path / "disk"})
        await store.open()
        async with Puller(store, source, S3Settings()) as puller:
            yield AgentService(store, puller, source, LeaseTable(60, 3600), settings=config)

    return build


async def _ensure(
    service: AgentService, uri: str, include: tuple[str, ...] = (), *, cached_only: bool = False
) -> EnsureResult:
    request = EnsureRequest(uri=parse_uri(uri), include=include, cached_only=cached_only)
    results = [e async for e in service.ensure(request)]
    result = results[-1]
    assert isinstance(result, EnsureResult)
    return result


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _s3_settings(endpoint_url: str, **overrides: Any) -> S3Settings:
    return S3Settings(endpoint_url=endpoint_url, addressing_style="path", **overrides)


def test_refused_endpoint_serves_the_cached_snapshot_at_once(
    start_agent: AgentFactory,
    stoppable_s3: S3Server,
    small_model_source: tuple[Path, Mapping[str, Any]],
) -> None:
    """With S3 refusing connections, a cached model's hit returns offline without retries.

    offline_after_seconds is 600 and botocore may make 20 attempts: only a
    fallback at the first refused connection returns within the test timeout.
    """
    stoppable_s3.client().create_bucket(Bucket="refused")
    model = upload_model(
        stoppable_s3.client(),
        "refused",
        "models/small",
        small_model_source[0],
        tensors=small_model_source[1],
    )
    agent = start_agent(PATIENT, s3=stoppable_s3)
    with Client(agent.socket_path) as client:
        cold = client.ensure(model.uri)
        stoppable_s3.stop()
        warm = client.ensure(model.uri)
    assert (warm.hit, warm.resolved_offline, warm.path) == (True, True, cold.path)
    assert tree_digest(warm.path) == tree_digest(model.source_dir)


def test_uncached_model_with_refused_endpoint_is_unavailable_at_once(
    start_agent: AgentFactory, stoppable_s3: S3Server
) -> None:
    """A model never cached, S3 refusing connections: UNAVAILABLE naming the endpoint, at once."""
    agent = start_agent(PATIENT, s3=stoppable_s3)
    stoppable_s3.stop()
    with Client(agent.socket_path) as client, pytest.raises(SourceUnavailable) as caught:
        client.ensure("s3://refused/models/never-pulled/")
    assert "Cannot reach S3 at http://127.0.0.1:" in str(caught.value)
    assert "AWS_ENDPOINT_URL" in str(caught.value)
    assert cache_entries(agent) == {}


def test_hit_with_s3_up_still_lists_the_prefix(
    agent_daemon: Any, s3_server: S3Server, small_model: SampleModel
) -> None:
    """A hit with S3 answering is checked against a fresh listing, not served unchecked."""
    with Client(agent_daemon.socket_path) as client:
        client.ensure(small_model.uri)
        s3_server.clear_requests()
        warm = client.ensure(small_model.uri)
    assert (warm.hit, warm.resolved_offline) == (True, False)
    listings = [r for r in s3_server.requests(bucket=small_model.bucket) if r.key is None]
    assert [r.query_params.get("list-type") for r in listings] == ["2"]


async def test_listing_a_refused_endpoint_is_unreachable_after_one_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """S3Source reports a refused listing as SourceUnreachable without botocore's retries."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    settings = _s3_settings(f"http://127.0.0.1:{_closed_port()}", retries=20)
    async with S3Source(settings) as source:
        with pytest.raises(SourceUnreachable, match="Cannot reach S3"):
            await source.list_objects(parse_uri("s3://refused/models/m/"))


async def test_listing_through_throttling_is_still_retried(
    s3_env: S3Server, small_model: SampleModel
) -> None:
    """A listing answered 503 SlowDown is retried with the full schedule, not failed at once."""
    with FaultProxy(s3_env.endpoint_url) as proxy:
        proxy.add(Fault.slow_down(key=f"/{small_model.bucket}", times=2))
        async with S3Source(_s3_settings(proxy.endpoint_url)) as source:
            listed = await source.list_objects(parse_uri(small_model.uri))
        assert proxy.injected("slow_down") == 2
    assert {o.key for o in listed} == set(small_model.keys)


def test_cached_only_through_the_socket_asks_s3_nothing(
    agent_daemon: Any, s3_server: S3Server, small_model: SampleModel
) -> None:
    """EnsureModel(cached_only) over the socket serves the cached snapshot with no S3 request."""
    with Client(agent_daemon.socket_path) as client:
        cold = client.ensure(small_model.uri)
        s3_server.clear_requests()
        cached = client.ensure(small_model.uri, cached_only=True)
    assert s3_server.requests(bucket=small_model.bucket) == []
    assert (cached.hit, cached.resolved_offline, cached.path) == (True, True, cold.path)


async def test_cached_only_makes_no_s3_request(
    s3_env: S3Server, small_model: SampleModel, service_over: ServiceFactory
) -> None:
    """cached_only answers the newest cached snapshot, unchecked, and S3 sees no request."""
    async with (
        S3Source(_s3_settings(s3_env.endpoint_url)) as source,
        service_over(source) as service,
    ):
        cold = await _ensure(service, small_model.uri)
        s3_env.clear_requests()
        cached = await _ensure(service, small_model.uri, cached_only=True)
    assert s3_env.requests(bucket=small_model.bucket) == []
    assert (cached.hit, cached.resolved_offline) == (True, True)
    assert (cached.model.key, cached.model.path) == (cold.model.key, cold.model.path)


async def test_cached_only_of_an_uncached_model_is_not_found_naming_the_fix(
    service_over: ServiceFactory,
) -> None:
    """cached_only with nothing cached for the URI and filters: NotFound saying how to pull it."""
    source = MemorySource()
    source.put("models", "m/a.bin", b"a" * 1024)
    async with service_over(source) as service:
        await _ensure(service, "s3://models/m/")
        with pytest.raises(NotFound, match="cached_only") as caught:
            await _ensure(service, "s3://models/m/", include=("*.json",), cached_only=True)
    assert "include ['*.json']" in str(caught.value)
    assert "--cached-only" in str(caught.value)


async def test_slow_listing_falls_back_after_offline_after_seconds(
    s3_env: S3Server,
    small_model: SampleModel,
    service_over: ServiceFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A listing that connects but gets no answer waits offline_after_seconds, then falls back.

    The warning names the silent listing, so the fallback came from waiting,
    not from a refused connection.
    """
    with FaultProxy(s3_env.endpoint_url) as proxy:
        async with (
            S3Source(_s3_settings(proxy.endpoint_url)) as source,
            service_over(source, offline_after_seconds=0.5) as service,
        ):
            cold = await _ensure(service, small_model.uri)
            proxy.add(Fault.stall(key=f"/{small_model.bucket}", times=None))
            with caplog.at_level(logging.WARNING, logger="agent.pull.resolver"):
                warm = await _ensure(service, small_model.uri)
        assert proxy.injected("stall") >= 1
    assert (warm.resolved_offline, warm.model.key) == (True, cold.model.key)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no answer to the listing within 0.5 s" in warnings[0]
