"""The data-plane setting and per-request pull options, through the real daemon, client and CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import AgentFactory, object_gets, tree_digest

import agent
from agent import InvalidRequest
from agent.client import Client
from agent.source.plane_registry import AUTO_DATA_PLANE
from agent.source.streamer_plane import streamer_unavailable
from agent.source.sync_s3 import THREADS_USER_AGENT
from agent.testing import AgentProcess, AgentStartupError, RecordedRequest, S3Server, SampleModel

MiB = 1024 * 1024
_SOURCE_ROOT = str(Path(agent.__file__).resolve().parents[1])

needs_streamer = pytest.mark.skipif(
    streamer_unavailable() is not None,
    reason=f"the streamer extra is not importable: {streamer_unavailable()}",
)

# Started as sitecustomize, it makes the streamer look uninstalled to the daemon.
_HIDE_STREAMER = """
import sys

class _Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("runai_model_streamer", "runai_model_streamer_s3"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hidden())
"""


def _without_streamer(tmp_path: Path, s3: S3Server, config: str = "") -> AgentProcess:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(_HIDE_STREAMER)
    env = s3.env() | {"PYTHONPATH": os.pathsep.join([str(hide), _SOURCE_ROOT])}
    return AgentProcess(env=env, config=config)


def _ranged_gets(s3: S3Server, model: SampleModel) -> list[RecordedRequest]:
    return [g for g in object_gets(s3.requests(bucket=model.bucket)) if g.range]


def _range_length(request: RecordedRequest) -> int:
    assert request.range is not None
    start, end = request.range.removeprefix("bytes=").split("-")
    return int(end) - int(start) + 1


def _is_botocore(request: RecordedRequest) -> bool:
    return "botocore" in request.user_agent.lower()


def test_status_names_the_auto_data_plane(start_agent: AgentFactory) -> None:
    """Status reports the plane that data_plane = "auto" resolves to."""
    agent = start_agent()
    with Client(agent.socket_path) as client:
        assert client.status().data_plane == AUTO_DATA_PLANE


@needs_streamer
def test_status_names_the_configured_streamer(start_agent: AgentFactory) -> None:
    """With data_plane = "streamer" configured, status names the streamer."""
    agent = start_agent('[s3]\ndata_plane = "streamer"\n')
    with Client(agent.socket_path) as client:
        assert client.status().data_plane == "streamer"


def test_auto_without_the_streamer_extra_pulls_with_the_auto_plane(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel
) -> None:
    """Without the streamer installed, "auto" is still the measured plane and the pull succeeds."""
    with _without_streamer(tmp_path, s3_server) as agent, Client(agent.socket_path) as client:
        assert client.status().data_plane == AUTO_DATA_PLANE
        handle = client.ensure(small_model.uri)
        assert tree_digest(Path(handle.path)) == tree_digest(small_model.source_dir)


def test_streamer_config_without_the_extra_refuses_to_start(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """A config that demands the missing streamer stops startup with a log saying how to fix it."""
    agent = _without_streamer(tmp_path, s3_server, '[s3]\ndata_plane = "streamer"\n')
    try:
        with pytest.raises(AgentStartupError):
            agent.start()
        log = agent.log_text()
    finally:
        agent.close()
    assert "data_plane is 'streamer'" in log
    assert "runai_model_streamer" in log
    assert "prewarm-agent[streamer]" in log


def test_asking_for_the_streamer_without_the_extra_is_invalid(
    tmp_path: Path, s3_server: S3Server, small_model: SampleModel
) -> None:
    """A request for the missing streamer is InvalidRequest and publishes nothing."""
    with _without_streamer(tmp_path, s3_server) as agent, Client(agent.socket_path) as client:
        with pytest.raises(InvalidRequest, match="no streamer data plane"):
            client.ensure(small_model.uri, data_plane="streamer")
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


@needs_streamer
def test_request_for_the_streamer_pulls_through_it(
    start_agent: AgentFactory, s3_server: S3Server, small_model: SampleModel
) -> None:
    """A request for the streamer moves the bytes through it: no botocore GETs, one per range."""
    agent = start_agent('[s3]\ndata_plane = "aiobotocore"\n')
    s3_server.clear_requests()
    with Client(agent.socket_path) as client:
        handle = client.ensure(small_model.uri, data_plane="streamer", chunk_size=MiB)
    assert tree_digest(Path(handle.path)) == tree_digest(small_model.source_dir)
    gets = _ranged_gets(s3_server, small_model)
    assert gets
    assert not any(_is_botocore(g) for g in gets)
    assert max(_range_length(g) for g in gets) == MiB  # one GET per journal range


def test_request_for_the_threads_plane_pulls_through_it(
    start_agent: AgentFactory, s3_server: S3Server, small_model: SampleModel
) -> None:
    """A request for the threads plane sends every ranged GET from its client, one per range."""
    agent = start_agent()
    s3_server.clear_requests()
    with Client(agent.socket_path) as client:
        handle = client.ensure(small_model.uri, data_plane="threads", chunk_size=MiB)
    assert tree_digest(Path(handle.path)) == tree_digest(small_model.source_dir)
    gets = _ranged_gets(s3_server, small_model)
    assert gets
    assert all(THREADS_USER_AGENT in g.user_agent for g in gets)
    assert max(_range_length(g) for g in gets) == MiB


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
