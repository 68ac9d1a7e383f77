"""The client over a real Unix socket: status codes to the error tree, stream handling.

The server is tests.scripted_agent, a stand-in that answers what the test asks for.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from scripted_agent import serve_scripted

from agent.client import (
    AccessDenied,
    AgentUnavailable,
    AsyncClient,
    Client,
    Conflict,
    IntegrityError,
    InvalidRequest,
    NoSpace,
    NotFound,
    PrewarmError,
    Progress,
    SourceChanged,
    SourceUnavailable,
    aensure,
    ensure,
    wait_for_agent,
)
from agent.testing import AgentProcess


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "agent.sock"
    with serve_scripted(path):
        yield path


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("INVALID_ARGUMENT", InvalidRequest),
        ("NOT_FOUND", NotFound),
        ("PERMISSION_DENIED", AccessDenied),
        ("RESOURCE_EXHAUSTED", NoSpace),
        ("FAILED_PRECONDITION", Conflict),
        ("ABORTED", SourceChanged),
        ("UNAVAILABLE", SourceUnavailable),
        ("DATA_LOSS", IntegrityError),
    ],
)
def test_status_code_becomes_its_error_class_with_the_agents_message(
    socket_path: Path, code: str, error: type[PrewarmError]
) -> None:
    """Each mapped status code raises its error class with the agent's message, chained to the
    RpcError.
    """
    with Client(socket_path) as client, pytest.raises(error) as info:
        client.get(f"fail:{code}")
    assert str(info.value) == f"the agent says {code}"
    assert isinstance(info.value.__cause__, grpc.RpcError)


def test_unmapped_status_code_is_a_plain_prewarm_error(socket_path: Path) -> None:
    """A status code outside the error tree (INTERNAL) is a plain PrewarmError with the message."""
    with Client(socket_path) as client, pytest.raises(PrewarmError) as info:
        client.get("fail:INTERNAL")
    assert type(info.value) is PrewarmError
    assert "the agent says INTERNAL" in str(info.value)


def test_error_in_the_stream_is_mapped_too(socket_path: Path) -> None:
    """A status ending the EnsureModel stream maps to its error class like a unary call's."""
    with pytest.raises(NotFound, match="the agent says NOT_FOUND"):
        ensure("fail:NOT_FOUND", socket_path=socket_path)


def test_missing_socket_is_agent_unavailable_with_a_hint(tmp_path: Path) -> None:
    """No socket file is AgentUnavailable saying where it looked and how to point elsewhere."""
    missing = tmp_path / "nobody.sock"
    with Client(missing) as client, pytest.raises(AgentUnavailable) as info:
        client.status()
    assert str(info.value).startswith(
        f"cannot reach the prewarm agent at {missing}: the socket does not exist."
    )
    assert "PREWARM_SOCKET_PATH" in str(info.value)


def test_socket_nobody_listens_on_is_agent_unavailable(tmp_path: Path) -> None:
    """A socket file nobody listens on is AgentUnavailable saying the connection was refused."""
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(dead))
    with (
        Client(dead) as client,
        pytest.raises(AgentUnavailable, match="the connection was refused"),
    ):
        client.list_models()


