"""A lease held by a running process survives a restart of the agent.

Before: ``prewarmd`` kept leases in memory only, so after a restart (a rolling
DaemonSet update, ``systemctl restart``) the snapshot of a still-running engine
showed 0 leases and ``prewarm evict`` without ``--force`` deleted its files.
Now the agent keeps the held leases on disk, restores those whose holder is
the same live process, and the client's hold takes its lease again when the
agent is back. Every test runs the real daemon (``AgentProcess``) and a real
holder process (``lease_holder.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import ProcessFactory, when_logged

from agent.client import Client
from agent.leases.held_file import HELD_LEASES_NAME
from agent.testing import AgentProcess, SampleModel
from agent.testing._process import StartupFailure, read_until

HOLDER = str(Path(__file__).with_name("lease_holder.py"))
_HELD = re.compile(rb"held (?P<key>[0-9a-f]+) (?P<id>\S+)\n")


class Holder:
    """``lease_holder.py`` in a subprocess: what it printed, and its lease."""

    def __init__(self, agent: AgentProcess, uri: str, mode: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, HOLDER, str(agent.socket_path), uri, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")},
        )
        match = read_until(self.proc, _HELD, timeout=30)
        self.key = match["key"].decode()
        self.lease_id = match["id"].decode()

    def wait_for(self, text: bytes, timeout: float = 30) -> bytes:
        """Block until the holder prints ``text``; what it printed up to there."""
        try:
            return read_until(self.proc, re.compile(re.escape(text)), timeout=timeout).string
        except StartupFailure as exc:
            raise AssertionError(f"the holder never printed {text!r}: {exc.output!r}") from exc

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        if holder.proc.poll() is None:
            holder.proc.kill()
        holder.proc.wait()
        for pipe in (holder.proc.stdin, holder.proc.stdout):
            if pipe is not None:
                pipe.close()


def _leases(agent: AgentProcess, uri: str) -> list[tuple[int | None, bool]]:
    """(holder pid, held) of every lease on the snapshot of ``uri``."""
    with Client(agent.socket_path) as client:
        return [(lease.pid, lease.held) for lease in client.get(uri).leases]


def _evict(agent: AgentProcess, uri: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(agent.socket_path)
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "evict", uri],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(("mode", "crash"), [("sync", False), ("async", True)])
def test_a_held_lease_survives_a_restart_and_evict_without_force_refuses(
    mode: str,
    crash: bool,
    start_agent_process: ProcessFactory,
    small_model: SampleModel,
    holders: list[Holder],
) -> None:
    """Leases seen across a restart (SIGTERM, or SIGKILL): 1 before, 1 right after (the
    same holder), 1 once the holder has taken it back; evict without --force refuses all
    along, and the lease ends when the holder exits.
    """
    agent = start_agent_process()
    holder = Holder(agent, small_model.uri, mode)
    holders.append(holder)
    before = _leases(agent, small_model.uri)

    agent.restart(kill=crash)
    after_restart = _leases(agent, small_model.uri)
    refused = _evict(agent, small_model.uri)
    holder.wait_for(b"is held again")
    taken_back = _leases(agent, small_model.uri)

    assert before == after_restart == taken_back == [(holder.proc.pid, True)]
    assert refused.returncode == 1, refused.stderr
    assert "lease" in refused.stderr
    with Client(agent.socket_path) as client:
        assert client.get(small_model.uri).path.is_dir()
    holder.stop()
    when_logged(agent, lambda: _leases(agent, small_model.uri) == [] or None, "the lease ended")
    assert _evict(agent, small_model.uri).returncode == 0


def test_prewarm_exec_keeps_its_engines_lease_across_a_restart(
    start_agent_process: ProcessFactory, small_model: SampleModel
) -> None:
    """The issue's case: `prewarm exec URI -- <engine>`, then the agent restarts. The engine's
    snapshot keeps its lease throughout, exec says on stderr that it took the lease again,
    and evict without --force refuses.
    """
    agent = start_agent_process()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    env["PREWARM_SOCKET_PATH"] = str(agent.socket_path)
    engine = [sys.executable, "-c", "import signal; signal.pause()"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "exec", small_model.uri, "--", *engine],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        read_until(launcher, re.compile(rb"prewarm: .*-> "), timeout=60)
        agent.restart()
        after_restart = _leases(agent, small_model.uri)
        refused = _evict(agent, small_model.uri)
        read_until(launcher, re.compile(rb"prewarm: warning: .* is held again"), timeout=30)
        taken_back = _leases(agent, small_model.uri)
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)
        assert launcher.stdout is not None
        launcher.stdout.close()
    assert after_restart == taken_back == [(launcher.pid, True)]
    assert refused.returncode == 1, refused.stderr


def test_a_lease_whose_holder_died_while_the_agent_was_down_is_not_restored(
    start_agent_process: ProcessFactory, small_model: SampleModel, holders: list[Holder]
) -> None:
    """A holder that exits while the agent is stopped leaves no lease behind after the start."""
    agent = start_agent_process()
    holder = Holder(agent, small_model.uri, "raw")
    holders.append(holder)
    agent.stop()
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait()
    agent.start()
    assert _leases(agent, small_model.uri) == []
    assert _evict(agent, small_model.uri).returncode == 0


def test_a_restored_lease_is_taken_back_only_by_the_process_that_held_it(
    start_agent_process: ProcessFactory, small_model: SampleModel, holders: list[Holder]
) -> None:
    """After a restart another process with the lease id is PERMISSION_DENIED; its holder
    gets it back with the same hello, and the restored lease's id was never on disk.
    """
    agent = start_agent_process()
    holder = Holder(agent, small_model.uri, "raw")
    holders.append(holder)
    agent.restart()
    assert holder.lease_id not in (agent.shm_root / HELD_LEASES_NAME).read_text()

    intruder = _hello(agent, holder.lease_id)
    holder.say("again")
    holder.wait_for(b'reply: {"ok": true')

    assert (intruder["ok"], intruder["code"]) == (False, "PERMISSION_DENIED")
    assert _leases(agent, small_model.uri) == [(holder.proc.pid, True)]


def test_the_client_takes_a_new_lease_when_the_agent_lost_its_own(
    start_agent_process: ProcessFactory, small_model: SampleModel, holders: list[Holder]
) -> None:
    """An agent that comes back without the lease (its file lost) gets a new one from the
    holder: EnsureModel with cached_only on the same snapshot, held at once.
    """
    agent = start_agent_process()
    holder = Holder(agent, small_model.uri, "sync")
    holders.append(holder)
    agent.stop()
    (agent.shm_root / HELD_LEASES_NAME).unlink()
    agent.start()
    holder.wait_for(b"is held again")
    assert _leases(agent, small_model.uri) == [(holder.proc.pid, True)]


def _hello(agent: AgentProcess, lease_id: str) -> dict[str, object]:
    """Say the lease socket's hello for ``lease_id`` from this process; the agent's reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(10)
        connection.connect(str(agent.socket_path.with_name("lease.sock")))
        connection.sendall(json.dumps({"lease": lease_id}).encode() + b"\n")
        reply: dict[str, object] = json.loads(connection.recv(4096))
        return reply
