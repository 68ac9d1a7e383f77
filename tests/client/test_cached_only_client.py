"""cached_only from the caller's side: the clients, `prewarm pull` and `prewarm exec` send it.

The server is tests.scripted_agent, which keeps every EnsureModel request it
receives; what the agent does with the field is in tests/service/test_offline_hits.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from scripted_agent import ScriptedAgent, serve_scripted

from agent.client import AsyncClient, Client, aensure, ensure


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, ScriptedAgent]]:
    path = tmp_path / "agent.sock"
    with serve_scripted(path) as scripted:
        yield path, scripted


def _cli(
    *args: str, socket: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        env=clean | {"PREWARM_SOCKET_PATH": str(socket)} | (env or {}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_client_calls_send_cached_only_only_when_asked(
    served: tuple[Path, ScriptedAgent],
) -> None:
    """Client.ensure and the ensure shortcut send cached_only when asked; plain ensure does not."""
    socket, scripted = served
    with Client(socket) as client:
        client.ensure("s3://b/m/")
        client.ensure("s3://b/m/", cached_only=True)
    ensure("s3://b/m/", socket_path=socket, cached_only=True)
    assert [r.cached_only for r in scripted.ensure_requests] == [False, True, True]


async def test_async_client_sends_cached_only(served: tuple[Path, ScriptedAgent]) -> None:
    """AsyncClient.ensure and aensure share the request builder: cached_only goes on the wire."""
    socket, scripted = served
    async with AsyncClient(socket) as client:
        await client.ensure("s3://b/m/", cached_only=True)
    await aensure("s3://b/m/", socket_path=socket, cached_only=True)
    assert [r.cached_only for r in scripted.ensure_requests] == [True, True]


def test_pull_flag_and_env_var_send_cached_only(served: tuple[Path, ScriptedAgent]) -> None:
    """`prewarm pull --cached-only` and PREWARM_CACHED_ONLY=1 send cached_only; a plain pull not."""
    socket, scripted = served
    for run in (
        _cli("pull", "s3://b/m/", socket=socket),
        _cli("pull", "s3://b/m/", "--cached-only", socket=socket),
        _cli("pull", "s3://b/m/", socket=socket, env={"PREWARM_CACHED_ONLY": "1"}),
    ):
        assert run.returncode == 0, run.stderr
    assert [r.cached_only for r in scripted.ensure_requests] == [False, True, True]


def test_exec_env_var_sends_cached_only(served: tuple[Path, ScriptedAgent]) -> None:
    """`prewarm exec` in a pod with PREWARM_CACHED_ONLY=1 asks the agent for cached_only."""
    socket, scripted = served
    _cli("exec", "s3://b/m/", "--", "true", socket=socket, env={"PREWARM_CACHED_ONLY": "1"})
    _cli("exec", "s3://b/m/", "--cached-only", "--", "true", socket=socket)
    assert [(r.cached_only, r.lease) for r in scripted.ensure_requests] == [
        (True, True),
        (True, True),
    ]