def test_socket_path_comes_from_the_environment(
    socket_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an explicit path the client uses $PREWARM_SOCKET_PATH."""
    monkeypatch.setenv("PREWARM_SOCKET_PATH", str(socket_path))
    with Client() as client:
        assert client.socket_path == socket_path
        assert client.get("abcdef12").hit_count == 3


def test_ensure_reports_each_progress_event_and_returns_the_handle(socket_path: Path) -> None:
    """ensure() hands every progress event to the callback and returns the converted handle."""
    seen: list[Progress] = []
    handle = ensure("s3://b/m/", socket_path=socket_path, tier="disk", progress=seen.append)
    assert [p.bytes_done for p in seen] == [0, 50, 100]
    assert {p.phase for p in seen} == {"download"}
    assert handle.tier == "disk"
    assert handle.path == Path("/cache/k1")
    assert handle.files[0].etag == '"e"'
    assert handle.timings.download == 0.5


def test_stream_that_ends_without_a_handle_is_an_error(socket_path: Path) -> None:
    """An EnsureModel stream that ends without a handle is a PrewarmError, not a None."""
    with pytest.raises(PrewarmError, match="without a model handle"):
        ensure("s3://b/nohandle/", socket_path=socket_path)


def test_bare_string_as_include_is_refused_before_any_call(tmp_path: Path) -> None:
    """A bare string as include is refused locally instead of being split into one-letter globs."""
    with pytest.raises(InvalidRequest, match="sequence of glob patterns"):
        ensure("s3://b/m/", socket_path=tmp_path / "unused.sock", include="*.json")


def test_unknown_tier_is_refused_before_any_call(tmp_path: Path) -> None:
    """An unknown tier name is refused locally with the valid choices."""
    with pytest.raises(InvalidRequest, match="choose 'shm' or 'disk'"):
        ensure("s3://b/m/", socket_path=tmp_path / "unused.sock", tier="nvme")  # type: ignore[arg-type]


async def test_async_client_streams_progress_and_maps_errors(socket_path: Path) -> None:
    """The async client streams progress, returns handles, maps status codes like the sync one."""
    seen: list[Progress] = []
    handle = await aensure("s3://b/m/", socket_path=socket_path, progress=seen.append)
    assert handle.tier == "shm"
    assert len(seen) == 3
    async with AsyncClient(socket_path) as client:
        assert (await client.get("abcdef12")).key == "abcdef12"
        with pytest.raises(Conflict, match="the agent says FAILED_PRECONDITION"):
            await client.get("fail:FAILED_PRECONDITION")


async def test_async_client_on_missing_socket_is_agent_unavailable(tmp_path: Path) -> None:
    """The async client reports a missing socket as AgentUnavailable."""
    async with AsyncClient(tmp_path / "nobody.sock") as client:
        with pytest.raises(AgentUnavailable, match="the socket does not exist"):
            await client.status()


def test_exception_from_the_progress_callback_reaches_the_caller(socket_path: Path) -> None:
    """An exception raised by the progress callback propagates out of ensure() unchanged."""

    class Stop(Exception):
        pass

    def on_progress(_: Progress) -> None:
        raise Stop

    with pytest.raises(Stop):
        ensure("s3://b/m/", socket_path=socket_path, progress=on_progress)


def test_wait_for_agent_gives_up_after_its_timeout_naming_what_was_missing(
    tmp_path: Path,
) -> None:
    """wait_for_agent on a socket that never appears raises AgentUnavailable after the timeout,
    saying how long it waited and that the socket does not exist; 0 fails at once."""
    missing = tmp_path / "agent.sock"
    said: list[str] = []
    with pytest.raises(AgentUnavailable, match=r"within 0\.3 s \(the socket does not exist\)"):
        wait_for_agent(missing, 0.3, waiting=said.append)
    assert said == ["the socket does not exist"]
    with pytest.raises(AgentUnavailable, match="the socket does not exist"):
        wait_for_agent(missing, 0, waiting=said.append)
    assert len(said) == 1


def test_wait_for_agent_returns_at_once_when_the_agent_serves(agent_daemon: AgentProcess) -> None:
    """A serving agent: wait_for_agent returns without calling ``waiting``."""
    said: list[str] = []
    wait_for_agent(agent_daemon.socket_path, 5, waiting=said.append)
    assert said == []


def _directory(path: Path) -> None:
    path.mkdir()


def _regular_file(path: Path) -> None:
    path.write_text("not a socket")


def _named_pipe(path: Path) -> None:
    os.mkfifo(path)


@pytest.mark.parametrize(
    ("make", "kind"),
    [(_directory, "a directory"), (_regular_file, "a regular file"), (_named_pipe, "a named pipe")],
    ids=["directory", "regular-file", "named-pipe"],
)
def test_wait_for_agent_fails_at_once_on_a_path_that_is_not_a_socket(
    tmp_path: Path, make: Callable[[Path], None], kind: str
) -> None:
    """A path naming something other than a socket is said to be what it is, at once: the agent
    refuses to bind over it, so waiting (here up to 30 s) could never end well."""
    path = tmp_path / "agent.sock"
    make(path)
    said: list[str] = []
    with pytest.raises(AgentUnavailable) as info:
        wait_for_agent(path, 30, waiting=said.append)
    assert str(info.value).startswith(
        f"cannot reach the prewarm agent at {path}: it is {kind}, not a socket. "
    )
    assert said == []


def test_a_path_too_long_for_a_socket_address_is_not_waited_for(tmp_path: Path) -> None:
    """A path over the 107 bytes a socket address holds is AgentUnavailable at once, naming its
    length, from a call and from wait_for_agent alike (nothing reaches grpc)."""
    path = tmp_path / ("d" * 120) / "agent.sock"
    size = len(os.fsencode(path))
    expected = (
        f"cannot reach the prewarm agent at {path}: the path is {size} bytes, longer than the 107 "
        "a Unix socket address holds. Use a shorter path (--socket / PREWARM_SOCKET_PATH)."
    )
    with pytest.raises(AgentUnavailable) as waited:
        wait_for_agent(path, 30)
    with pytest.raises(AgentUnavailable) as called, Client(path) as client:
        client.status()
    assert str(waited.value) == str(called.value) == expected
