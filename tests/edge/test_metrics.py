"""Metrics over HTTP and request context in the logs, from the real daemon."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import urllib.request

import pytest
from agent_helpers import AgentFactory, RunningAgent
from prometheus_client.parser import text_string_to_metric_families

from agent.client import AsyncClient, Client, NotFound
from agent.testing import SampleModel


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class Meter:
    """Scrapes of one agent's endpoint, read against the scrape taken when it started.

    Counters are process-wide: an agent running in the test process starts from
    what earlier tests counted, so counters are read as growth since the start.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self._baseline = scrape(port)
        self._latest = self._baseline

    def scrape(self) -> Meter:
        self._latest = scrape(self.port)
        return self

    def now(self, name: str, **labels: str) -> float:
        """A gauge's value at the last scrape."""
        return self._latest.get((name, frozenset(labels.items())), 0.0)

    def grew(self, name: str, **labels: str) -> float:
        """How much a counter (or a histogram's count or sum) grew since the agent started."""
        key = (name, frozenset(labels.items()))
        return self._latest.get(key, 0.0) - self._baseline.get(key, 0.0)

    def grown(self, name: str) -> Samples:
        """Every label set of a counter that grew since the agent started, with its growth."""
        growth = {
            key: value - self._baseline.get(key, 0.0)
            for key, value in self._latest.items()
            if key[0] == name
        }
        return {key: value for key, value in growth.items() if value}


@pytest.fixture
def metered_agent(start_agent: AgentFactory) -> tuple[RunningAgent, Meter]:
    port = free_port()
    agent = start_agent(f"[metrics]\nport = {port}\n")
    return agent, Meter(port)


def test_metrics_show_a_pull_and_a_hit(
    metered_agent: tuple[RunningAgent, Meter], small_model: SampleModel
) -> None:
    """A cold pull then a hit show up in bytes, lookups, requests, phase timings and tier gauges;
    the node's adaptive limit of GETs is shown, with no GET left in flight after the pull."""
    agent, meter = metered_agent
    with Client(agent.socket_path) as client:
        client.ensure(small_model.uri)
        client.ensure(small_model.uri)
    meter.scrape()
    total = small_model.total_bytes
    assert meter.grew("prewarm_bytes_pulled_total", tier="shm") == total
    assert meter.grew("prewarm_cache_lookups_total", result="miss") == 1
    assert meter.grew("prewarm_cache_lookups_total", result="hit") == 1
    assert meter.grew("prewarm_requests_total", method="EnsureModel", result="ok") == 2
    assert meter.grew("prewarm_phase_seconds_count", phase="download", lookup="miss") == 1
    assert meter.grew("prewarm_phase_seconds_count", phase="total", lookup="hit") == 1
    assert meter.grew("prewarm_phase_seconds_sum", phase="total", lookup="miss") > 0
    assert meter.now("prewarm_tier_used_bytes", tier="shm") == total
    assert meter.now("prewarm_tier_models", tier="shm") == 1
    assert meter.now("prewarm_tier_budget_bytes", tier="shm") > total
    assert meter.now("prewarm_pulls_in_flight") == 0
    assert meter.now("prewarm_s3_gets_limit") >= 4
    assert meter.now("prewarm_s3_gets_in_flight") == 0


def test_metrics_show_free_space_per_tier_and_the_process(
    metered_agent: tuple[RunningAgent, Meter],
) -> None:
    """Each tier's filesystem free and total bytes (as statvfs says) and the process_* gauges of
    prometheus-client's process collector are scraped."""
    agent, meter = metered_agent
    meter.scrape()
    for tier, root in (("shm", agent.shm_root), ("disk", agent.disk_root)):
        fs = os.statvfs(root)
        capacity = meter.now("prewarm_tier_capacity_bytes", tier=tier)
        assert capacity == fs.f_blocks * fs.f_frsize
        free = meter.now("prewarm_tier_free_bytes", tier=tier)
        # Other tests write to the same filesystems meanwhile: free is a moment's reading.
        assert 0 < free <= capacity
    assert meter.now("process_resident_memory_bytes") > 0
    assert meter.now("process_open_fds") > 0
    assert meter.now("process_start_time_seconds") > 0


