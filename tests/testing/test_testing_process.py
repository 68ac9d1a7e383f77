"""agent.testing._process: the start, wait and stop steps every helper server shares."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.testing._process import (
    SOURCE_ROOT,
    StartupFailure,
    purge_tree,
    read_until,
    source_env,
    stop_process,
)

READY = re.compile(rb"listening on port (\d+)\n")
Spawn = Callable[[str], "subprocess.Popen[bytes]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Starts Python children with a piped stdout and reaps every one of them afterwards."""
    children: list[subprocess.Popen[bytes]] = []

    def start(code: str) -> subprocess.Popen[bytes]:
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        children.append(child)
        return child

    yield start
    for child in children:
        stop_process(child, signal.SIGKILL, timeout=10.0)
        if child.stdout is not None:
            child.stdout.close()


def test_read_until_returns_the_match_once_the_child_prints_it(spawn: Spawn) -> None:
    """read_until returns as soon as the child's output matches, however it is split up."""
    child = spawn(
        "import sys, time; sys.stdout.write('starting\\nlistening on '); sys.stdout.flush(); "
        "time.sleep(0.2); print('port 4242', flush=True); time.sleep(60)"
    )

    match = read_until(child, READY, timeout=30.0)

    assert match.group(1) == b"4242"


def test_read_until_fails_at_once_when_the_child_exits_first(spawn: Spawn) -> None:
    """A child that exits before it is ready fails the wait then, not at the deadline."""
    child = spawn("print('bad config', flush=True); raise SystemExit(3)")
    started = time.monotonic()

    with pytest.raises(StartupFailure) as failure:
        read_until(child, READY, timeout=30.0)

    assert failure.value.reason == "exited with code 3 before it was ready"
    assert failure.value.output == b"bad config\n"
    assert time.monotonic() - started < 10


def test_read_until_gives_up_at_the_timeout_on_a_silent_child(spawn: Spawn) -> None:
    """A child that never prints the pattern fails the wait at the timeout."""
    child = spawn("print('thinking', flush=True); import time; time.sleep(60)")

    with pytest.raises(StartupFailure, match="was not ready within 1 s") as failure:
        read_until(child, READY, timeout=1.0)

    assert failure.value.output == b"thinking\n"


def test_stop_process_returns_true_when_the_signal_ends_the_child(spawn: Spawn) -> None:
    """A child that exits on SIGTERM is reaped and reported as a clean stop."""
    child = spawn("print('listening on port 1', flush=True); import time; time.sleep(60)")
    read_until(child, READY, timeout=30.0)

    assert stop_process(child, timeout=10.0)
    assert child.returncode == -signal.SIGTERM


def test_stop_process_kills_a_child_that_ignores_the_signal(spawn: Spawn) -> None:
    """A child that outlives the timeout after SIGTERM is SIGKILLed, and the call says so."""
    child = spawn(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('listening on port 1', flush=True); time.sleep(60)"
    )
    read_until(child, READY, timeout=30.0)

    assert not stop_process(child, timeout=0.5)
    assert child.returncode == -signal.SIGKILL


def test_stop_process_on_an_exited_child_is_a_no_op(spawn: Spawn) -> None:
    """Stopping a child that has already exited reports a clean stop and keeps its code."""
    child = spawn("raise SystemExit(5)")
    child.wait()

    assert stop_process(child, timeout=1.0)
    assert child.returncode == 5


def test_purge_tree_removes_read_only_directories(tmp_path: Path) -> None:
    """purge_tree deletes a tree whose directories the store made read-only."""
    published = tmp_path / "root" / "shm" / "model"
    published.mkdir(parents=True)
    (published / "weights").write_text("w")
    published.chmod(0o555)
    published.parent.chmod(0o555)

    purge_tree(tmp_path / "root")
    purge_tree(tmp_path / "root")  # already gone: not an error

    assert not (tmp_path / "root").exists()


def test_source_env_puts_this_checkout_first_on_pythonpath() -> None:
    """source_env prepends the checkout to PYTHONPATH and keeps what was there."""
    env = source_env({"PYTHONPATH": "/elsewhere", "KEEP": "1"})

    assert env["PYTHONPATH"].split(":") == [str(SOURCE_ROOT), "/elsewhere"]
    assert env["KEEP"] == "1"
    assert (SOURCE_ROOT / "agent" / "__init__.py").is_file()
