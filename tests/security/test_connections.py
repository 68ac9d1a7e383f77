"""Idle connections against the daemon's descriptors (issue 16, item 8).

The real daemon (``python -m agent``) under a chosen open-file limit, flooded over real Unix
socket connections: 1,100 idle connections used to exhaust a 1,024-descriptor daemon, and then
no socket accepted anyone.
"""

from __future__ import annotations

import contextlib
import errno
import resource
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.client import Client
from agent.testing import AgentProcess, S3Server
from agent.testing._process import purge_tree

CAP = 64
FLOOD = 1100


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: Unix socket paths are limited to 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="pw-cn-", dir="/tmp"))
    yield directory
    purge_tree(directory)


@contextlib.contextmanager
def daemon_with_open_files(
    s3_server: S3Server, soft: int, hard: int, config: str
) -> Iterator[AgentProcess]:
    """The daemon started under ``prlimit --nofile=soft:hard``."""
    argv = ["prlimit", f"--nofile={soft}:{hard}", sys.executable, "-m", "agent"]
    agent = AgentProcess(env=s3_server.env(), config=config, argv=argv)
    try:
        yield agent.start()
    finally:
        agent.close()


def _flood(path: Path, count: int) -> list[socket.socket]:
    """``count`` connections that say nothing; non-blocking, so a full backlog never waits."""
    opened = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        if sock.connect_ex(str(path)) not in (0, errno.EAGAIN, errno.EINPROGRESS):
            sock.close()
            continue
        opened.append(sock)
    return opened


def _open_descriptors(pid: int) -> int:
    return sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())


def test_idle_connections_past_a_sockets_cap_leave_the_daemon_serving(
    s3_server: S3Server, short_dir: Path
) -> None:
    """1,100 idle connections to a tenant's socket, on a daemon limited to 1,024 descriptors:
    the socket keeps at most max_connections_per_socket of them (the rest are closed as they
    are accepted), the node's API socket answers throughout, and the tenant's socket serves
    again once the flood ends."""
    tenant_socket = short_dir / "a.sock"
    config = (
        f"[access]\nmax_connections_per_socket = {CAP}\n\n"
        f'[[access.sockets]]\nname = "team-a"\npath = "{tenant_socket}"\n'
    )
    with daemon_with_open_files(s3_server, 1024, 1024, config) as agent:
        assert agent.pid is not None
        before = _open_descriptors(agent.pid)
        flood = _flood(tenant_socket, FLOOD)
        try:
            with Client(agent.socket_path, timeout=20) as node:
                assert node.status().version
            # Every flooding connection the daemon accepted is one of its descriptors.
            assert _open_descriptors(agent.pid) <= before + CAP + 16
        finally:
            for sock in flood:
                sock.close()
        with Client(tenant_socket, timeout=20) as tenant:
            assert tenant.status().version


def test_the_daemon_raises_its_soft_open_file_limit_to_the_hard_one(
    s3_server: S3Server,
) -> None:
    """Started with the usual soft limit of 1,024 under a higher hard limit, the daemon raises
    its soft limit to the hard one, so its connection caps fit."""
    with daemon_with_open_files(s3_server, 1024, 8192, "") as agent:
        assert agent.pid is not None
        assert resource.prlimit(agent.pid, resource.RLIMIT_NOFILE) == (8192, 8192)
