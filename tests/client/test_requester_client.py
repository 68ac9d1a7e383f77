"""as_requester on every client surface: the pod's own AWS credentials go on the wire.

Against a scripted agent that keeps each EnsureModelRequest; the credentials come from
botocore's standard chain (here AWS_* variables), as they would inside a pod.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from scripted_agent import ScriptedAgent, serve_scripted

from agent.client import AgentUnavailable, AsyncClient, Client, aensure, ensure

POD_KEYS = {
    "AWS_ACCESS_KEY_ID": "AKIAPODREQUESTER",
    "AWS_SECRET_ACCESS_KEY": "pod-secret",
    "AWS_SESSION_TOKEN": "pod-session",
}


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, ScriptedAgent]]:
    """A scripted agent, and a process whose AWS chain finds the pod's keys."""
    for name, value in POD_KEYS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    path = tmp_path / "agent.sock"
    with serve_scripted(path) as scripted:
        yield path, scripted


def _sent(scripted: ScriptedAgent) -> list[str | None]:
    """The key id each EnsureModel carried (None: no credentials)."""
    return [
        r.requester_credentials.access_key_id if r.HasField("requester_credentials") else None
        for r in scripted.ensure_requests
    ]


def test_ensure_and_leased_send_the_pods_credentials_only_when_asked(
    served: tuple[Path, ScriptedAgent],
) -> None:
    """Client.ensure, Client.leased and the ensure shortcut send key id, secret and session
    token with as_requester=True; a plain ensure sends none."""
    socket, scripted = served
    with Client(socket) as client:
        client.ensure("s3://b/m/")
        client.ensure("s3://b/m/", as_requester=True)
        # The scripted agent has no lease socket: the hold fails after the request went out.
        with pytest.raises(AgentUnavailable), client.leased("s3://b/m/", as_requester=True):
            pass
    ensure("s3://b/m/", socket_path=socket, as_requester=True)
    assert _sent(scripted) == [None, *[POD_KEYS["AWS_ACCESS_KEY_ID"]] * 3]
    sent = scripted.ensure_requests[1].requester_credentials
    assert (sent.secret_access_key, sent.session_token) == ("pod-secret", "pod-session")


async def test_async_client_and_aensure_send_the_pods_credentials(
    served: tuple[Path, ScriptedAgent],
) -> None:
    """AsyncClient.ensure and aensure share the builder: as_requester=True puts the keys on."""
    socket, scripted = served
    async with AsyncClient(socket) as client:
        await client.ensure("s3://b/m/", as_requester=True)
    await aensure("s3://b/m/", socket_path=socket, as_requester=True)
    assert _sent(scripted) == [POD_KEYS["AWS_ACCESS_KEY_ID"]] * 2


def _cli(*args: str, socket: Path, env: dict[str, str] | None = None) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREWARM_")}
    run = subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        env=clean | {"PREWARM_SOCKET_PATH": str(socket)} | (env or {}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return run.returncode


def test_pull_and_exec_send_credentials_with_the_flag_or_the_env_var(
    served: tuple[Path, ScriptedAgent],
) -> None:
    """`prewarm pull --as-requester`, PREWARM_AS_REQUESTER=1 and `prewarm exec --as-requester`
    send the pod's keys; a plain pull does not."""
    socket, scripted = served
    assert _cli("pull", "s3://b/m/", socket=socket) == 0
    assert _cli("pull", "s3://b/m/", "--as-requester", socket=socket) == 0
    assert _cli("pull", "s3://b/m/", socket=socket, env={"PREWARM_AS_REQUESTER": "1"}) == 0
    # exec then fails to hold the lease (no lease socket here); the request went out first.
    _cli("exec", "s3://b/m/", "--as-requester", "--", "true", socket=socket)
    assert _sent(scripted) == [None, *[POD_KEYS["AWS_ACCESS_KEY_ID"]] * 3]
