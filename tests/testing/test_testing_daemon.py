"""AgentProcess, driven with a stand-in daemon so it is tested apart from the real one.

The stand-in serves only the standard gRPC health service on PREWARM_SOCKET_PATH,
which is all AgentProcess relies on to call a daemon ready.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc  # type: ignore[import-untyped,unused-ignore]
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.testing import AgentProcess, AgentStartupError, AgentTimeouts

STAND_IN = """
import json, os, signal, sys, threading
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

with open(os.path.join(os.path.dirname(os.environ["PREWARM_SOCKET_PATH"]), "env.json"), "w") as f:
    json.dump(dict(os.environ), f)
servicer = health.HealthServicer()
server = grpc.server(futures.ThreadPoolExecutor(4))
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
server.add_insecure_port("unix:" + os.environ["PREWARM_SOCKET_PATH"])
server.start()
serving = health_pb2.HealthCheckResponse.SERVING
delay = float(os.environ.get("STAND_IN_WARMUP", "0"))
if delay:
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    threading.Timer(delay, servicer.set, ("", serving)).start()
else:
    servicer.set("", serving)
print("stand-in serving", flush=True)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
stop.wait()
server.stop(None).wait()
sys.exit(int(os.environ.get("STAND_IN_EXIT_CODE", "0")))
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> list[str]:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return [sys.executable, str(script)]


@pytest.fixture
def agent(stand_in: list[str]) -> Iterator[AgentProcess]:
    process = AgentProcess(argv=stand_in, env={"SOME_VAR": "1"})
    try:
        yield process
    finally:
        process.close()


def _health(process: AgentProcess) -> int:
    with grpc.insecure_channel(process.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        return int(response.status)


def test_start_returns_once_the_health_service_says_serving(agent: AgentProcess) -> None:
    """start() returns only when the daemon's health service answers SERVING."""
    agent.start()

    assert agent.running
    assert _health(agent) == health_pb2.HealthCheckResponse.SERVING


def test_start_follows_not_serving_until_serving(stand_in: list[str]) -> None:
    """A daemon that first reports NOT_SERVING is followed on the Watch stream until it serves."""
    warming = AgentProcess(argv=stand_in, env={"STAND_IN_WARMUP": "0.5"})
    try:
        warming.start()

        assert _health(warming) == health_pb2.HealthCheckResponse.SERVING
    finally:
        warming.close()


def test_paths_are_short_and_passed_in_the_environment(agent: AgentProcess) -> None:
    """Socket, tier roots and config sit under one short root and reach the daemon as PREWARM_*
    variables, beside the extra env.
    """
    agent.start()

    seen = json.loads((agent.root / "env.json").read_text())
    assert len(str(agent.socket_path)) < 100
    assert seen["PREWARM_SOCKET_PATH"] == str(agent.socket_path)
    assert seen["PREWARM_TIERS__SHM_ROOT"] == str(agent.shm_root)
    assert seen["PREWARM_TIERS__DISK_ROOT"] == str(agent.disk_root)
    assert seen["PREWARM_CONFIG"] == str(agent.config_path)
    assert agent.config_path.read_text() == ""
    assert seen["SOME_VAR"] == "1"


def test_inherited_prewarm_and_aws_variables_do_not_reach_the_agent(
    agent: AgentProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PREWARM_* and AWS_* variables of the test process are not inherited by the daemon."""
    monkeypatch.setenv("PREWARM_DEFAULT_TIER", "disk")
    monkeypatch.setenv("AWS_PROFILE", "production")

    env = agent.env()

    assert "PREWARM_DEFAULT_TIER" not in env
    assert "AWS_PROFILE" not in env


def test_startup_failure_reports_the_exit_code_and_output() -> None:
    """A daemon that exits during startup fails start() at once, with its exit code and output."""
    crashing = AgentProcess(
        argv=[sys.executable, "-c", "import sys; print('config is broken'); sys.exit(3)"]
    )
    started = time.monotonic()
    try:
        with pytest.raises(AgentStartupError, match=r"code 3(.|\n)*config is broken"):
            crashing.start()
    finally:
        crashing.close()
    # Noticed when the process exited, not at the 30 s deadline.
    assert time.monotonic() - started < 10


def test_startup_timeout_kills_an_agent_that_never_serves() -> None:
    """A daemon that never serves fails start() at the startup timeout and is killed."""
    silent = AgentProcess(
        argv=[sys.executable, "-c", "import time; time.sleep(60)"],
        timeouts=AgentTimeouts(startup=1.0),
    )
    try:
        with pytest.raises(AgentStartupError, match="did not report SERVING"):
            silent.start()
        assert not silent.running
    finally:
        silent.close()


def test_stop_sends_sigterm_and_returns_the_exit_code(agent: AgentProcess) -> None:
    """stop() ends the daemon with SIGTERM and returns its own exit code."""
    agent.start()

    assert agent.stop() == 0
    assert not agent.running


def test_kill_ends_the_agent_with_sigkill(agent: AgentProcess) -> None:
    """kill() ends the daemon with SIGKILL (exit code -9)."""
    agent.start()

    assert agent.kill() == -9


def test_restart_keeps_the_directory_and_serves_again(agent: AgentProcess) -> None:
    """restart() starts a new process on the same root, which serves again."""
    agent.start()
    first_pid = agent.pid
    (agent.root / "kept").write_text("x")

    agent.restart()

    assert agent.pid != first_pid
    assert (agent.root / "kept").read_text() == "x"
    assert _health(agent) == health_pb2.HealthCheckResponse.SERVING
    assert agent.log_text().count("stand-in serving") == 2


def test_close_removes_the_directory_even_when_read_only(stand_in: list[str]) -> None:
    """close() removes the root it made, read-only published directories included."""
    process = AgentProcess(argv=stand_in).start()
    published = process.shm_root / "snapshot"
    published.mkdir(parents=True)
    (published / "weights").write_text("w")
    published.chmod(0o555)

    process.close()

    assert not process.root.exists()


def test_root_is_made_in_the_given_parent_and_removed_by_close(
    stand_in: list[str], tmp_path: Path
) -> None:
    """parent= is where AgentProcess makes its root (the bench: /dev/shm); close() removes it."""
    with AgentProcess(argv=stand_in, parent=tmp_path) as process:
        assert process.root.parent == tmp_path
        assert process.socket_path.exists()

    assert not process.root.exists()


def test_a_with_block_whose_start_fails_still_removes_the_root() -> None:
    """A failed start inside ``with`` closes the AgentProcess, so its root does not leak."""
    crashing = AgentProcess(argv=[sys.executable, "-c", "raise SystemExit(4)"])

    with pytest.raises(AgentStartupError, match="code 4"), crashing:
        pass

    assert not crashing.root.exists()
