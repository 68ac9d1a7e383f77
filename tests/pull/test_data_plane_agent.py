"""The data-plane setting and per-request pull options, through the real daemon, client and CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import AgentFactory, object_gets, tree_digest

from agent import InvalidRequest
from agent.client import Client
from agent.testing import AgentProcess, AgentStartupError, RecordedRequest, S3Server, SampleModel

MiB = 1024 * 1024


def _ranged_gets(s3: S3Server, model: SampleModel) -> list[RecordedRequest]:
    return [g for g in object_gets(s3.requests(bucket=model.bucket)) if g.range]


def _range_length(request: RecordedRequest) -> int:
    assert request.range is not None
    start, end = request.range.removeprefix("bytes=").split("-")
    return int(end) - int(start) + 1


def _is_botocore(request: RecordedRequest) -> bool:
    return "botocore" in request.user_agent.lower()


def test_status_names_the_processes_plane(start_agent: AgentFactory) -> None:
    """Status reports the plane that data_plane = "auto" resolves to on S3: processes."""
    agent = start_agent()
    with Client(agent.socket_path) as client:
        assert client.status().data_plane == "processes"


@pytest.mark.parametrize("removed", ["threads", "streamer"])
def test_a_config_naming_a_removed_plane_refuses_to_start_saying_what_to_use(
    removed: str, s3_server: S3Server
) -> None:
    """data_plane = "threads" or "streamer" stops startup with a log line saying the plane was
    removed and to use auto."""
    agent = AgentProcess(env=s3_server.env(), config=f'[s3]\ndata_plane = "{removed}"\n')
    try:
        with pytest.raises(AgentStartupError):
            agent.start()
        log = agent.log_text()
    finally:
        agent.close()
    assert f"The {removed} data plane was removed" in log
    assert "use auto" in log


@pytest.mark.parametrize("removed", ["threads", "streamer"])
def test_a_request_for_a_removed_plane_is_invalid_and_publishes_nothing(
    removed: str, start_agent: AgentFactory, small_model: SampleModel
) -> None:
    """A request naming a removed plane is InvalidRequest naming what to use instead."""
    agent = start_agent()
    with Client(agent.socket_path) as client:
        with pytest.raises(InvalidRequest, match=r"was removed.*use auto"):
            client.ensure(small_model.uri, data_plane=removed)  # type: ignore[arg-type]
        assert client.list_models() == []


def test_request_options_set_the_plane_and_the_chunk_size(
    start_agent: AgentFactory, s3_server: S3Server, small_model: SampleModel
) -> None:
    """A request's data plane and chunk size decide who sends the GETs and how large they are."""
    agent = start_agent()
    s3_server.clear_requests()
    with Client(agent.socket_path) as client:
        handle = client.ensure(
            small_model.uri, data_plane="aiobotocore", concurrency=1, chunk_size=2 * MiB
        )
    assert tree_digest(Path(handle.path)) == tree_digest(small_model.source_dir)
    gets = _ranged_gets(s3_server, small_model)
    assert gets
    assert all(_is_botocore(g) for g in gets)
    assert max(_range_length(g) for g in gets) == 2 * MiB


def test_an_unknown_data_plane_is_an_invalid_request(
    start_agent: AgentFactory, small_model: SampleModel
) -> None:
    """A data plane name the agent does not know is refused as InvalidRequest."""
    agent = start_agent()
    with Client(agent.socket_path) as client, pytest.raises(InvalidRequest, match="fastest"):
        client.ensure(small_model.uri, data_plane="fastest")  # type: ignore[arg-type]


def test_cli_pull_takes_plane_concurrency_and_chunk_size(
    start_agent: AgentFactory, s3_server: S3Server, small_model: SampleModel
) -> None:
    """`prewarm pull` passes --data-plane, --concurrency and --chunk-size through to the pull."""
    agent = start_agent()
    s3_server.clear_requests()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(agent.socket_path)
    options = ["--data-plane", "aiobotocore", "--concurrency", "1", "--chunk-size", "1MiB"]
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "pull", small_model.uri, *options, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert max(_range_length(g) for g in _ranged_gets(s3_server, small_model)) == MiB


def test_cli_refuses_a_malformed_chunk_size(agent_daemon: AgentProcess) -> None:
    """`prewarm pull --chunk-size lots` exits 2 with a usage error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(agent_daemon.socket_path)
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "pull", "s3://b/m/", "--chunk-size", "lots"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "not a size" in done.stderr


def test_a_first_pull_says_nothing_about_resuming(
    agent_process: AgentProcess, small_model: SampleModel
) -> None:
    """A pull with no staging left behind has nothing to resume and logs no "not resuming"
    line (every fresh pull used to log one, quoting ENOENT)."""
    with Client(agent_process.socket_path) as client:
        assert not client.ensure(small_model.uri).hit
    assert "not resuming" not in agent_process.log_text()