def test_metrics_count_a_failed_request_by_its_status_code(
    metered_agent: tuple[RunningAgent, Meter], bucket: str
) -> None:
    """A request that fails is counted under its gRPC status name, not as ok."""
    agent, meter = metered_agent
    with Client(agent.socket_path) as client:
        with pytest.raises(NotFound):
            client.ensure(f"s3://{bucket}/nothing-here/")
        # The status leaves the server just before the interceptor counts it; the
        # agent's single event loop resumes that handler (and counts) before it
        # can serve a request the client sends only after reading the status.
        client.status()
    meter.scrape()
    assert meter.grew("prewarm_requests_total", method="EnsureModel", result="NOT_FOUND") == 1
    assert meter.grew("prewarm_requests_total", method="EnsureModel", result="ok") == 0
    assert meter.grew("prewarm_requests_total", method="Status", result="ok") == 1


def test_metrics_count_leases_and_manual_evictions(
    metered_agent: tuple[RunningAgent, Meter], small_model: SampleModel
) -> None:
    """The lease gauge follows a lease's life, and an eviction by hand is counted as manual."""
    agent, meter = metered_agent
    with Client(agent.socket_path) as client:
        with client.leased(small_model.uri):
            assert meter.scrape().now("prewarm_leases") == 1
        client.evict(small_model.uri)
    meter.scrape()
    assert meter.now("prewarm_leases") == 0
    assert meter.grew("prewarm_evictions_total", tier="shm", reason="manual") == 1
    assert meter.now("prewarm_tier_used_bytes", tier="shm") == 0


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_normal_lease_release_counts_no_failed_request(
    metered_agent: tuple[RunningAgent, Meter], small_model: SampleModel, flavour: str
) -> None:
    """leased() ending normally sends no ReleaseLease that the agent would count as NOT_FOUND,
    so the documented failing-requests alert stays quiet on every pod exit."""
    agent, meter = metered_agent

    async def lease_async() -> None:
        async with AsyncClient(agent.socket_path) as client, client.leased(small_model.uri):
            pass

    if flavour == "sync":
        with Client(agent.socket_path) as client, client.leased(small_model.uri):
            pass
    else:
        asyncio.run(lease_async())
    with Client(agent.socket_path) as client:
        client.status()  # counted after any request sent before it (see above)
    meter.scrape()
    failed = {
        labels: value
        for (name, labels), value in meter.grown("prewarm_requests_total").items()
        if dict(labels)["result"] != "ok"
    }
    assert failed == {}
    assert meter.now("prewarm_leases") == 0


def test_every_log_line_of_a_pull_carries_the_uri_key_peer_and_client(
    agent_daemon: RunningAgent, small_model: SampleModel
) -> None:
    """Request context bound at the edge reaches the service's and the puller's log lines."""
    with Client(agent_daemon.socket_path) as client:
        handle = client.ensure(small_model.uri, client_name="ns/pod-a")
    lines = [json.loads(line) for line in agent_daemon.log_text().splitlines() if line[:1] == "{"]
    about_the_pull = [line for line in lines if small_model.uri in line["msg"]]
    # The service's "starting pull" line and the puller's "published" line at least.
    assert {line["logger"] for line in about_the_pull} >= {
        "agent.service.operations",
        "agent.pull.puller",
    }
    for line in about_the_pull:
        assert line["uri"] == small_model.uri, line
        assert line["key"] == handle.key, line
        assert line["peer"].startswith("unix:"), line
        assert line["client"] == "ns/pod-a", line
        assert line["method"] == "EnsureModel", line


def test_a_metrics_address_beyond_loopback_warns_at_start(start_agent: AgentFactory) -> None:
    """`metrics.address = "0.0.0.0"` still serves, but the agent warns once at start naming the
    address and the risk (no authentication, readable from the network); loopback does not."""
    port = free_port()
    agent = start_agent(f'[metrics]\naddress = "0.0.0.0"\nport = {port}\n')
    warnings = [
        record
        for record in _log_records(agent)
        if record["level"] == "warning" and "metrics" in record["msg"]
    ]
    assert len(warnings) == 1, warnings
    assert f"0.0.0.0:{port}" in warnings[0]["msg"]
    assert "not loopback" in warnings[0]["msg"]
    assert "no authentication" in warnings[0]["msg"]
    assert scrape(port)  # still served


def test_the_loopback_metrics_address_does_not_warn(
    metered_agent: tuple[RunningAgent, Meter],
) -> None:
    """The default address (127.0.0.1) serves metrics without a warning about them."""
    agent, _ = metered_agent
    records = _log_records(agent)
    assert [r for r in records if r["level"] == "warning" and "metrics" in r["msg"]] == []


def _log_records(agent: RunningAgent) -> list[dict[str, str]]:
    return [json.loads(line) for line in agent.log_text().splitlines() if line[:1] == "{"]
