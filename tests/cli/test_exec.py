"""``prewarm exec`` end to end: the real CLI, the real daemon, a real PyTorch child.

``prewarm exec`` runs as a real process (``python -m agent.cli exec``) where the property
is the process's: the child's exit status passed through, the lease held under the
launcher's pid, SIGTERM forwarded, a launcher waiting for an agent that starts after it,
a user outside the socket's group. Where it is what exec says and which status it ends
with, it runs in this process (``cli_helpers``), its command still a real child whose
output is kept as exec's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from agent_helpers import outside_the_socket_group
from cli_helpers import Ran, prewarm_in_process

from agent.client import Client
from agent.testing import AgentProcess, InProcessAgent, S3Server, SampleModel

CHILD = str(Path(__file__).with_name("exec_child.py"))


def start_exec(*args: str, socket: Path, prefix: Sequence[str] = ()) -> subprocess.Popen[str]:
    """``prewarm exec ARGS`` on ``socket``; ``prefix`` runs it through another program."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(socket)
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "agent.cli", "exec", *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def exec_in_process(*args: str, socket: Path) -> Ran:
    """``prewarm exec ARGS`` on ``socket``, in this process; its command is a real child."""
    return prewarm_in_process("exec", *args, socket=socket)


def start_child_on(model: SampleModel, socket: Path) -> subprocess.Popen[str]:
    """``prewarm exec`` of the checking child; returns once the child has checked the tensors."""
    launcher = start_exec(
        model.uri,
        "--name",
        "test/exec",
        "--",
        sys.executable,
        CHILD,
        "{model}",
        str(model.source_dir),
        socket=socket,
    )
    assert launcher.stdout is not None
    first = launcher.stdout.readline()
    if first != "tensors match\n":
        launcher.kill()
        _, stderr = launcher.communicate(timeout=30)
        raise AssertionError(f"child said {first!r}; launcher stderr:\n{stderr}")
    return launcher


