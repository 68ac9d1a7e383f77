"""agent.testing.InProcessAgent: serve() on a thread of the test process, used by start_agent."""

from __future__ import annotations

import os

import pytest
from agent_helpers import AgentFactory

from agent import InvalidRequest
from agent.client import Client
from agent.testing import AgentStartupError, InProcessAgent, S3Server


def test_start_serves_and_stop_returns_zero_and_removes_the_socket(s3_server: S3Server) -> None:
    """start() returns once the API answers; stop() ends serve() cleanly, like SIGTERM."""
    with InProcessAgent(env=s3_server.env()) as agent:
        with Client(agent.socket_path) as client:
            assert {t.tier: t.root for t in client.status().tiers} == {
                "shm": agent.shm_root,
                "disk": agent.disk_root,
            }
        assert agent.running
        assert agent.pid == os.getpid()
        assert agent.stop() == 0
        assert not agent.running
        assert not agent.socket_path.exists()


def test_restart_keeps_the_directory_and_the_log_holds_both_runs(s3_server: S3Server) -> None:
    """restart() serves again on the same root; log_text() has the agent's JSON lines of both."""
    with InProcessAgent(env=s3_server.env()) as agent:
        (agent.root / "kept").write_text("x")
        agent.restart()
        assert (agent.root / "kept").read_text() == "x"
        serving = [line for line in agent.log_text().splitlines() if '"prewarmd ' in line]
    assert len(serving) == 2


def test_a_config_error_fails_start_with_the_reason(s3_server: S3Server) -> None:
    """A bad config makes start() raise at once, and the next agent may start."""
    broken = InProcessAgent(env=s3_server.env(), config="[s3]\nconcurrency = 0\n")
    with pytest.raises(InvalidRequest, match="concurrency"):
        broken.start()
    assert InProcessAgent.active() is None
    broken.close()


def test_a_second_in_process_agent_is_refused_while_one_runs(s3_server: S3Server) -> None:
    """Only one in-process agent at a time: the metrics registry and os.environ are shared."""
    with InProcessAgent(env=s3_server.env()) as first:
        second = InProcessAgent(env=s3_server.env(), root=first.root)
        with pytest.raises(AgentStartupError, match="Another in-process agent"):
            second.start()
    assert InProcessAgent.active() is None


def test_the_agents_aws_environment_is_put_back_when_it_stops(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While it runs the agent sees its own AWS_* variables; the test process gets its own back."""
    monkeypatch.setenv("AWS_PROFILE", "a-developers-profile")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with InProcessAgent(env=s3_server.env()):
        assert "AWS_PROFILE" not in os.environ
        assert os.environ["AWS_ENDPOINT_URL"] == s3_server.endpoint_url
    assert os.environ["AWS_PROFILE"] == "a-developers-profile"
    assert "AWS_ENDPOINT_URL" not in os.environ


def test_start_agent_runs_a_second_agent_as_a_subprocess(start_agent: AgentFactory) -> None:
    """The fixture's first agent is in-process; one started while it runs is a daemon subprocess."""
    first, second = start_agent(), start_agent()
    assert isinstance(first, InProcessAgent)
    assert second.pid != os.getpid()
