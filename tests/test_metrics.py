"""Metrics over HTTP and request context in the logs, from the real daemon."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest
from agent_helpers import AgentFactory
from prometheus_client.parser import text_string_to_metric_families

from agent.client import Client, NotFound
from agent.testing import AgentProcess, SampleModel


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def metered_agent(start_agent: AgentFactory) -> tuple[AgentProcess, int]:
    port = free_port()
    return start_agent(f"[metrics]\nport = {port}\n"), port


def test_metrics_show_a_pull_and_a_hit(
    metered_agent: tuple[AgentProcess, int], small_model: SampleModel
) -> None:
    """A cold pull then a hit show up in bytes, lookups, requests, phase timings and tier gauges."""
    agent, port = metered_agent
    with Client(agent.socket_path) as client:
        client.ensure(small_model.uri)
        client.ensure(small_model.uri)
    samples = scrape(port)
    total = small_model.total_bytes
    assert value(samples, "prewarm_bytes_pulled_total", tier="shm") == total
    assert value(samples, "prewarm_cache_lookups_total", result="miss") == 1
    assert value(samples, "prewarm_cache_lookups_total", result="hit") == 1
    assert value(samples, "prewarm_requests_total", method="EnsureModel", result="ok") == 2
    assert value(samples, "prewarm_phase_seconds_count", phase="download", lookup="miss") == 1
    assert value(samples, "prewarm_phase_seconds_count", phase="total", lookup="hit") == 1
    assert value(samples, "prewarm_phase_seconds_sum", phase="total", lookup="miss") > 0
    assert value(samples, "prewarm_tier_used_bytes", tier="shm") == total
    assert value(samples, "prewarm_tier_models", tier="shm") == 1
    assert value(samples, "prewarm_tier_budget_bytes", tier="shm") > total
    assert value(samples, "prewarm_pulls_in_flight") == 0


def test_metrics_count_a_failed_request_by_its_status_code(
    metered_agent: tuple[AgentProcess, int], bucket: str
) -> None:
    """A request that fails is counted under its gRPC status name, not as ok."""
    agent, port = metered_agent
    with Client(agent.socket_path) as client:
        with pytest.raises(NotFound):
            client.ensure(f"s3://{bucket}/nothing-here/")
        # The status leaves the server just before the interceptor counts it; the
        # daemon's single event loop resumes that handler (and counts) before it
        # can serve a request the client sends only after reading the status.
        client.status()
    samples = scrape(port)
    assert value(samples, "prewarm_requests_total", method="EnsureModel", result="NOT_FOUND") == 1
    assert value(samples, "prewarm_requests_total", method="EnsureModel", result="ok") == 0
    assert value(samples, "prewarm_requests_total", method="Status", result="ok") == 1


def test_metrics_count_leases_and_manual_evictions(
    metered_agent: tuple[AgentProcess, int], small_model: SampleModel
) -> None:
    """The lease gauge follows a lease's life, and an eviction by hand is counted as manual."""
    agent, port = metered_agent
    with Client(agent.socket_path) as client:
        with client.leased(small_model.uri):
            assert value(scrape(port), "prewarm_leases") == 1
        client.evict(small_model.uri)
    samples = scrape(port)
    assert value(samples, "prewarm_leases") == 0
    assert value(samples, "prewarm_evictions_total", tier="shm", reason="manual") == 1
    assert value(samples, "prewarm_tier_used_bytes", tier="shm") == 0


def test_every_log_line_of_a_pull_carries_the_uri_key_peer_and_client(
    agent_daemon: AgentProcess, small_model: SampleModel
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
