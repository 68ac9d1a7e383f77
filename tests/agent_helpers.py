"""Helpers shared by the integration tests (real agent, real S3 server)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import watchfiles

from agent.testing import AgentProcess, InProcessAgent, RecordedRequest

T = TypeVar("T")

# An agent serving on its socket: in this process, or a daemon subprocess.
RunningAgent = InProcessAgent | AgentProcess
# start_agent(config_toml="", s3=None) -> a started agent (see conftest).
AgentFactory = Callable[..., RunningAgent]
# start_agent_process(config_toml="", s3=None, env=None) -> a started daemon subprocess.
ProcessFactory = Callable[..., AgentProcess]


def tree_digest(directory: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``directory``."""
    return {
        path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def cache_entries(agent: RunningAgent) -> dict[str, list[str]]:
    """What each tier holds in each of its areas (published, staging, manifests...)."""
    found: dict[str, list[str]] = {}
    for tier_root in (agent.shm_root, agent.disk_root):
        for area in ("snapshots", "manifests", "staging", "trash"):
            directory = tier_root / area
            if directory.is_dir():
                names = sorted(p.name for p in directory.iterdir())
                if names:
                    found[f"{tier_root.name}/{area}"] = names
    return found


def object_gets(requests: list[RecordedRequest]) -> list[RecordedRequest]:
    """The object GETs among ``requests`` (listings and HEADs left out)."""
    return [r for r in requests if r.method == "GET" and r.key is not None]


@contextlib.contextmanager
def small_tmpfs(mount_point: Path, size: str, mode: str = "0755") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``mount_point`` (made if missing), to fill a tier for real.

    ``mode`` must not be group/world-writable: the agent refuses such tier roots.
    Skips the test where mounting is refused (it needs root).
    """
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); needs root")
    try:
        yield mount_point
    finally:
        done = subprocess.run(["umount", str(mount_point)], capture_output=True, check=False)
        if done.returncode != 0:  # still busy (a descriptor not yet closed): detach it now
            subprocess.run(["umount", "--lazy", str(mount_point)], check=False)


def when_logged(
    agent: RunningAgent, condition: Callable[[], T | None], what: str, timeout: float = 60.0
) -> T:
    """``condition()``'s first non-None answer, asked again each time the agent writes its log.

    Whatever a test waits for from the agent (an upload, a restore, a pin) ends
    with a log line, so a write to its log file is the moment to look again. The
    watch starts before the first look, and a quiet second looks once more, so
    no line can slip between.
    """
    stop = threading.Event()
    timer = threading.Timer(timeout, stop.set)
    timer.start()
    try:
        changes: Iterator[object] = watchfiles.watch(
            agent.log_path,
            watch_filter=None,
            debounce=50,
            rust_timeout=1000,
            stop_event=stop,
            yield_on_timeout=True,
        )
        answer = condition()
        for _ in changes:
            if answer is not None:
                break
            answer = condition()
    finally:
        timer.cancel()
    if answer is None:
        answer = condition()
    assert answer is not None, f"{what} within {timeout:g} s"
    return answer


NOBODY = 65534


def outside_the_socket_group(socket: Path) -> list[str]:
    """An argv prefix that runs a command the way a user outside the socket's group sees it.

    The interpreter lives under /root here, which no other uid may enter, so the
    command stays uid 0 but loses CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH
    (``setpriv`` drops them from the bounding set before exec), and the socket
    is handed to nobody:nogroup, mode 0660: the kernel then refuses the connect
    (EACCES) and access(2) refuses R_OK, exactly as for a non-root user.
    """
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to drop the DAC capabilities")
    os.chown(socket, NOBODY, NOBODY)
    socket.chmod(0o660)
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]
