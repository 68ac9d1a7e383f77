"""Every ``prewarm`` command on a socket path it cannot use: one sentence, one exit status.

The commands are read from the typer app, so a command added later is held to the same
sentence without a line here. Each case runs every command one after another in this
process (``cli_helpers``: the typer app, with what reaches file descriptors 1 and 2 kept
as a real process's output); the case that needs another user starts one interpreter as
that user (``every_command_child.py``), which runs them all the same way. The
socket-directory case runs the real ``python -m agent.cli`` as that user.
"""

from __future__ import annotations

import grp
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from agent_helpers import NOBODY, outside_the_socket_group
from cli_helpers import argv_of, every_command, run_every_command

CHILD = str(Path(__file__).with_name("every_command_child.py"))
# What `prewarm exec` adds around the sentence: its name in a pod's log, the fallback's hint.
_EXEC_PREFIX = "prewarm: "
_EXEC_SUFFIX = re.compile(r" \(--fallback would run the command against \S+\)$")
_WHERE_THE_PATH_IS_SET = (
    "The agent serves on socket_path from its config (/etc/prewarm/agent.toml, or the file "
    "given to prewarmd --config); point this client at that path with --socket or "
    "PREWARM_SOCKET_PATH."
)
_START = "Start the agent (systemctl start prewarmd, or the prewarm DaemonSet's pod on this node)."


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}


def _run_every_command_as(prefix: list[str], socket_path: Path) -> dict[str, tuple[int, str]]:
    """Each command's (exit status, stderr), all run in one interpreter started through
    ``prefix`` (setpriv: another user)."""
    done = subprocess.run(
        [*prefix, sys.executable, CHILD, str(socket_path)],
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return {name: (status, stderr) for name, (status, stderr) in json.loads(done.stdout).items()}


def _the_one_sentence(ran: dict[str, tuple[int, str]]) -> str:
    """The sentence every command said (exec's name and fallback hint set aside), after
    checking each exited 3 with that one line and nothing else."""
    said: dict[str, str] = {}
    for name, (status, stderr) in ran.items():
        assert status == 3, (name, stderr)
        assert stderr.count("\n") == 1, (name, stderr)
        line = stderr.removesuffix("\n")
        if name == "exec":
            line = _EXEC_SUFFIX.sub("", line.removeprefix(_EXEC_PREFIX))
        said[name] = line
    assert len(set(said.values())) == 1, said
    return next(iter(said.values()))


def test_the_command_list_reaches_every_command() -> None:
    """The list the cases run is the app's: the top-level commands, exec and health, and every
    compile sub-command."""
    commands = every_command()
    for expected in [("ls",), ("pull",), ("exec",), ("health",), ("compile", "push")]:
        assert expected in commands
    assert ("compile", "compact") in commands
    assert ("compile",) not in commands


def test_a_missing_socket_is_one_sentence_from_every_command(tmp_path: Path) -> None:
    """No file at the path: every command exits 3 saying the socket does not exist, how to
    start the agent, and where its path is set on each side."""
    missing = tmp_path / "agent.sock"
    said = _the_one_sentence(run_every_command(missing))
    assert said == (
        f"error: cannot reach the prewarm agent at {missing}: the socket does not exist. "
        f"{_START} {_WHERE_THE_PATH_IS_SET}"
    )


def test_a_directory_is_one_sentence_from_every_command(tmp_path: Path) -> None:
    """A directory at the path (a connect to it is refused, like a dead socket's): every
    command exits 3 saying it is a directory, not a socket, never "connection refused"."""
    directory = tmp_path / "agent.sock"
    directory.mkdir()
    said = _the_one_sentence(run_every_command(directory))
    assert said == (
        f"error: cannot reach the prewarm agent at {directory}: it is a directory, not a socket. "
        f"{_WHERE_THE_PATH_IS_SET}"
    )


def test_a_regular_file_is_one_sentence_from_every_command(tmp_path: Path) -> None:
    """A regular file at the path: every command exits 3 saying it is a regular file, not a
    socket, and where the agent's socket path is set."""
    regular = tmp_path / "agent.sock"
    regular.write_text("not a socket")
    said = _the_one_sentence(run_every_command(regular))
    assert said == (
        f"error: cannot reach the prewarm agent at {regular}: it is a regular file, not a "
        f"socket. {_WHERE_THE_PATH_IS_SET}"
    )


def test_a_socket_this_user_may_not_open_is_one_sentence_from_every_command(
    tmp_path: Path,
) -> None:
    """A listening socket of another group, mode 0660, to a user outside that group: every
    command (health too, which once said no agent answered) exits 3 naming the socket's
    group and the fix, never click's "path is not readable" (exit 2)."""
    path = tmp_path / "agent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()
        outsider = outside_the_socket_group(path)
        said = _the_one_sentence(_run_every_command_as(outsider, path))
    group = grp.getgrgid(NOBODY).gr_name
    assert said == (
        f"error: cannot reach the prewarm agent at {path}: permission denied on the socket "
        f"(group {group}, mode 0660). Run as a member of group {group} or as root (in a pod: "
        f"securityContext.supplementalGroups: [{NOBODY}])."
    )


def test_a_socket_directory_this_user_may_not_enter_is_named_with_its_group(
    tmp_path: Path,
) -> None:
    """A socket inside a directory of another group, mode 0750, to a user outside that group:
    the command names that directory and its group (the socket itself cannot be seen)."""
    directory = tmp_path / "prewarm"
    directory.mkdir()
    path = directory / "agent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen()
        outsider = outside_the_socket_group(path)
        os.chown(directory, NOBODY, NOBODY)
        directory.chmod(0o750)
        done = subprocess.run(
            [*outsider, sys.executable, "-m", "agent.cli", *argv_of(("status",), path)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    group = grp.getgrgid(NOBODY).gr_name
    assert (done.returncode, done.stderr) == (
        3,
        f"error: cannot reach the prewarm agent at {path}: permission denied on the directory "
        f"{directory} (group {group}, mode 0750). Run as a member of group {group} or as root "
        f"(in a pod: securityContext.supplementalGroups: [{NOBODY}]).\n",
    )