def test_exec_runs_the_command_on_the_cached_model_and_passes_its_exit_status_through(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """prewarm exec runs the command on the cached model's path and exits with its status."""
    launcher = start_child_on(small_model, agent_daemon.socket_path)
    _, stderr = launcher.communicate("7\n", timeout=60)
    assert launcher.returncode == 7, stderr
    assert f"cold pull of {small_model.uri}" in stderr


def test_exec_holds_the_lease_while_the_command_runs_and_not_after(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """prewarm exec holds a lease (as the launcher, under --name) only while the command runs."""
    launcher = start_child_on(small_model, agent_daemon.socket_path)
    with Client(agent_daemon.socket_path) as client:
        [lease] = client.get(small_model.uri).leases
        assert lease.held
        assert lease.pid == launcher.pid
        assert lease.client_name == "test/exec"
        launcher.communicate("0\n", timeout=60)
        assert launcher.returncode == 0
        assert client.get(small_model.uri).leases == ()


def test_exec_forwards_sigterm_and_exits_128_plus_the_signal(
    agent_daemon: AgentProcess, small_model: SampleModel
) -> None:
    """SIGTERM to prewarm exec reaches the command; it exits 128+15 and the lease is gone."""
    launcher = start_child_on(small_model, agent_daemon.socket_path)
    # The child runs in its own process group: only forwarding can reach it.
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    with Client(agent_daemon.socket_path) as client:
        assert client.get(small_model.uri).leases == ()


def test_exec_with_fallback_runs_the_command_on_the_uri_when_no_agent_answers(
    tmp_path: Path,
) -> None:
    """With --fallback and no agent, prewarm exec warns and runs the command on the URI itself."""
    uri = "s3://models/llama/"
    show_argv = "import sys; print(sys.argv[1:]); sys.exit(5)"
    done = exec_in_process(
        "--fallback",
        "--wait-for-agent",
        "0",
        uri,
        "--",
        sys.executable,
        "-c",
        show_argv,
        "--model={model}",
        socket=tmp_path / "no-agent.sock",
    )
    assert done.returncode == 5, done.stderr
    assert done.stdout == f"['--model={uri}']\n"
    assert "warning" in done.stderr
    assert "--fallback" in done.stderr


def test_exec_without_fallback_exits_3_when_no_agent_answers_in_time(tmp_path: Path) -> None:
    """Without --fallback, prewarm exec waits --wait-for-agent seconds for an agent, then exits 3
    naming the socket, the wait and what was missing, running nothing."""
    marker = tmp_path / "ran"
    done = exec_in_process(
        "--wait-for-agent",
        "0.5",
        "s3://models/llama/",
        "--",
        sys.executable,
        "-c",
        f"open({str(marker)!r}, 'w')",
        socket=tmp_path / "no-agent.sock",
    )
    assert done.returncode == 3, done.stderr
    assert "waiting for it (--wait-for-agent / PREWARM_WAIT_FOR_AGENT)" in done.stderr
    assert (
        f"no prewarm agent answered on {tmp_path / 'no-agent.sock'} within 0.5 s "
        "(the socket does not exist)"
    ) in done.stderr
    assert not marker.exists()


def test_exec_started_before_the_agent_waits_for_it_then_runs_the_command(
    s3_server: S3Server, small_model: SampleModel
) -> None:
    """A pod that starts before the node's agent: prewarm exec says it waits, and runs the command
    on the cached model once the agent serves, instead of exiting 3 at once."""
    agent = InProcessAgent(env=s3_server.env())
    try:
        launcher = start_exec(
            small_model.uri,
            "--",
            sys.executable,
            "-c",
            "import sys; print(sys.argv[1])",
            "{model}",
            socket=agent.socket_path,
        )
        assert launcher.stderr is not None
        said = launcher.stderr.readline()
        assert said.startswith("prewarm: the agent is not serving yet (the socket does not "), said
        agent.start()
        stdout, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, stderr
        assert Path(stdout.strip()).is_relative_to(agent.shm_root)
    finally:
        agent.close()


def test_exec_with_fallback_falls_back_when_the_socket_refuses_this_user(
    agent_daemon: AgentProcess,
) -> None:
    """A user outside the socket's group: --fallback runs the command on the URI at once, after a
    warning that names the group fix (not click's exit 2 for an unreadable path)."""
    uri = "s3://models/llama/"
    launcher = start_exec(
        "--fallback",
        uri,
        "--",
        sys.executable,
        "-c",
        "import sys; print(sys.argv[1:])",
        "{model}",
        socket=agent_daemon.socket_path,
        prefix=outside_the_socket_group(agent_daemon.socket_path),
    )
    stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, stderr
    assert stdout == f"['{uri}']\n"
    assert "permission denied on the socket (group " in stderr
    assert "--fallback: running the command against" in stderr
    assert "waiting" not in stderr  # group membership cannot change: no wait for it


# Escape sequences a hostile name could carry to the terminal: an OSC 8 link, a bell, a CSI
# that clears the screen, a right-to-left override.
HOSTILE = "\x1b]8;;https://evil.example\x07x\x1b[2J\u202e"
RAW = ("\x1b", "\x07", "\u202e")


def exec_failure(*args: str, socket: Path) -> tuple[int, str]:
    """``prewarm exec ARGS``, expected to fail before running anything: status and stderr."""
    done = exec_in_process(*args, socket=socket)
    return done.returncode, done.stderr


def test_every_exec_failure_path_writes_hostile_text_escaped(
    agent_daemon: AgentProcess, tmp_path: Path
) -> None:
    """ESC, OSC, BEL and RLO in what exec quotes back never reach the terminal raw, on every
    way it fails: a bad compile-key part (2), a URI the agent refuses (2), no agent on a socket
    whose path carries them (3), such a path too long for a socket address (3: grpc logged it
    raw), the agent's own refusal of a pull (1), the fallback's warnings; each line says
    "prewarm:" first and the status is the shared one."""
    child = ["--", sys.executable, "-c", "pass"]
    socket = agent_daemon.socket_path
    missing = tmp_path / HOSTILE / "agent.sock"
    cases = {
        "compile key": (["--compile-key", f"{HOSTILE}=1", "s3://b/m/", *child], socket, 2),
        "refused uri": ([f"s3://b/{HOSTILE}/", *child], socket, 2),
        "no agent": (["--wait-for-agent", "0", "s3://b/m/", *child], missing, 3),
        # Longer than a socket address holds: grpc would log it raw, were it handed over.
        "long path": (["--wait-for-agent", "0", "s3://b/m/", *child], missing / ("d" * 120), 3),
        "agent error": (["--cached-only", "s3://never-cached/model/", *child], socket, 1),
        "fallback": (["--wait-for-agent", "0", "--fallback", "s3://b/m/", *child], missing, 0),
    }
    for name, (args, on, status) in cases.items():
        code, stderr = exec_failure(*args, socket=on)
        assert code == status, f"{name}: {code} {stderr}"
        assert stderr, name
        for raw in RAW:
            assert raw not in stderr, f"{name}: {raw!r} reached the terminal: {stderr!r}"
        assert all(line.startswith("prewarm: ") for line in stderr.splitlines()), (name, stderr)
